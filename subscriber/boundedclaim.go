package subscriber

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"
	"github.com/outboxkit/watermill-outbox/internal/pgmeta"
)

// The bounded claim (docs/XMIN.md, option c) is the default relay's claim
// for Subscribe(ctx, AllTopics) on a table whose available_at defaults to
// clock_timestamp() (pgmeta.ClaimBoundDefault, migration 000009), unless
// Config.DisableBoundedClaim is set. Ordered relays, per-topic
// subscriptions, paused topics and tables with another default claim
// without a bound.
//
// Under a pinned xmin horizon the unbounded claim's index scan over
// (available_at, sequence) starts at the oldest entry and walks every dead
// entry the claims and acks left since the pin. The bounded claim adds a
// lower bound, (available_at, sequence) >= bound, so that the scan starts
// near the head. Its invariants:
//
//   - The sweep finds what the bound skips: every row a bounded claim skips because it is below the bound
//     is found by the sweep (the claim of the rows below the bound, every
//     sweepEvery) or by a later claim: the bound moves only to a cut or to
//     a claimed row below it, never above the cut;
//   - The cut: a cut is read in the round trip of one claim in every
//     boundedCutEvery, before that claim's snapshot: LEAST(
//     statement_timestamp() - margin, the xact_start of every other
//     transaction holding RowExclusiveLock on the table). A writer holds
//     that lock from before its row is formed until it ends, and the row's
//     available_at is clock_timestamp() when it is formed; so a row that a
//     claim sent after the cut cannot see has available_at at or above the
//     cut (its writer held the lock at the cut: the bound is at most its
//     start; or it took the lock after the cut). The claims between cuts
//     use the last cut read before they were sent;
//   - A hidden lock holder stops the bound: a cut that cannot see a lock holder's start (a prepared
//     transaction, or another role's session while the relay's role is not
//     a member of pg_read_all_stats) is NULL: the bound does not move until
//     a cut that can;
//   - How the bound moves: a claim that returned fewer rows than it asked for left no due
//     row at or above the bound unclaimed (SKIP LOCKED aside, the sweep finds what the bound skips), so the
//     next bound is the cut; a full claim took, in index order, every due
//     row it could see up to its last one, so the next bound is the lower
//     of that row's (available_at, sequence) and the cut;
//   - Retries land above the bound: retries, replays and a new leader's take-back set available_at
//     to now() or later: above any bound cut before their statement began,
//     and above a cut read while it ran unless the statement took the
//     table's lock more than the margin after it began (then the sweep finds what the bound skips);
//   - The column default decides the bound: every cut also reads available_at's default: when it is not
//     clock_timestamp() (the down migration of 000009) the relay drops the
//     bound and claims without one (the cut does not hold for rows formed at
//     their transaction's start); when it is again, the next claim's cut
//     sets a bound.
//
// What the bound can miss (expired leases of rows below it, rows skipped by
// SKIP LOCKED, a now() row whose statement took the lock beyond the margin,
// a step of the clock back by more than the margin, other relays' rows with
// DisableSingleActive) is found by the sweep, run beside the claim loop
// every sweepEvery on a pool connection, off the latency path: it claims
// only rows below the bound, so that outbox_sweep_claimed_total counts
// only what the bound missed. Nothing is lost; what the bound misses is
// delivered up to sweepEvery late.
type boundedClaims struct {
	cutSQL       string // the cut and whether available_at has the default the bound needs
	claimSQL     string // ClaimAll returning each row's available_at, with no bound
	boundSQL     string // claimSQL with the bound
	sweepSQL     string // ClaimAll of the rows below the bound only
	margin       time.Duration
	cutEvery     time.Duration
	offCutEvery  time.Duration
	sweepEvery   time.Duration
	defaultCheck string // the default available_at must have (pgmeta.ClaimBoundDefault)

	mu sync.Mutex
	// on: available_at defaults to clock_timestamp(), read at New and by
	// every cut since, so that a running relay follows migration 000009
	// up and down (the column default decides the bound).
	on      bool
	set     bool // no bound before the first claim with a cut
	at      time.Time
	seq     int64
	cut     time.Time // the last cut read (valid: haveCut)
	haveCut bool
	lastCut time.Time // when the last claim with a cut was sent
}

const (
	// boundedMargin is how far before the cut's statement start the bound
	// stays: room for a statement that writes available_at = now() (a
	// release, a take-back) and began just before the cut but took the
	// table's lock just after it, and for small steps of the clock. A row
	// the margin does not cover is found by the sweep (the sweep finds what the bound skips).
	boundedMargin = 50 * time.Millisecond
	// boundedCutEvery is how often a claim carries a cut. Claims between
	// cuts use the last cut read (the cut holds for any claim sent after it);
	// the bound then trails the head by at most boundedCutEvery plus
	// boundedMargin of rows, which is all a claim walks under a pinned
	// horizon, and most claims of a busy relay save the cut's reading of
	// pg_locks and pg_stat_activity.
	boundedCutEvery = 20 * time.Millisecond
	// boundedOffCheckEvery is how often a relay whose table lacks the
	// default the bound needs reads it again (with a cut), so that it takes
	// the bound once migration 000009 is applied.
	boundedOffCheckEvery = time.Second
)

// newBoundedClaims returns the bounded claim of s, or nil when s never
// claims with a bound: DisableBoundedClaim or an ordered relay. On a table
// whose available_at default is not pgmeta.ClaimBoundDefault it starts
// off, and every claim with a cut reads the default again.
func newBoundedClaims(ctx context.Context, s *Subscriber) (*boundedClaims, error) {
	if s.cfg.DisableBoundedClaim || s.cfg.Ordered {
		return nil, nil
	}
	const (
		order   = "\n  ORDER BY available_at, sequence"
		dueHead = "WITH due AS (\n  SELECT id FROM "
		parked  = ", o.dead_at IS NOT NULL AS parked\n)"
		last    = ", parked FROM claimed"
	)
	q := s.q.ClaimAll
	for _, part := range []string{order, dueHead, parked, last} {
		if strings.Count(q, part) != 1 {
			return nil, fmt.Errorf("bounded claim: the claim statement changed shape (%q); set DisableBoundedClaim and report it", part)
		}
	}
	def, err := pgmeta.ColumnDefault(ctx, s.pool, s.cfg.Table.Sanitize(), "available_at")
	if err != nil {
		return nil, fmt.Errorf("read the default of %s.available_at: %w", s.cfg.Table, err)
	}
	on := def == pgmeta.ClaimBoundDefault
	if !on {
		s.logger.Info("Claims without a bound: available_at defaults to "+def+", not "+pgmeta.ClaimBoundDefault+
			"; apply migration 000009 (schema.Migrate or `outbox migrate`) so that a pinned xmin horizon does not slow the claim", nil)
	}
	// The claim returns each row's available_at before the claim (due.due_at), from
	// which a full claim moves the bound (how the bound moves).
	claim := strings.Replace(q, dueHead, "WITH due AS (\n  SELECT id, available_at AS due_at FROM ", 1)
	claim = strings.Replace(claim, parked, ", o.dead_at IS NOT NULL AS parked, due.due_at\n)", 1)
	claim = strings.Replace(claim, last, ", parked, due_at FROM claimed", 1)
	return &boundedClaims{
		// the cut, a hidden lock holder stops the bound: NULL when a lock holder's start cannot be read.
		// A lock holder (l.locktype set) whose start is hidden makes it NULL:
		// a prepared transaction (no pid), or another role's session seen
		// without pg_read_all_stats (its row shows neither state nor
		// xact_start). A holder whose transaction ended between the reading
		// of pg_locks and of pg_stat_activity (no row, or an idle one) is
		// not waited for: its rows committed before the claim's snapshot.
		// No holder at all leaves min(xact_start) NULL, which LEAST skips.
		// (Treating every NULL xact_start as hidden made a draining relay's
		// cuts NULL whenever an ack ended in between, and its bound stay.)
		// the column default decides the bound: the second column tells whether available_at still has the
		// default the cut relies on.
		cutSQL: `SELECT CASE WHEN bool_or(l.locktype IS NOT NULL AND (l.pid IS NULL OR (a.pid IS NOT NULL AND a.xact_start IS NULL AND a.state IS NULL))) THEN NULL
  ELSE LEAST(statement_timestamp() - make_interval(secs => $2::float8), min(a.xact_start)) END,
  (SELECT COALESCE(pg_get_expr(d.adbin, d.adrelid), '') = $3::text
    FROM pg_attribute AS pa LEFT JOIN pg_attrdef AS d ON d.adrelid = pa.attrelid AND d.adnum = pa.attnum
    WHERE pa.attrelid = $1::text::regclass AND pa.attname = 'available_at' AND NOT pa.attisdropped),
  ` + claimPlanSettings + `
FROM (SELECT 1) AS one
LEFT JOIN pg_locks AS l ON l.locktype = 'relation' AND l.relation = $1::text::regclass AND l.mode = 'RowExclusiveLock'
  AND l.granted AND l.pid IS DISTINCT FROM pg_backend_pid()
LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid`,
		claimSQL:     claim,
		boundSQL:     strings.Replace(claim, order, "\n    AND (available_at, sequence) >= ($4::timestamptz, $5::bigint)"+order, 1),
		sweepSQL:     strings.Replace(q, order, "\n    AND (available_at, sequence) < ($4::timestamptz, $5::bigint)"+order, 1),
		margin:       boundedMargin,
		cutEvery:     boundedCutEvery,
		offCutEvery:  boundedOffCheckEvery,
		sweepEvery:   max(s.cfg.LockTTL/4, time.Second),
		defaultCheck: pgmeta.ClaimBoundDefault,
		on:           on,
	}, nil
}

// claimPlanSettings, sent before every bounded claim in its batch (one
// implicit transaction: set_config(..., true) lasts until its end, in every
// pgx QueryExecMode), make the claim's plan an ordered scan of the pending
// index that stops after its LIMIT, joined to the table by primary key.
// Without them the planner, which estimates few pending rows (the pending
// rows are a small part of the table, and a table never analysed gets the
// default estimates), picks a bitmap scan and a sort, which reads every
// entry from the bound up to now(): under a pinned horizon, every dead
// entry of a backlog, for every claim of its drain.
const claimPlanSettings = `set_config('enable_bitmapscan', 'off', true), set_config('enable_sort', 'off', true),
  set_config('enable_hashjoin', 'off', true), set_config('enable_mergejoin', 'off', true)`

// before reports whether (at1, seq1) < (at2, seq2), the claim index's order.
func before(at1 time.Time, seq1 int64, at2 time.Time, seq2 int64) bool {
	return at1.Before(at2) || (at1.Equal(at2) && seq1 < seq2)
}

// claim is Subscriber.claim for AllTopics with the bound.
func (b *boundedClaims) claim(ctx context.Context, s *Subscriber, n int) ([]*claimed, error) {
	out, err := b.lease(ctx, s, n)
	if err != nil {
		return nil, err
	}
	// The rows of a topic paused while the claim ran go back only once the
	// bound has moved by every row the statement took, given back or not:
	// a claim full of them still took its batch in index order (counted as
	// not full, it moved the bound to the cut, above the topic's older
	// rows, which then waited for the sweep after the resume).
	return s.unpaused(out), nil
}

// lease runs one bounded claim of n rows, moves the bound, and returns
// every row the claim leased.
func (b *boundedClaims) lease(ctx context.Context, s *Subscriber, n int) ([]*claimed, error) {
	// The cut and the claim go in one batch: one round trip, the cut's
	// statement first, so the claim's snapshot is taken after it. Only one
	// claim in boundedCutEvery carries a cut; the others use the last cut
	// read, which was read before their snapshot too.
	var (
		cut     *time.Time // NULL: a lock holder's start is hidden (a hidden lock holder stops the bound)
		on      bool       // the table has the default the bound needs (the column default decides the bound)
		withCut bool       // this claim carries a cut
	)
	pre := &claimPrelude{sql: `SELECT ` + claimPlanSettings, scan: func(r pgx.Row) error { return r.Scan(nil, nil, nil, nil) }}
	args := []any{s.cfg.MaxAttempts, s.cfg.LockTTL.Seconds(), n}
	query := b.claimSQL
	b.mu.Lock()
	now := time.Now()
	since := now.Sub(b.lastCut)
	if b.on && (!b.set || since >= b.cutEvery) || since >= b.offCutEvery {
		b.lastCut, withCut = now, true
		pre = &claimPrelude{sql: b.cutSQL, args: []any{s.cfg.Table.Sanitize(), b.margin.Seconds(), b.defaultCheck},
			scan: func(r pgx.Row) error { return r.Scan(&cut, &on, nil, nil, nil, nil) }}
	}
	if b.on && b.set {
		query, args = b.boundSQL, append(args, b.at, b.seq)
	}
	// The last cut known when this claim is sent was read before its
	// snapshot: a row this claim cannot see has available_at at or above
	// it (the cut).
	known, haveKnown := b.cut, b.haveCut && b.on
	b.mu.Unlock()
	out, parked, err := s.claimQuery(ctx, query, args, claimOpts{dueAt: true}, pre)
	if err != nil {
		return nil, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if withCut {
		if on != b.on {
			if on {
				s.logger.Info("available_at defaults to "+b.defaultCheck+" again: claiming with a bound", nil)
			} else {
				s.logger.Info("available_at no longer defaults to "+b.defaultCheck+" (migration 000009 reverted): claiming without a bound", nil)
			}
		}
		b.on = on
		b.haveCut = cut != nil
		if cut != nil {
			b.cut = *cut
		}
		known, haveKnown = b.cut, b.haveCut && on
	}
	if !b.on {
		b.set = false // the column default decides the bound: the cut's rule does not hold for rows formed at their transaction's start
		return out, nil
	}
	if !haveKnown {
		return out, nil // a hidden lock holder stops the bound (or no cut read yet): the bound stays where it is
	}
	if len(out)+parked < n {
		// how the bound moves: no due row at or above the bound was left unclaimed.
		b.at, b.seq, b.set = known, 0, true
		return out, nil
	}
	// how the bound moves: a full claim took, in index order, every due row it could see
	// up to its last one, K; the rows it could not see lie at or above the
	// cut. So the next bound is the lower of K and the cut (parked rows
	// are not in out: K may be lower than it could be, never higher).
	at, seq := known, int64(0)
	if len(out) > 0 {
		kAt, kSeq := out[0].dueAt, out[0].row.Sequence
		for _, c := range out[1:] {
			if before(kAt, kSeq, c.dueAt, c.row.Sequence) {
				kAt, kSeq = c.dueAt, c.row.Sequence
			}
		}
		if before(kAt, kSeq, at, seq) {
			at, seq = kAt, kSeq
		}
		b.at, b.seq, b.set = at, seq, true
	}
	return out, nil
}

// sweepBound returns the bound the sweep claims below, and false when the
// claim loop claims without one (no bound yet, the table without the
// default, or a topic paused: then its claims see every row the sweep
// would find).
func (b *boundedClaims) sweepBound() (time.Time, int64, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.at, b.seq, b.on && b.set
}

// sweep claims, every sweepEvery while the subscription lasts, the due rows
// below the bound (what the bound missed, the sweep finds what the bound skips: expired leases, rows skipped
// by SKIP LOCKED, other relays' rows), delivers them and counts them in
// outbox_sweep_claimed_total, until a claim is not full. It claims nothing
// while a topic is paused (the claim loop then claims without a bound,
// with the paused-topic filter) and takes its rows out of the
// subscription's MaxInFlight like the claim loop.
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
		for s.IsLeader() && s.modeLock.modeReady(s) == nil {
			if s.pausedTopics(sub.ctx) != nil {
				break
			}
			at, seq, ok := s.bounded.sweepBound()
			if !ok {
				break
			}
			n := sub.slots.Reserve(s.cfg.BatchSize)
			if n == 0 {
				break
			}
			took, parked, err := s.claimQuery(sub.ctx, s.bounded.sweepSQL,
				[]any{s.cfg.MaxAttempts, s.cfg.LockTTL.Seconds(), n, at, seq}, claimOpts{onPool: true}, nil)
			if err != nil {
				sub.slots.Unreserve(n)
				if sub.ctx.Err() == nil {
					sub.logger.Error("Bounded claim: sweep failed; retrying at the next sweep", err, nil)
				}
				break
			}
			batch := s.unpaused(took) // a pause read while the sweep ran
			sub.slots.Unreserve(n - len(batch))
			if len(batch)+parked > 0 {
				sub.logger.Debug("Bounded claim: the sweep found rows below the bound", watermill.LogFields{"rows": len(batch), "parked": parked})
				s.cfg.Metrics.Swept(s.label, len(batch))
			}
			if !sub.deliver(batch, stop) {
				return
			}
			if len(took)+parked < n {
				break
			}
		}
	}
}
