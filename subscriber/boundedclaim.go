package subscriber

import (
	"context"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/schema"
)

// The bounded claim (docs/XMIN.md, option c) is the default relay's claim
// for Subscribe(ctx, AllTopics) on a table whose available_at defaults to
// clock_timestamp() (schema.AvailableAtDefault, migration 000009), unless
// Config.DisableBoundedClaim is set. Tables with the older default, ordered
// relays, per-topic subscriptions and paused topics claim without a bound.
//
// Under a pinned xmin horizon the unbounded claim's index scan over
// (available_at, sequence) starts at the oldest entry and walks every dead
// entry the claims and acks left since the pin. The bounded claim adds a
// lower bound, (available_at, sequence) >= bound, so that the scan starts
// near the head. Its invariants:
//
//   - (B1) every row a bounded claim skips because it is below the bound
//     is found by the sweep (the unbounded claim, every sweepEvery) or by a
//     later claim: the bound moves only to a cut, never above it;
//   - (B2) a cut is read in the round trip of one claim in every
//     boundedCutEvery, before that claim's snapshot (the claims between
//     keep the bound): LEAST(statement_timestamp() - margin, the xact_start of
//     every other transaction holding RowExclusiveLock on the table). A
//     writer holds that lock from before its row is formed until it ends,
//     and the row's available_at is clock_timestamp() when it is formed;
//     so a row the claim cannot see yet has available_at at or above the
//     cut (its writer held the lock at the cut: the bound is at most its
//     start; or it took the lock after the cut);
//   - (B3) a cut that cannot see a lock holder's start (a prepared
//     transaction, or another role's session while the relay's role is not
//     a member of pg_read_all_stats) is NULL: the bound does not move;
//   - (B4) a claim with a cut that returned fewer rows than it asked for
//     left no due row at or above the bound unclaimed (SKIP LOCKED aside,
//     B1), so the next bound is that claim's cut; a full claim keeps the
//     bound (lowered to the cut if that is lower);
//   - (B5) retries, replays and a new leader's take-back set available_at
//     to now() or later: above any bound cut before their statement began,
//     and above a cut read while it ran unless the statement took the
//     table's lock more than the margin after it began (then B1).
//
// What the bound can miss (expired leases of rows below it, rows skipped by
// SKIP LOCKED, a now() row whose statement took the lock beyond the margin,
// a step of the clock back by more than the margin, other relays' rows with
// DisableSingleActive) is found
// by the sweep, run beside the claim loop every sweepEvery on a pool
// connection, off the latency path, and counted in
// outbox_sweep_claimed_total. Nothing is lost; what the bound misses is
// delivered up to sweepEvery late.
type boundedClaims struct {
	cutSQL, claimSQL string
	margin           time.Duration
	cutEvery         time.Duration
	sweepEvery       time.Duration

	mu      sync.Mutex
	set     bool // no bound before the first claim that was not full
	at      time.Time
	seq     int64
	lastCut time.Time // when the last claim with a cut was sent
}

const (
	// boundedMargin is how far before the cut's statement start the bound
	// stays: room for a statement that writes available_at = now() (a
	// release, a take-back) and began just before the cut but took the
	// table's lock just after it, and for small steps of the clock. A row
	// the margin does not cover is found by the sweep (B1).
	boundedMargin = 50 * time.Millisecond
	// boundedCutEvery is how often a claim carries a cut. Claims between
	// cuts use the bound as it is (B1 holds: it does not move); the bound
	// then trails the head by at most boundedCutEvery plus boundedMargin
	// of rows, which is all a claim walks under a pinned horizon, and most
	// claims of a busy relay save the cut's reading of pg_locks and
	// pg_stat_activity.
	boundedCutEvery = 20 * time.Millisecond
)

// newBoundedClaims returns the bounded claim of s, or nil when s claims
// without a bound: DisableBoundedClaim, an ordered relay, or a table whose
// available_at default is not schema.AvailableAtDefault (read only when
// the rest allows the bound).
func newBoundedClaims(ctx context.Context, s *Subscriber) (*boundedClaims, error) {
	if s.cfg.DisableBoundedClaim || s.cfg.Ordered {
		return nil, nil
	}
	const order = "\n  ORDER BY available_at, sequence"
	if strings.Count(s.q.ClaimAll, order) != 1 {
		return nil, nil
	}
	def, err := schema.AvailableAtDefaultOf(ctx, s.pool, s.cfg.Table)
	if err != nil {
		return nil, err
	}
	if def != schema.AvailableAtDefault {
		s.logger.Info("Claims without a bound: available_at defaults to "+def+", not "+schema.AvailableAtDefault+
			"; apply migration 000009 (schema.Migrate or `outbox migrate`) so that a pinned xmin horizon does not slow the claim", nil)
		return nil, nil
	}
	return &boundedClaims{
		// B2, B3: NULL when a lock holder's start cannot be read.
		// A lock holder (l.locktype set) whose start is hidden makes it NULL;
		// no holder at all leaves min(xact_start) NULL, which LEAST skips.
		cutSQL: `SELECT CASE WHEN bool_or(l.locktype IS NOT NULL AND (l.pid IS NULL OR a.xact_start IS NULL)) THEN NULL
  ELSE LEAST(statement_timestamp() - make_interval(secs => $2::float8), min(a.xact_start)) END
FROM (SELECT 1) AS one
LEFT JOIN pg_locks AS l ON l.locktype = 'relation' AND l.relation = $1::text::regclass AND l.mode = 'RowExclusiveLock'
  AND l.granted AND l.pid IS DISTINCT FROM pg_backend_pid()
LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid`,
		claimSQL:   strings.Replace(s.q.ClaimAll, order, "\n    AND (available_at, sequence) >= ($4::timestamptz, $5::bigint)"+order, 1),
		margin:     boundedMargin,
		cutEvery:   boundedCutEvery,
		sweepEvery: max(s.cfg.LockTTL/4, time.Second),
	}, nil
}

// claim is Subscriber.claim for AllTopics with the bound.
func (b *boundedClaims) claim(ctx context.Context, s *Subscriber, n int) ([]*claimed, error) {
	// The cut and the claim go in one batch: one round trip, the cut's
	// statement first, so the claim's snapshot is taken after it. Only one
	// claim in boundedCutEvery carries a cut; the others keep the bound.
	var (
		cut *time.Time    // NULL: a lock holder's start is hidden (B3)
		pre *claimPrelude // the cut, when this claim carries one
	)
	args := []any{s.cfg.MaxAttempts, s.cfg.LockTTL.Seconds(), n}
	query := s.q.ClaimAll
	b.mu.Lock()
	if now := time.Now(); !b.set || now.Sub(b.lastCut) >= b.cutEvery {
		b.lastCut = now
		pre = &claimPrelude{sql: b.cutSQL, args: []any{s.cfg.Table.Sanitize(), b.margin.Seconds()},
			scan: func(r pgx.Row) error { return r.Scan(&cut) }}
	}
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
	case pre == nil, cut == nil:
		// No cut in this claim, or B3: the bound stays where it is.
	case len(out)+parked < n:
		b.at, b.seq, b.set = *cut, 0, true
	case b.set && cut.Before(b.at):
		b.at, b.seq = *cut, 0
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
				s.cfg.Metrics.Swept(s.label, len(batch))
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
