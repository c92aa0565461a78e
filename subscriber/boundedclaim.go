package subscriber

import (
	"context"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/internal/experiment"
)

// The bounded claim is a prototype of docs/XMIN.md, option (c), off unless
// experiment.BoundedClaim is set when the subscriber is created: it does
// not change the default behaviour.
//
// Under a pinned xmin horizon the default claim's index scan over
// (available_at, sequence) starts at the oldest entry and walks every dead
// entry the claims and acks left since the pin. The bounded claim adds a
// lower bound, (available_at, sequence) >= bound, so that the scan starts
// near the head:
//
//   - with each claim, in the same round trip and before it, a cut reads statement_timestamp() - margin and the
//     xact_start of every other transaction holding RowExclusiveLock on the
//     table (a writer holds it from before its row exists until it ends; a
//     row's available_at defaults to now(), its transaction's start). The
//     cut is read before the claim's snapshot, so every row that claim
//     cannot see yet has available_at at or above it, except a row of a
//     transaction that started before the cut but took the lock after it;
//   - a claim that returned fewer rows than it asked for left no due row
//     at or above the bound unclaimed: the next bound is that claim's cut. A
//     full claim keeps the bound (lowered to the cut if that is lower);
//   - retries, replays and a new leader's take-back set available_at to
//     now() or later: above any earlier bound.
//
// What the bound can miss (expired leases of rows below it, rows skipped by
// SKIP LOCKED, the late lock-takers above, other relays' rows with
// DisableSingleActive) is found by the sweep: the unbounded claim, run beside
// the claim loop every sweepEvery on a pool connection, off the latency
// path. Nothing is lost; what the bound misses is delivered up to
// sweepEvery late.
type boundedClaims struct {
	cutSQL, claimSQL string
	margin           time.Duration
	sweepEvery       time.Duration

	mu  sync.Mutex
	set bool // no bound before the first claim that was not full
	at  time.Time
	seq int64
}

// boundedMargin is how far before the cut's statement start the bound
// stays: a writer's statement that began just before the cut and took the
// table's lock just after it is still above the bound.
const boundedMargin = 250 * time.Millisecond

// newBoundedClaims returns the bounded claim of s, or nil (the default)
// unless the prototype's switch is on.
func newBoundedClaims(s *Subscriber) *boundedClaims {
	if !experiment.BoundedClaim.Load() || s.cfg.Ordered {
		return nil
	}
	const order = "\n  ORDER BY available_at, sequence"
	if strings.Count(s.q.ClaimAll, order) != 1 {
		return nil
	}
	return &boundedClaims{
		cutSQL: `SELECT LEAST(statement_timestamp() - make_interval(secs => $2::float8),
  (SELECT min(a.xact_start) FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
   WHERE l.locktype = 'relation' AND l.relation = $1::text::regclass AND l.mode = 'RowExclusiveLock' AND l.pid <> pg_backend_pid()))`,
		claimSQL:   strings.Replace(s.q.ClaimAll, order, "\n    AND (available_at, sequence) >= ($4::timestamptz, $5::bigint)"+order, 1),
		margin:     boundedMargin,
		sweepEvery: max(s.cfg.LockTTL/4, time.Second),
	}
}

// claim is Subscriber.claim for AllTopics with the bound.
func (b *boundedClaims) claim(ctx context.Context, s *Subscriber, n int) ([]*claimed, error) {
	// The cut and the claim go in one batch: one round trip, the cut's
	// statement first, so the claim's snapshot is taken after it.
	var cut time.Time
	pre := &claimPrelude{sql: b.cutSQL, args: []any{s.cfg.Table.Sanitize(), b.margin.Seconds()},
		scan: func(r pgx.Row) error { return r.Scan(&cut) }}
	args := []any{s.cfg.MaxAttempts, s.cfg.LockTTL.Seconds(), n}
	query := s.q.ClaimAll
	b.mu.Lock()
	if b.set {
		query, args = b.claimSQL, append(args, b.at, b.seq)
	}
	b.mu.Unlock()
	out, parked, err := s.claimQuery(ctx, query, args, false, pre)
	if err != nil {
		return nil, err
	}
	b.mu.Lock()
	switch {
	case len(out)+parked < n:
		b.at, b.seq, b.set = cut, 0, true
	case b.set && cut.Before(b.at):
		b.at, b.seq = cut, 0
	}
	b.mu.Unlock()
	return out, nil
}

// sweep runs the unbounded claim every sweepEvery while the subscription
// lasts, delivering what it finds, until a claim is not full.
func (sub *subscription) sweep(stop <-chan struct{}) {
	s := sub.s
	t := time.NewTicker(s.bounded.sweepEvery)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
		}
		for s.IsLeader() {
			free := s.cfg.MaxInFlight - int(sub.inflight.Load())
			if free <= 0 {
				break
			}
			n := min(s.cfg.BatchSize, free)
			batch, parked, err := s.claimQuery(sub.ctx, s.q.ClaimAll, []any{s.cfg.MaxAttempts, s.cfg.LockTTL.Seconds(), n}, true, nil)
			if err != nil {
				if sub.ctx.Err() == nil {
					sub.logger.Error("Bounded claim: sweep failed; retrying at the next sweep", err, nil)
				}
				break
			}
			if len(batch) > 0 {
				sub.logger.Debug("Bounded claim: the sweep found rows below the bound", watermill.LogFields{"rows": len(batch)})
			}
			if !sub.deliver(batch, stop) {
				return
			}
			if len(batch)+parked < n {
				break
			}
		}
	}
}
