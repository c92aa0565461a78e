package subscriber

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/fnv"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/keyed"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/term"
	"github.com/outboxkit/watermill-outbox/schema"
)

// Ordered mode (docs/ORDERING.md). Writers of one key serialise on a
// per-key advisory lock, so the committed rows of a key always form a
// gap-free prefix in sequence order. A relay owns partitions by lease and
// keeps, per partition, a floor: every keyed row at or below it is done
// (acked, or covered by its key's hold). The floor is the only progress
// written on the happy path, once per tick; rows are never updated.

// ErrOrderedNotMigrated is matched (errors.Is) by the error of New when
// Config.Ordered is set on a table without the ordering_key column, or
// without the companion tables that its start's switch to ordered mode
// would not create (ordered mode is recorded already, or the table has no
// mode table), and by the error of Subscribe when that switch could not
// create them (the relay's role may not); it names the migration to run.
var ErrOrderedNotMigrated = errors.New("table not migrated for ordered mode")

// checkOrdered fails when the table lacks what ordered mode needs and the
// relay's start will not add. Ordered mode's companion tables come with the
// switch to ordered mode (schema.SwitchMode), which the relay's start runs
// on a table of another recorded mode: then atStart is true, and the start
// checks them once it has switched (checkOrderedTables).
func checkOrdered(ctx context.Context, pool *pgxpool.Pool, t schema.Table, cols schema.Columns) (oq *sqlq.OrderedQueries, atStart bool, err error) {
	run := orderedMigrateFix(t)
	if !cols.OrderingKey {
		return nil, false, fmt.Errorf("subscriber: invalid config: Ordered needs the ordering_key column in %s; %s: %w", t, run, ErrOrderedNotMigrated)
	}
	ok, walOpen, err := sqlq.OrderedReady(ctx, pool, t)
	if err != nil {
		return nil, false, fmt.Errorf("subscriber: %w", err)
	}
	if !ok {
		if atStart, err = sqlq.SwitchesToOrdered(ctx, pool, t); err != nil {
			return nil, false, fmt.Errorf("subscriber: %w", err)
		}
		if !atStart {
			return nil, false, orderedTablesMissing(t)
		}
	}
	if walOpen > 0 {
		return nil, false, fmt.Errorf("subscriber: %w: Ordered refused for %s: the WAL relay holds %d key(s) (in %s: a dead or retrying row each), and ordered mode "+
			"does not read those holds; resolve them with the WAL relay running (`outbox keys held` lists them; replay or skip each held row, or wait for the "+
			"retrying ones to be delivered), then switch", schema.ErrKeysHeld, t, walOpen, t.HoldsTable())
	}
	if err := sqlq.CheckOrderedSequence(ctx, pool, t); err != nil {
		return nil, false, fmt.Errorf("subscriber: invalid config: Ordered: %w", err)
	}
	return sqlq.NewOrderedQueries(t, cols), atStart, nil
}

// orderedMigrateFix says how to give t what ordered mode needs.
func orderedMigrateFix(t schema.Table) string {
	return fmt.Sprintf("run `outbox migrate --ordered --table=%s` or schema.Migrate(ctx, pool, table, schema.WithMode(schema.ModeOrdered))", t)
}

// orderedTablesMissing is the error of a relay that finds t without
// ordered mode's companion tables (or with those of an older version).
func orderedTablesMissing(t schema.Table) error {
	return fmt.Errorf("subscriber: invalid config: Ordered needs the tables %s, %s and %s, with the hold states of migration 000005 (resolved_at, replay), "+
		"the partitions' term of migration 000006 (epoch), the one holds table of migration 000011 (mode, state) and %s.skipped_at of migration 000012; %s: %w",
		t.PartitionsTable(), t.RelaysTable(), t.HoldsTable(), t, orderedMigrateFix(t), ErrOrderedNotMigrated)
}

// checkOrderedTables checks, once the relay's start has switched t to
// ordered mode, that the switch gave it ordered mode's companion tables
// (New found them missing: Subscriber.orderedAtStart).
func checkOrderedTables(ctx context.Context, pool *pgxpool.Pool, t schema.Table) error {
	ok, _, err := sqlq.OrderedReady(ctx, pool, t)
	if err != nil {
		return fmt.Errorf("subscriber: %w", err)
	}
	if !ok {
		return orderedTablesMissing(t)
	}
	return nil
}

// Design (docs/ORDERING.md, "How it works"); the invariants the code keeps:
//
//   - Prefix: writers of one key hold the key's lock from enqueue to commit,
//     so a visible row of key K has every lower row of K that will ever
//     commit already visible. Delivering a key's rows in sequence order as
//     they become visible is therefore order-safe; the relay only has to
//     find rows that become visible late, below its scan position.
//   - Scan (per partition): every committed row at or below seen was loaded,
//     or belongs to a watch: a (writer, key hash) that held the key lock at
//     the cut that bounded the scan which passed the row. The scan reads
//     only up to the sequence value read before the lock list, so a row
//     invisible to the scan belongs to a writer that held its lock at the
//     cut. When that writer has ended, one rescan of its hash over the
//     watch's range finds what it committed; until then the loaded rows of
//     that hash above the range's start are watched (not delivered), so a
//     late row can never be overtaken by a later row of its key.
//   - Floor (per partition): floor = min(seen, every open row - 1, every
//     watch's start). Open rows are loaded rows neither acked nor covered by
//     a hold: each is queued on its key, or is the key's row in flight
//     (flying), and nothing else. A hold that comes to cover a key's rows
//     (written here, or read from the table) removes them from the open set,
//     the row in flight included. Every keyed row at or below the floor is
//     done: acked, or at or above its key's hold. Floors only rise and are
//     written with the lease at the tick they moved, or, while the xmin
//     horizon is pinned, at most every floorEvery (LockTTL/10).
//   - Holds: a hold (key, sequence) is written before the rows it covers
//     leave the open set: every row of the key at or above its sequence.
//     Rows of the key below an active hold are done; the relay delivers the
//     held row, and when it succeeds or is skipped, moves the hold to the
//     key's next row at or below seen, or resolves it (a tombstone: rows at
//     or below it are done) until the written floor passes it. A replay hold
//     (an operator's replay of a row already relayed) covers nothing.
//   - Terms: every lease of a partition is a term of the relay's ledger
//     (package internal/term, the core the WAL relay uses too; scope: the
//     partition, epoch: the one Acquire increments). A message is handed
//     out only as a copy registered under its partition's live term
//     (term.Term.Hand), so the core's invariants hold here: (one copy per key) at most
//     one copy of a key is out in the relay, and the relay takes a
//     partition again only once its ended terms have quiesced (every copy
//     ended, every write entered under them done: term.Ledger.Quiesced,
//     quiescence); (a term's end cancels its messages) the term's end (lease lost, deadline passed, released,
//     relay stopping) cancels its messages' contexts; (a verdict of an ended term is not progress) a verdict
//     counts only if its copy ended under the live term (term.Copy.End); a
//     nack's or a hold's write (Fail, Advance) runs inside
//     term.Term.Enter, so not after the term ended nor beside the
//     partition's next term here; and every write of progress or holds
//     (Renew, Release, Fail, Advance) is fenced on owner and epoch, so
//     nothing done under an ended term is written, whoever owns the
//     partition now; (nothing waits forever) a copy left in a handler by an ended term ends
//     at its verdict, DispatchTimeout + LockTTL/2 after the term ended, or
//     the relay's stop.

// orderedRelay delivers the keyed rows of one subscription; it is one relay
// of the table's membership.
type orderedRelay struct {
	sub    *subscription
	s      *Subscriber
	wake   chan struct{} // NOTIFY and leadership wake-ups, apart from the claim loop's
	oq     *sqlq.OrderedQueries
	times  orderedTimes
	id     string
	logger watermill.LoggerAdapter
	kick   chan struct{}
	locks  lockClasses // the writers' key-lock classes the cut watches

	// terms is the relay's term ledger: one term per partition lease, the
	// copies handed out under them, and the copies left in handlers by
	// ended terms (docs/ARCHITECTURE.md, "The term core").
	terms *term.Ledger

	mu    sync.Mutex
	parts map[int]*partState
	keys  map[string]*keyState
	// keyed is the per-key engine (internal/keyed), over the
	// subscription's slots: a key with a runner holds one of them, keys
	// ready beyond MaxInFlight wait in line for one, oldest first.
	keyed *keyed.Engine
	runWg sync.WaitGroup

	// gen counts local hold changes, so that a holds read that started
	// before a change does not undo it.
	gen int64
	// needHolds asks the next cycle to read the holds: set by a wake-up (an
	// operator's change notifies), a refresh request, and PollInterval after
	// the last read. A partition taken over is read with its first scan.
	needHolds bool
	// horizon watches the xmin horizon: while it is pinned, moving floors
	// are written at most every floorEvery (tick).
	horizon   horizonWatch
	holdsRead time.Time
}

type partState struct {
	id        int
	floor     int64 // in memory; every keyed row <= floor is done
	persisted int64
	ticked    int64              // the floor at the previous tick: a floor that did not move since is quiet
	seen      int64              // every committed row <= seen is loaded, or in a watch
	open      map[int64]struct{} // loaded rows neither acked nor covered by a hold
	watches   []*watch
	full      bool      // the last scan stopped for the read-ahead limit
	deadline  time.Time // local clock: deliver nothing after it
	renewed   time.Time
	releasing bool
	fresh     bool // taken over: its holds are not read yet

	// The term: one lease of the partition, from Acquire to its end in
	// memory (lost, not renewed in time, released, or the relay stopping).
	// Its epoch fences every write of progress or holds.
	term   *term.Term
	expiry *time.Timer // ends the term at deadline, between ticks
}

// watch is a writer that held the lock of key hash hash when a scan passed
// (from, to]: rows of that hash in the range may become visible later.
type watch struct {
	vxid     string
	hash     int32
	from, to int64
	ended    bool               // the writer ended; rescan in this cycle
	loaded   map[int64]struct{} // rows of the hash in the range already loaded
}

type entry struct {
	row *sqlq.OrderedRow
}

type keyState struct {
	// keyed.Key: Out while a runner works on the key (it holds one of the
	// subscription's slots).
	keyed.Key
	name     string
	p        *partState // the partition state the key belongs to
	queue    []*entry   // loaded, open rows in sequence order; none in flight
	flying   int64      // the queued row a runner delivers now (0: none); open until its verdict or a hold covers it
	hold     *holdState
	holdGen  int64 // gen of the last local change of hold
	lastDone int64 // highest sequence acked or skipped here, to check order
}

// holdState is a key's hold (keyed.Hold: the held row, its attempts, when
// it is due, its lifecycle state) and what the ordered relay adds.
type holdState struct {
	keyed.Hold
	replay    bool // a replay hold: the replay of a row already relayed; it covers no later row
	advancing bool // an Advance statement is running
	inflight  bool // the held row is being delivered
	acked     bool // the held row was acked: moving the hold on records no skip
}

func newOrderedRelay(sub *subscription) *orderedRelay {
	host, _ := os.Hostname()
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return &orderedRelay{
		sub:    sub,
		s:      sub.s,
		wake:   sub.s.wake.register(),
		oq:     sub.s.oq,
		times:  timesOf(sub.s.cfg),
		id:     host + "-" + strconv.Itoa(os.Getpid()) + "-" + hex.EncodeToString(b),
		logger: sub.logger,
		kick:   make(chan struct{}, 1),
		parts:  map[int]*partState{},
		keys:   map[string]*keyState{},
		locks:  lockClasses{legacy: sqlq.LegacyOrderingLockClass(sub.s.cfg.Table)},
		terms:  newTermLedger(sub.s),
	}
}

// newTermLedger is an ordered relay's term ledger: a copy of a live term
// is overdue after its overrun (DispatchTimeout + LockTTL/2), as a leased
// row of the default relay is, and a copy left in a handler by an ended
// term holds its key (and its partition) back for as long, counted from the
// term's end.
func newTermLedger(s *Subscriber) *term.Ledger {
	return term.New(term.Config{Overrun: s.overrunAfter(), Overdue: s.overrunAfter()})
}

// orderedTimes are the ordered relay's periods and bounds, derived once
// from its Config.
type orderedTimes struct {
	// tick is the period of membership, leases and floors.
	tick time.Duration
	// renew is how often a lease is renewed whatever its floor does.
	renew time.Duration
	// floorEvery is how often at most the floor of a partition whose floor
	// keeps moving is written while the xmin horizon is pinned; a floor
	// that stopped moving is written at the next tick (tick). While rows
	// flow under a pinned horizon, written floors lag the relay's by up to
	// this much: the cleaner, the runbook's replay of a delivered row and
	// the state readers see a row as done that much later, and a new owner
	// delivers again up to that much of acked rows.
	floorEvery time.Duration
	// pinnedAfter is how long a transaction may hold the horizon before the
	// floors' writes are spaced out: two ticks, at least a second.
	pinnedAfter time.Duration
	// margin is how long before its lease ends a relay stops delivering.
	margin time.Duration
	// readAhead bounds the open rows of a partition: a scan stops there.
	readAhead int
}

func timesOf(cfg Config) orderedTimes {
	tick := min(cfg.ElectionInterval, cfg.LockTTL/3)
	return orderedTimes{tick: tick, renew: cfg.LockTTL / 3, floorEvery: cfg.LockTTL / 10,
		pinnedAfter: max(2*tick, time.Second), margin: cfg.LockTTL / 5, readAhead: 4 * cfg.BatchSize}
}

// horizonWatch tells whether the xmin horizon is pinned: a transaction open
// for longer than pinnedAfter holds a snapshot, or the oldest running
// transaction id stayed the same for that long. Every row version an
// UPDATE leaves stays while the horizon is pinned (docs/XMIN.md), so a busy
// relay writes a moving floor at most every floorEvery then; otherwise at
// every tick, as soon as it moves (the old versions are pruned).
type horizonWatch struct {
	xmin  string    // the oldest running transaction id at the last read
	since time.Time // when xmin was first read as it is
}

// pinned reads the horizon (sqlq.Horizon) and reports whether it is pinned.
// A failed read counts as pinned (the floors are then written at the bounded
// rate).
func (w *horizonWatch) pinned(ctx context.Context, q schema.Querier, pinnedAfter time.Duration) bool {
	var xmin, xmax string
	var oldest float64
	if err := q.QueryRow(ctx, sqlq.Horizon).Scan(&xmin, &xmax, &oldest); err != nil {
		return true
	}
	now := time.Now()
	if xmin != w.xmin {
		w.xmin, w.since = xmin, now
	}
	return oldest >= pinnedAfter.Seconds() || (xmin != xmax && now.Sub(w.since) >= pinnedAfter)
}

func (r *orderedRelay) signal() {
	select {
	case r.kick <- struct{}{}:
	default:
	}
}

// run is the relay's main loop: membership and leases each tick, and scan
// cycles on wake-ups, polls and freed read-ahead. It takes part in the
// wake-up handshake as the default mode does: it holds the idle lock only
// while it sleeps, so writers notify only then.
func (r *orderedRelay) run(stop <-chan struct{}) {
	defer r.shutdown()
	tick := time.NewTicker(r.times.tick)
	defer tick.Stop()
	ctx := r.sub.ctx
	s := r.s
	var (
		holding bool
		idleGen uint64
		misses  int
		rate    float64 // rows per second, smoothed
		last    = time.Now()
	)
	defer func() {
		if holding {
			s.oidle.leave(idleGen, true)
		}
	}()
	// release gives the lock back; announce unless a notification (which
	// reached every relay) woke this one.
	release := func(announce bool) {
		if holding {
			s.oidle.leave(idleGen, announce)
			holding = false
		}
	}
	r.tick(ctx)
	for {
		select {
		case <-stop:
			return
		case <-tick.C:
			r.tick(ctx)
		default:
		}
		found, more := r.cycle(ctx)
		now := time.Now()
		if dt := now.Sub(last).Seconds(); dt > 0 {
			a := min(1, dt)
			rate = (1-a)*rate + a*float64(found)/dt
		}
		last = now
		if more {
			release(true)
			continue
		}
		var wait time.Duration
		switch {
		case found > 0:
			// Busy: stay off the idle lock and look again shortly.
			release(true)
			misses = 0
			wait = linger(rate)
		case holding && s.oidle.valid(idleGen):
			wait = s.cfg.PollInterval
		case holding:
			holding = false // the lock was lost: go through the handshake again
			continue
		default:
			if s.hooks.beforeIdle != nil {
				s.hooks.beforeIdle()
			}
			gen, st := s.oidle.enter(ctx)
			if st == idleHeld {
				// Look once more under the lock: a commit before it was
				// granted is visible now, later ones notify.
				holding, idleGen, misses = true, gen, 0
				continue
			}
			if st == idleCovered {
				// Another relay sleeps on the lock: writers notify, and
				// it notifies when it gives the lock back.
				misses = 0
				wait = min(s.cfg.PollInterval, coveredRecheck)
				break
			}
			misses++
			wait = idleRetry(misses)
		}
		r.mu.Lock()
		due := r.keyed.Due() // the earliest held row that waits for its time, as of the last walk
		r.mu.Unlock()
		if !due.IsZero() {
			wait = min(wait, max(0, time.Until(due)))
		}
		timer := time.NewTimer(wait)
		select {
		case <-stop:
			timer.Stop()
			return
		case <-tick.C:
			r.tick(ctx)
		case <-timer.C:
		case <-r.kick:
		case <-r.terms.Freed():
			// A copy of an ended term ended: a runner it kept out of
			// MaxInFlight may start, and so may the claim loop.
			r.sub.slots.Signal()
		case <-r.wake:
			r.mu.Lock()
			r.needHolds = true // an operator's change notifies too
			r.mu.Unlock()
			release(false)
			select { // coalesce the commits of a burst into one cycle
			case <-stop:
			case <-time.After(wakeCoalesce):
			}
		}
		timer.Stop()
	}
}

// shutdown waits for the runners and gives the partitions back.
func (r *orderedRelay) shutdown() {
	defer r.s.wake.unregister(r.wake)
	// Last: the copies left in handlers by ended terms no longer hold
	// anything back, and the goroutines that follow them end (nothing waits forever).
	defer r.terms.Close()
	r.runWg.Wait()
	if r.s.hooks.abandon.Load() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	r.mu.Lock()
	var ids []int32
	var floors, epochs []int64
	for id, p := range r.parts {
		p.advanceFloor()
		ids, floors, epochs = append(ids, int32(p.id)), append(floors, p.floor), append(epochs, p.term.Epoch()) //nolint:gosec // partition < 64
		r.dropPartLocked(id)
	}
	r.mu.Unlock()
	if len(ids) > 0 {
		if _, err := r.oq.Release(r.id, ids, floors, epochs).Exec(ctx, r.s.pool); err != nil {
			r.logger.Error("Could not give partitions back; they pass to other relays after the lock TTL", err, nil)
		}
	}
	if _, err := r.s.pool.Exec(ctx, r.oq.Leave, r.id); err != nil {
		r.logger.Error("Could not leave the relay membership", err, nil)
	}
}

// assigned returns the partitions that rendezvous hashing gives relay self
// among the live relays.
func assigned(self string, live []string) map[int]bool {
	out := map[int]bool{}
	hashes := make([]uint64, len(live))
	for i, id := range live {
		h := fnv.New64a()
		_, _ = h.Write([]byte(id))
		hashes[i] = h.Sum64()
	}
	for p := 0; p < schema.OrderingPartitions; p++ {
		var best string
		var bestScore uint64
		for i, id := range live {
			if sc := mix64(hashes[i] ^ (uint64(p)+1)*0x9e3779b97f4a7c15); best == "" || sc > bestScore || (sc == bestScore && id < best) {
				best, bestScore = id, sc
			}
		}
		if best == self {
			out[p] = true
		}
	}
	return out
}

// mix64 is the splitmix64 finaliser: every input bit moves every output bit.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	return x ^ x>>31
}
