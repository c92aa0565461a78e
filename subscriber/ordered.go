package subscriber

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/fnv"
	"os"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/redact"
	"github.com/outboxkit/watermill-outbox/internal/term"
	"github.com/outboxkit/watermill-outbox/metrics"
	"github.com/outboxkit/watermill-outbox/schema"
)

// Ordered mode (docs/ORDERING.md). Writers of one key serialise on a
// per-key advisory lock, so the committed rows of a key always form a
// gap-free prefix in sequence order. A relay owns partitions by lease and
// keeps, per partition, a floor: every keyed row at or below it is done
// (acked, or covered by its key's hold). The floor is the only progress
// written on the happy path, once per tick; rows are never updated.

// ErrOrderedNotMigrated is matched (errors.Is) by the error of New when
// Config.Ordered is set on a table without the ordering_key column or the
// companion tables; it names the migration to run.
var ErrOrderedNotMigrated = errors.New("table not migrated for ordered mode")

// checkOrdered fails when the table lacks what ordered mode needs.
func checkOrdered(ctx context.Context, pool *pgxpool.Pool, t schema.Table, cols schema.Columns) (*schema.OrderedQueries, error) {
	run := fmt.Sprintf("run `outbox migrate --ordered --table=%s` or schema.Migrate(ctx, pool, table, schema.WithOrderingKeyColumn())", t)
	if !cols.OrderingKey {
		return nil, fmt.Errorf("subscriber: invalid config: Ordered needs the ordering_key column in %s; %s: %w", t, run, ErrOrderedNotMigrated)
	}
	ok, err := schema.OrderedTablesExist(ctx, pool, t)
	if err != nil {
		return nil, fmt.Errorf("subscriber: %w", err)
	}
	if ok {
		if ok, err = schema.OrderedTermExists(ctx, pool, t); err != nil {
			return nil, fmt.Errorf("subscriber: %w", err)
		}
	}
	if !ok {
		return nil, fmt.Errorf("subscriber: invalid config: Ordered needs the tables %s, %s and %s, with the hold states of migration 000005 (resolved_at, replay) and the partitions' term of migration 000006 (epoch); %s: %w",
			t.PartitionsTable(), t.RelaysTable(), t.HoldsTable(), run, ErrOrderedNotMigrated)
	}
	if err := schema.CheckOrderedSequence(ctx, pool, t); err != nil {
		return nil, fmt.Errorf("subscriber: invalid config: Ordered: %w", err)
	}
	return schema.NewOrderedQueries(t, cols), nil
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
//     that hash above the range's start are parked (not delivered), so a
//     late row can never be overtaken by a later row of its key.
//   - Floor (per partition): floor = min(seen, every open row - 1, every
//     watch's start). Open rows are loaded rows neither acked nor covered by
//     a hold: each is queued on its key, or is the key's row in flight
//     (flying), and nothing else. A hold that comes to cover a key's rows
//     (written here, or read from the table) removes them from the open set,
//     the row in flight included. Every keyed row at or below the floor is
//     done: acked, or at or above its key's hold. Floors only rise and are
//     written each tick.
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
//     (term.Term.Hand), so the core's invariants hold here: (I1) at most
//     one copy of a key is out in the relay, and the relay takes a
//     partition again only once its ended terms have quiesced (every copy
//     ended, every write entered under them done: term.Ledger.Quiesced,
//     I5); (I2) the term's end (lease lost, deadline passed, released,
//     relay stopping) cancels its messages' contexts; (I3) a verdict
//     counts only if its copy ended under the live term (term.Copy.End); a
//     nack's or a hold's write (Fail, Advance) runs inside
//     term.Term.Enter, so not after the term ended nor beside the
//     partition's next term here; and every write of progress or holds
//     (Renew, Release, Fail, Advance) is fenced on owner and epoch, so
//     nothing done under an ended term is written, whoever owns the
//     partition now; (I4) a copy left in a handler by an ended term ends
//     at its verdict, DispatchTimeout + LockTTL/2 after the term ended, or
//     the relay's stop.

// orderedRelay delivers the keyed rows of one subscription; it is one relay
// of the table's membership.
type orderedRelay struct {
	sub    *subscription
	s      *Subscriber
	wake   chan struct{} // NOTIFY and leadership wake-ups, apart from the claim loop's
	oq     *schema.OrderedQueries
	id     string
	logger watermill.LoggerAdapter
	kick   chan struct{}
	class  int32
	// legacy is the key-lock class of writers of earlier versions
	// (schema.Table.LegacyOrderingLockClass), watched beside class.
	legacy int32

	// terms is the relay's term ledger: one term per partition lease, the
	// copies handed out under them, and the copies left in handlers by
	// ended terms (docs/ARCHITECTURE.md, "The term core").
	terms *term.Ledger

	mu      sync.Mutex
	parts   map[int]*partState
	keys    map[string]*keyState
	starved bool // the last startRunnersLocked stopped at MaxInFlight: keys may wait for a runner
	runWg   sync.WaitGroup

	// gen counts local hold changes, so that a holds read that started
	// before a change does not undo it.
	gen int64
	// needHolds asks the next cycle to read the holds: set by a wake-up (an
	// operator's change notifies), a refresh request, and PollInterval after
	// the last read. A partition taken over is read with its first scan.
	needHolds bool
	holdsRead time.Time

	abandon bool // tests: stop like a killed process, without giving leases back
}

type partState struct {
	id        int
	floor     int64 // in memory; every keyed row <= floor is done
	persisted int64
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
	row *schema.OrderedRow
}

type keyState struct {
	name     string
	p        *partState // the partition state the key belongs to
	queue    []*entry   // loaded, open rows in sequence order; none in flight
	flying   int64      // the queued row a runner delivers now (0: none); open until its verdict or a hold covers it
	busy     bool       // a runner works on the key
	hold     *holdState
	holdGen  int64 // gen of the last local change of hold
	lastDone int64 // highest sequence acked or skipped here, to check order
}

type holdState struct {
	seq       int64
	attempts  int
	dueAt     time.Time // local clock
	dead      bool
	skip      bool
	replay    bool
	resolved  bool // tombstone: rows <= seq are done
	advancing bool // an Advance statement is running
	inflight  bool // the held row is being delivered
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
		id:     host + "-" + strconv.Itoa(os.Getpid()) + "-" + hex.EncodeToString(b),
		logger: sub.logger,
		kick:   make(chan struct{}, 1),
		parts:  map[int]*partState{},
		keys:   map[string]*keyState{},
		legacy: sub.s.cfg.Table.LegacyOrderingLockClass(),
		terms:  newTermLedger(sub.s),
	}
}

// newTermLedger is an ordered relay's term ledger: a copy left in a handler
// by an ended term holds its key (and its partition) back for as long as a
// copy of a live term may stay out, its overrun (DispatchTimeout +
// LockTTL/2), counted from the term's end.
func newTermLedger(s *Subscriber) *term.Ledger {
	return term.New(term.Config{Overrun: s.overrunAfter()})
}

func (r *orderedRelay) tickInterval() time.Duration {
	return min(r.s.cfg.ElectionInterval, r.s.cfg.LockTTL/3)
}

// floorEvery is how often at most a partition's moved floor is written.
// Written floors lag the relay's by up to this much: the cleaner, the
// runbook's replay of a delivered row and the state readers see a row as
// done that much later, and a new owner delivers again up to that much of
// acked rows.
func (r *orderedRelay) floorEvery() time.Duration { return r.s.cfg.LockTTL / 10 }

// margin is how long before its lease ends a relay stops delivering.
func (r *orderedRelay) margin() time.Duration { return r.s.cfg.LockTTL / 5 }

// readAhead is how many open rows a partition keeps loaded at most.
func (r *orderedRelay) readAhead() int { return 4 * r.s.cfg.BatchSize }

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
	tick := time.NewTicker(r.tickInterval())
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
			if s.beforeIdle != nil {
				s.beforeIdle()
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
		if due := r.nextDue(); !due.IsZero() {
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
			// MaxInFlight may start.
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

// nextDue is when the next held row of an owned key is due, zero if none.
func (r *orderedRelay) nextDue() time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	var due time.Time
	for _, k := range r.keys {
		h := k.hold
		if h == nil || h.resolved || h.dead || h.inflight || h.advancing || k.busy {
			continue
		}
		if due.IsZero() || h.dueAt.Before(due) {
			due = h.dueAt
		}
	}
	return due
}

// shutdown waits for the runners and gives the partitions back.
func (r *orderedRelay) shutdown() {
	defer r.s.wake.unregister(r.wake)
	// Last: the copies left in handlers by ended terms no longer hold
	// anything back, and the goroutines that follow them end (term I4).
	defer r.terms.Close()
	r.runWg.Wait()
	if r.abandon || r.s.abandon.Load() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	r.mu.Lock()
	var ids []int32
	var floors, epochs []int64
	for id, p := range r.parts {
		r.advanceFloorLocked(p)
		ids, floors, epochs = append(ids, int32(p.id)), append(floors, p.floor), append(epochs, p.term.Epoch()) //nolint:gosec // partition < 64
		r.dropPartLocked(id)
	}
	r.mu.Unlock()
	if len(ids) > 0 {
		if _, err := r.s.pool.Exec(ctx, r.oq.Release, r.id, ids, floors, epochs); err != nil {
			r.logger.Error("Could not give partitions back; they pass to other relays after the lock TTL", err, nil)
		}
	}
	if _, err := r.s.pool.Exec(ctx, r.oq.Leave, r.id); err != nil {
		r.logger.Error("Could not leave the relay membership", err, nil)
	}
}

// assigned returns the partitions that rendezvous hashing gives this relay
// among the live relays.
func (r *orderedRelay) assigned(live []string) map[int]bool {
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
		if best == r.id {
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

// tick heartbeats, releases partitions no longer assigned, renews leases and
// persists floors, cleans resolved holds below the written floors, and takes
// assigned partitions that are free.
func (r *orderedRelay) tick(ctx context.Context) {
	cfg := r.s.cfg
	ttl := cfg.LockTTL.Seconds()
	qctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	var live []string
	if err := r.s.pool.QueryRow(qctx, r.oq.Heartbeat, r.id, ttl).Scan(&live); err != nil {
		if ctx.Err() == nil {
			r.logger.Error("Ordered relay heartbeat failed", err, nil)
		}
		r.fence()
		return
	}
	mine := r.assigned(live)
	now := time.Now()

	r.mu.Lock()
	var relIDs []int32
	var relFloors, relEpochs []int64
	var renIDs []int32
	var renFloors, renEpochs []int64
	for id, p := range r.parts {
		if !mine[id] && !p.releasing {
			p.releasing = true
			r.dropQueuesLocked(p)
		}
		r.advanceFloorLocked(p)
		if p.releasing && !r.partBusyLocked(p) {
			relIDs, relFloors, relEpochs = append(relIDs, int32(id)), append(relFloors, p.floor), append(relEpochs, p.term.Epoch()) //nolint:gosec // partition < 64
			r.dropPartLocked(id)
			continue
		}
		// A floor that moved is written at most every floorEvery, with
		// the lease, so that the progress of a busy relay leaves a
		// bounded number of row versions (a pinned xmin horizon keeps
		// them all): 64 partitions every 6 s at the default LockTTL.
		if (p.floor != p.persisted && now.Sub(p.renewed) >= r.floorEvery()) || now.Sub(p.renewed) >= cfg.LockTTL/3 {
			renIDs, renFloors, renEpochs = append(renIDs, int32(id)), append(renFloors, p.floor), append(renEpochs, p.term.Epoch()) //nolint:gosec // partition < 64
		}
	}
	var want []int32
	for id := range mine {
		// A partition whose earlier term still has a message in a
		// handler is not taken again before that copy ends (its verdict,
		// its overrun): one copy of a key in a handler at a time (term
		// I1, I5).
		if r.parts[id] == nil && r.terms.Quiesced(id) {
			want = append(want, int32(id)) //nolint:gosec // partition < 64
		}
	}
	r.mu.Unlock()

	if len(relIDs) > 0 {
		if _, err := r.s.pool.Exec(qctx, r.oq.Release, r.id, relIDs, relFloors, relEpochs); err != nil && ctx.Err() == nil {
			r.logger.Error("Could not give partitions back; they pass to other relays after the lock TTL", err, nil)
		}
	}
	if len(renIDs) > 0 {
		t0 := time.Now()
		rows, err := r.s.pool.Query(qctx, r.oq.Renew, r.id, renIDs, renFloors, ttl, renEpochs)
		var ok []int
		if err == nil {
			ok, err = pgx.CollectRows(rows, pgx.RowTo[int])
		}
		r.mu.Lock()
		if err != nil {
			if ctx.Err() == nil {
				r.logger.Error("Could not renew partition leases", err, nil)
			}
		} else {
			got := map[int]bool{}
			for _, id := range ok {
				got[id] = true
			}
			for i, id32 := range renIDs {
				id := int(id32)
				p := r.parts[id]
				if p == nil || p.term.Epoch() != renEpochs[i] {
					continue
				}
				if !got[id] {
					r.logger.Info("Partition lease lost; another relay took it", watermill.LogFields{"partition": id})
					r.s.fenceRejected("renew")
					r.dropPartLocked(id)
					continue
				}
				p.persisted = max(p.persisted, renFloors[i])
				p.renewed = t0
				p.deadline = t0.Add(cfg.LockTTL - r.margin())
			}
		}
		clean := r.resolvedBelowPersistedLocked()
		r.mu.Unlock()
		if clean && err == nil {
			if _, err := r.s.pool.Exec(qctx, r.oq.CleanResolved, r.id); err != nil && ctx.Err() == nil {
				r.logger.Error("Could not clean resolved holds; retrying next tick", err, nil)
			}
		}
	}
	r.fence()
	if len(want) > 0 {
		t0 := time.Now()
		rows, err := r.s.pool.Query(qctx, r.oq.Acquire, r.id, want, ttl)
		if err != nil {
			if ctx.Err() == nil {
				r.logger.Error("Could not take partitions", err, nil)
			}
			return
		}
		type taken struct {
			id           int
			floor, epoch int64
		}
		got, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (taken, error) {
			var t taken
			err := row.Scan(&t.id, &t.floor, &t.epoch)
			return t, err
		})
		if err != nil {
			if ctx.Err() == nil {
				r.logger.Error("Could not take partitions", err, nil)
			}
			return
		}
		r.mu.Lock()
		for _, t := range got {
			if old := r.parts[t.id]; old != nil {
				r.dropPartLocked(t.id) // not expected: want has no owned partition
			}
			p := &partState{id: t.id, floor: t.floor, persisted: t.floor, seen: t.floor, fresh: true,
				open: map[int64]struct{}{}, renewed: t0, deadline: t0.Add(cfg.LockTTL - r.margin()),
				term: r.terms.Begin(context.Background(), t.id, t.epoch)}
			p.expiry = time.AfterFunc(time.Until(p.deadline), func() { r.expire(p) })
			r.parts[t.id] = p
			r.logger.Info("Partition taken", watermill.LogFields{"partition": t.id, "term": t.epoch, "floor": t.floor})
		}
		r.mu.Unlock()
		if len(got) > 0 {
			r.signal()
		}
	}
}

// resolvedBelowPersistedLocked reports whether a resolved hold of an owned
// partition is at or below its written floor (CleanResolved has work).
func (r *orderedRelay) resolvedBelowPersistedLocked() bool {
	for name, k := range r.keys {
		if h := k.hold; h != nil && h.resolved && h.seq <= k.p.persisted && r.parts[k.p.id] == k.p {
			k.hold = nil
			r.pruneKeyLocked(name, k)
			return true
		}
	}
	return false
}

// expire ends p's term when its deadline passed without a renewal, between
// ticks: its messages' contexts are cancelled at the deadline, a margin
// before the lease ends in the database and another relay may take it.
func (r *orderedRelay) expire(p *partState) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.parts[p.id] != p {
		return
	}
	if !r.expireLocked(p) {
		p.expiry.Reset(time.Until(p.deadline)) // renewed meanwhile
	}
}

// fence drops the partitions whose lease may have ended by the local clock
// (at a tick: the expiry timers do it between ticks).
func (r *orderedRelay) fence() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, p := range r.parts {
		r.expireLocked(p)
	}
}

// expireLocked ends p's term if its deadline passed, and reports whether it
// did.
func (r *orderedRelay) expireLocked(p *partState) bool {
	if time.Now().Before(p.deadline) {
		return false
	}
	r.logger.Info("Partition lease not renewed in time; stopping its deliveries", watermill.LogFields{"partition": p.id, "term": p.term.Epoch()})
	r.dropPartLocked(p.id)
	return true
}

// partBusyLocked reports whether a runner works on a key of p.
func (r *orderedRelay) partBusyLocked(p *partState) bool {
	for _, k := range r.keys {
		if k.p == p && k.busy {
			return true
		}
	}
	return false
}

// dropQueuesLocked stops the deliveries of p's keys; their rows stay open,
// so the floor stays below them.
func (r *orderedRelay) dropQueuesLocked(p *partState) {
	for _, k := range r.keys {
		if k.p == p {
			k.queue = nil
		}
	}
}

// dropPartLocked ends a partition's term and forgets it and its keys: the
// contexts of its messages in handlers are cancelled (term I2), runners of
// its keys stop, the ledger follows the copies left in handlers (their
// verdicts are written nowhere: I3), and the partition is not taken again
// until those have ended (I1, I5).
func (r *orderedRelay) dropPartLocked(id int) {
	p := r.parts[id]
	delete(r.parts, id)
	if p == nil {
		return
	}
	p.term.End()
	p.expiry.Stop()
	for name, k := range r.keys {
		if k.p == p {
			k.queue = nil
			delete(r.keys, name)
		}
	}
}

// deliverableLocked reports whether k's partition is still owned (by the
// same lease) and within its lease.
func (r *orderedRelay) deliverableLocked(k *keyState) bool {
	p := r.parts[k.p.id]
	return p != nil && p == k.p && !p.releasing && time.Now().Before(p.deadline)
}

// cutLock is a key lock held by a writer at a cut.
type cutLock struct {
	vxid string
	hash int32
}

type dbHold struct {
	key                          string
	part                         int
	seq                          int64
	attempts                     int
	dueIn                        float64
	dead, skip, replay, resolved bool
}

// cycle takes a cut, then reads the holds, rescans the watches whose writer
// ended and scans each partition up to the cut; it loads what it read,
// advances the floors in memory and starts runners. It returns how many
// rows it loaded and whether a scan stopped at its limit with room for more.
func (r *orderedRelay) cycle(ctx context.Context) (int, bool) {
	cfg := r.s.cfg
	qctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	r.mu.Lock()
	owned := len(r.parts) > 0
	r.mu.Unlock()
	if !owned {
		return 0, false
	}
	// Read the paused topics again after a wake-up or a poll: a key whose
	// next row is of a paused topic waits (nextActionLocked).
	r.s.pausedTopics(ctx)

	// 1. The cut: the sequence's last value, then the writers holding a key
	// lock. A row at or below s0 that the scan below cannot see belongs to
	// one of them (a writer takes its key lock before its sequence value).
	var (
		s0     int64
		vxids  []string
		hashes []int64
	)
	if err := r.lockClass(qctx); err != nil {
		r.cycleError(ctx, err)
		return 0, false
	}
	if err := r.s.pool.QueryRow(qctx, r.oq.Cut, r.class, r.legacy).Scan(&s0, &vxids, &hashes); err != nil {
		r.cycleError(ctx, err)
		return 0, false
	}
	locks := map[cutLock]bool{}
	byPart := map[int][]cutLock{}
	for i, v := range vxids {
		l := cutLock{vxid: v, hash: int32(uint32(hashes[i]))} //nolint:gosec // objid is the int4 hash as an unsigned oid
		locks[l] = true
		part := int(uint32(hashes[i]) & (schema.OrderingPartitions - 1)) //nolint:gosec // as above
		byPart[part] = append(byPart[part], l)
	}

	r.mu.Lock()
	var all []int32
	var ids []int32
	var froms []int64
	var wParts, wHashes []int32
	var wFroms, wTos []int64
	var ended []*watch
	var endedParts []*partState
	readHolds := r.needHolds || time.Since(r.holdsRead) >= cfg.PollInterval
	for id, p := range r.parts {
		all = append(all, int32(id)) //nolint:gosec // partition < 64
		readHolds = readHolds || p.fresh
		p.full = len(p.open) >= r.readAhead()
		for _, w := range p.watches {
			// A full partition rescans nothing either: what an ended
			// writer committed stays parked until there is room.
			if !p.full && !locks[cutLock{w.vxid, w.hash}] {
				w.ended = true
				ended = append(ended, w)
				endedParts = append(endedParts, p)
				wParts, wHashes = append(wParts, int32(id)), append(wHashes, w.hash) //nolint:gosec // partition < 64
				wFroms, wTos = append(wFroms, w.from), append(wTos, w.to)
			}
		}
		if p.releasing || !time.Now().Before(p.deadline) || p.full || p.seen >= s0 {
			continue
		}
		ids, froms = append(ids, int32(id)), append(froms, p.seen) //nolint:gosec // partition < 64
	}
	g0 := r.gen
	if readHolds {
		r.needHolds = false
	}
	if !readHolds && len(ended) == 0 && len(ids) == 0 {
		// Nothing new to read (no writer ended, no sequence taken): only
		// retries that came due.
		r.startRunnersLocked()
		r.mu.Unlock()
		return 0, false
	}
	r.mu.Unlock()

	// 2. One round trip: holds, rescans, scans (each statement takes its
	// snapshot after the cut).
	limit := cfg.BatchSize
	batch := &pgx.Batch{}
	if readHolds {
		batch.Queue(r.oq.Holds, all)
	}
	if len(ended) > 0 {
		batch.Queue(r.oq.Rescan, wParts, wHashes, wFroms, wTos, limit)
	}
	if len(ids) > 0 {
		batch.Queue(r.oq.Scan, ids, froms, s0, limit)
	}
	br := r.s.pool.SendBatch(qctx, batch)
	var (
		holds    []dbHold
		rescan   []*schema.OrderedRow
		scanned  []*schema.OrderedRow
		readRows = func(dst *[]*schema.OrderedRow) error {
			rows, err := br.Query()
			if err != nil {
				return err
			}
			defer rows.Close()
			for rows.Next() {
				row := &schema.OrderedRow{}
				if err := row.Scan(rows, r.oq.Columns); err != nil {
					return err
				}
				*dst = append(*dst, row)
			}
			return rows.Err()
		}
	)
	err := func() error {
		defer br.Close()
		if readHolds {
			rows, err := br.Query()
			if err != nil {
				return err
			}
			holds, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (dbHold, error) {
				var h dbHold
				err := row.Scan(&h.key, &h.part, &h.seq, &h.attempts, &h.dueIn, &h.dead, &h.skip, &h.replay, &h.resolved)
				return h, err
			})
			if err != nil {
				return err
			}
		}
		if len(ended) > 0 {
			if err := readRows(&rescan); err != nil {
				return err
			}
		}
		if len(ids) > 0 {
			return readRows(&scanned)
		}
		return nil
	}()
	if err != nil {
		r.mu.Lock()
		for _, w := range ended {
			w.ended = false // rescan again next cycle
		}
		r.needHolds = r.needHolds || readHolds
		r.mu.Unlock()
		r.cycleError(ctx, err)
		return 0, false
	}

	r.mu.Lock()
	defer r.mu.Unlock()
	if readHolds {
		r.applyHoldsLocked(holds, g0, all)
		r.holdsRead = time.Now()
	}
	loaded := 0
	// Rescans: what the ended writers committed in their ranges, at most
	// limit rows per watch and cycle (a transaction of thousands of rows
	// is read like a backlog, not at once); a watch that returned limit
	// rows is rescanned from its last row in the next cycle, and the rows
	// above it stay parked.
	got := make([]int, len(ended))
	last := make([]int64, len(ended))
	for _, row := range rescan {
		for i, w := range ended {
			p := endedParts[i]
			if r.parts[p.id] != p || row.Partition != p.id || row.KeyHash != w.hash || row.Sequence <= w.from || row.Sequence > w.to {
				continue
			}
			got[i]++
			last[i] = max(last[i], row.Sequence)
			if _, ok := w.loaded[row.Sequence]; ok {
				continue
			}
			w.loaded[row.Sequence] = struct{}{}
			if r.loadLocked(p, row) {
				loaded++
			}
		}
	}
	more := false
	for i, w := range ended {
		p := endedParts[i]
		if !w.ended {
			continue
		}
		if got[i] >= limit {
			w.from, w.ended = last[i], false
			more = true
			continue
		}
		kept := p.watches[:0]
		for _, x := range p.watches {
			if x != w {
				kept = append(kept, x)
			}
		}
		p.watches = kept
	}
	// Scans: load, and watch the writers of the partition's keys that held
	// their lock at the cut, over the range the scan passed.
	byScan := map[int][]*schema.OrderedRow{}
	for _, row := range scanned {
		byScan[row.Partition] = append(byScan[row.Partition], row)
	}
	for i, id32 := range ids {
		id := int(id32)
		p := r.parts[id]
		if p == nil || p.seen != froms[i] || (p.fresh && !readHolds) {
			continue
		}
		rows := byScan[id]
		to := s0
		if len(rows) == limit {
			to = rows[len(rows)-1].Sequence
			more = true
		}
		for _, l := range byPart[id] {
			r.watchLocked(p, l, p.seen, to)
		}
		for _, row := range rows {
			for _, w := range p.watches {
				if w.hash == row.KeyHash && row.Sequence > w.from && row.Sequence <= w.to {
					w.loaded[row.Sequence] = struct{}{}
				}
			}
			if r.loadLocked(p, row) {
				loaded++
			}
		}
		p.seen = to
	}
	for _, p := range r.parts {
		r.advanceFloorLocked(p)
	}
	r.startRunnersLocked()
	return loaded, more
}

// watchLocked records that the writer of l may commit rows of its hash in
// (from, to] of p later.
func (r *orderedRelay) watchLocked(p *partState, l cutLock, from, to int64) {
	if to <= from {
		return
	}
	for _, w := range p.watches {
		if w.vxid == l.vxid && w.hash == l.hash && !w.ended {
			w.to = max(w.to, to)
			return
		}
	}
	p.watches = append(p.watches, &watch{vxid: l.vxid, hash: l.hash, from: from, to: to, loaded: map[int64]struct{}{}})
}

// applyHoldsLocked merges the holds read from the table: holds this relay
// does not know (taken over with a partition, or an operator's replay) and
// an operator's changes (skip, retry) of the ones it knows.
func (r *orderedRelay) applyHoldsLocked(holds []dbHold, g0 int64, read []int32) {
	for _, id := range read {
		if p := r.parts[int(id)]; p != nil {
			p.fresh = false
		}
	}
	inDB := map[string]bool{}
	for _, h := range holds {
		p := r.parts[h.part]
		if p == nil {
			continue
		}
		inDB[h.key] = true
		k := r.keyLocked(h.key, p)
		if k.holdGen > g0 {
			continue // changed here since the read began
		}
		cur := k.hold
		if cur != nil && (cur.inflight || cur.advancing) {
			if cur.seq == h.seq && h.skip {
				cur.skip = true // honoured once the attempt in flight ends
			}
			continue
		}
		if cur != nil && cur.seq == h.seq && cur.replay == h.replay && cur.resolved == h.resolved {
			cur.attempts, cur.dead, cur.skip = h.attempts, h.dead, h.skip
			cur.dueAt = time.Now().Add(time.Duration(h.dueIn * float64(time.Second)))
			continue
		}
		r.setHoldLocked(k, &holdState{seq: h.seq, attempts: h.attempts, dead: h.dead, skip: h.skip, replay: h.replay,
			resolved: h.resolved, dueAt: time.Now().Add(time.Duration(h.dueIn * float64(time.Second)))})
	}
	inRead := map[int]bool{}
	for _, id := range read {
		inRead[int(id)] = true
	}
	for name, k := range r.keys {
		if k.hold != nil && !inDB[name] && inRead[k.p.id] && k.holdGen <= g0 && !k.hold.inflight && !k.hold.advancing && r.parts[k.p.id] == k.p {
			k.hold = nil // gone from the table (cleaned, or a replay that ended)
			r.pruneKeyLocked(name, k)
		}
	}
}

// setHoldLocked makes h the hold of k and applies what it says to the
// key's loaded rows: rows below an active hold are done, rows at or above
// it are covered (the hold delivers them); rows at or below a resolved hold
// are done; a replay hold changes nothing.
func (r *orderedRelay) setHoldLocked(k *keyState, h *holdState) {
	k.hold = h
	if h == nil || h.replay {
		return
	}
	kept := k.queue[:0]
	for _, e := range k.queue {
		if h.resolved && e.row.Sequence > h.seq {
			kept = append(kept, e)
			continue
		}
		delete(k.p.open, e.row.Sequence)
	}
	clear(k.queue[len(kept):])
	k.queue = kept
	if k.flying != 0 && (!h.resolved || k.flying <= h.seq) {
		// The row in flight is covered too: its verdict no longer decides
		// the floor (an ack is a duplicate of done work, a nack finds the
		// hold).
		delete(k.p.open, k.flying)
	}
}

func (r *orderedRelay) cycleError(ctx context.Context, err error) {
	if ctx.Err() != nil {
		return
	}
	r.logger.Error("Ordered relay scan failed, retrying", err, nil)
	select {
	case <-ctx.Done():
	case <-time.After(100 * time.Millisecond):
	}
}

func (r *orderedRelay) keyLocked(name string, p *partState) *keyState {
	k := r.keys[name]
	if k == nil || k.p != p {
		k = &keyState{name: name, p: p}
		r.keys[name] = k
	}
	return k
}

// loadLocked adds a row read by a scan or rescan to its key's queue and its
// partition's open rows, unless it is done or covered. It reports whether
// the row was added.
func (r *orderedRelay) loadLocked(p *partState, row *schema.OrderedRow) bool {
	if row.Sequence <= p.floor {
		return false
	}
	if _, ok := p.open[row.Sequence]; ok {
		return false
	}
	k := r.keyLocked(row.Key, p)
	if row.Sequence <= k.lastDone {
		return false
	}
	if h := k.hold; h != nil && !h.replay {
		if row.Sequence <= h.seq {
			return false // done, or the held row itself
		}
		if !h.resolved && !h.advancing {
			return false // covered: the hold reaches it (it is at or below seen)
		}
	}
	e := &entry{row: row}
	p.open[row.Sequence] = struct{}{}
	j := sort.Search(len(k.queue), func(i int) bool { return k.queue[i].row.Sequence > row.Sequence })
	k.queue = append(k.queue, nil)
	copy(k.queue[j+1:], k.queue[j:])
	k.queue[j] = e
	return true
}

// advanceFloorLocked raises the in-memory floor of p to the highest value
// its invariant allows: below every open row and every watch, at most seen.
func (r *orderedRelay) advanceFloorLocked(p *partState) {
	f := p.seen
	for seq := range p.open {
		f = min(f, seq-1)
	}
	for _, w := range p.watches {
		f = min(f, w.from)
	}
	p.floor = max(p.floor, f)
}

func (r *orderedRelay) pruneKeyLocked(name string, k *keyState) {
	if !k.busy && k.hold == nil && len(k.queue) == 0 {
		delete(r.keys, name)
	}
}

// parkedLocked reports whether row waits for a watch of its hash: a writer
// that may still commit a lower row of its key.
func parkedLocked(p *partState, row *schema.OrderedRow) bool {
	for _, w := range p.watches {
		if w.hash == row.KeyHash && row.Sequence > w.from {
			return true
		}
	}
	return false
}

// startRunnersLocked starts a runner for every key with work, up to
// MaxInFlight in all: the subscription's messages (its runners, each with
// at most one message, and the unkeyed rows of its claim loop: one count,
// sub.inflight) and the copies left in handlers by ended terms.
func (r *orderedRelay) startRunnersLocked() {
	r.starved = false
	for _, k := range r.keys {
		if int(r.sub.inflight.Load())+r.terms.StaleCount() >= r.s.cfg.MaxInFlight {
			r.starved = true
			return
		}
		if k.busy || !r.deliverableLocked(k) || r.nextActionLocked(k) == actNone {
			continue
		}
		k.busy = true
		r.sub.inflight.Add(1)
		r.runWg.Add(1)
		go r.runKey(k)
	}
}

type action int

const (
	actNone    action = iota
	actQueue          // deliver the first queued row
	actHeld           // deliver the held row (a retry or a replay)
	actAdvance        // the held row was skipped: move the hold on
)

func (r *orderedRelay) nextActionLocked(k *keyState) action {
	if h := k.hold; h != nil && !h.resolved {
		switch {
		case h.inflight || h.advancing:
			return actNone
		case h.skip:
			return actAdvance
		case h.dead || time.Now().Before(h.dueAt):
			return actNone
		default:
			return actHeld
		}
	}
	if len(k.queue) > 0 && !parkedLocked(k.p, k.queue[0].row) && !r.s.paused.set.Load().has(k.queue[0].row.Topic) {
		return actQueue
	}
	return actNone
}

// runKey delivers the rows of one key one after another until the key has
// nothing to do.
func (r *orderedRelay) runKey(k *keyState) {
	defer r.runWg.Done()
	stop := r.sub.stopped()
	for {
		r.mu.Lock()
		if !r.deliverableLocked(k) || r.keys[k.name] != k {
			r.endRunLocked(k)
			r.mu.Unlock()
			return
		}
		switch r.nextActionLocked(k) {
		case actQueue:
			e := k.queue[0]
			k.queue = k.queue[1:]
			k.flying = e.row.Sequence
			r.mu.Unlock()
			v := r.deliverRow(k, e.row, 1, stop)
			r.mu.Lock()
			k.flying = 0
			switch v {
			case verdictAck:
				delete(k.p.open, e.row.Sequence)
				k.lastDone = max(k.lastDone, e.row.Sequence)
				r.freedLocked(k.p)
			case verdictNack:
				// fail made the row the key's hold (or put it back).
			default:
				// Not delivered or no verdict: the row stays first of its
				// key, unless a hold covered it meanwhile.
				if _, open := k.p.open[e.row.Sequence]; open && r.keys[k.name] == k {
					k.queue = append([]*entry{e}, k.queue...)
				}
				r.endRunLocked(k)
				r.mu.Unlock()
				return
			}
			r.mu.Unlock()
		case actHeld:
			h := k.hold
			h.inflight = true
			seq, attempts := h.seq, h.attempts
			r.mu.Unlock()
			row, err := r.rowAt(k.name, seq)
			if errors.Is(err, pgx.ErrNoRows) && r.rowGone(k.name, seq) {
				// The held row was deleted (by hand, or by a cleaner that
				// raced an operator's replay): there is nothing left to
				// deliver, and the key goes on with its next row.
				r.advance(k, h)
				r.mu.Lock()
				h.inflight = false
				if k.hold == h {
					r.refreshLaterLocked(k)
				}
				r.endRunLocked(k)
				r.mu.Unlock()
				return
			}
			if errors.Is(err, pgx.ErrNoRows) {
				// Skipped meanwhile or resolved by another relay: the
				// holds read sorts it out.
				r.mu.Lock()
				h.inflight = false
				if k.hold == h {
					r.refreshLaterLocked(k)
				}
				r.endRunLocked(k)
				r.mu.Unlock()
				return
			}
			if err != nil {
				r.logger.Error("Could not read a held row; retrying shortly", err, watermill.LogFields{"sequence": seq})
				r.mu.Lock()
				h.inflight = false
				h.dueAt = time.Now().Add(100 * time.Millisecond)
				r.endRunLocked(k)
				r.mu.Unlock()
				return
			}
			if r.s.paused.set.Load().has(row.Topic) {
				// The held row's topic is paused: the key waits, and the
				// row is looked at again at the next poll.
				r.mu.Lock()
				h.inflight = false
				h.dueAt = time.Now().Add(r.s.cfg.PollInterval)
				r.endRunLocked(k)
				r.mu.Unlock()
				return
			}
			v := r.deliverRow(k, row, attempts+1, stop)
			r.mu.Lock()
			h.inflight = false
			if k.hold != h {
				r.endRunLocked(k)
				r.mu.Unlock()
				return
			}
			switch v {
			case verdictAck:
				r.mu.Unlock()
				r.advance(k, h)
			case verdictNack:
				r.mu.Unlock() // fail updated the hold (and a requested skip)
			default:
				r.endRunLocked(k)
				r.mu.Unlock()
				return
			}
		case actAdvance:
			h := k.hold
			r.mu.Unlock()
			r.advance(k, h)
		default:
			r.endRunLocked(k)
			r.mu.Unlock()
			return
		}
	}
}

// refreshLaterLocked makes the next holds read replace k's hold.
func (r *orderedRelay) refreshLaterLocked(k *keyState) {
	k.hold.dueAt = time.Now().Add(time.Second)
	k.holdGen = 0
	r.needHolds = true
}

// freedLocked starts a cycle when p's scan had stopped for the read-ahead
// limit and has room again.
func (r *orderedRelay) freedLocked(p *partState) {
	if p.full && len(p.open) < r.readAhead()/2 {
		p.full = false
		r.signal()
	}
}

func (r *orderedRelay) endRunLocked(k *keyState) {
	k.busy = false
	r.sub.freeSlot()
	if r.keys[k.name] == k {
		r.pruneKeyLocked(k.name, k)
	}
	// A key with work has a runner unless the last start stopped at
	// MaxInFlight (cycles, due timers and freed slots start the others):
	// walk the keys only then, not at the end of every key's run.
	if r.starved {
		r.startRunnersLocked()
	}
}

func (r *orderedRelay) rowAt(name string, seq int64) (*schema.OrderedRow, error) {
	ctx, cancel := context.WithTimeout(r.sub.ctx, opTimeout)
	defer cancel()
	row := &schema.OrderedRow{}
	if err := row.Scan(r.s.pool.QueryRow(ctx, r.oq.RowAt, name, seq), r.oq.Columns); err != nil {
		return nil, err
	}
	return row, nil
}

// rowGone reports whether the key's row at seq is no longer in the table
// (false when that cannot be read).
func (r *orderedRelay) rowGone(name string, seq int64) bool {
	ctx, cancel := context.WithTimeout(r.sub.ctx, opTimeout)
	defer cancel()
	var exists bool
	err := r.s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+r.oq.Table.Sanitize()+` WHERE ordering_key = $1 AND sequence = $2)`, name, seq).Scan(&exists)
	return err == nil && !exists
}

type verdict int

const (
	verdictAck  verdict = iota // acked
	verdictNack                // nacked and recorded (or refused)
	verdictNone                // not sent, or no verdict before the close timeout
)

// deliverRow sends one row and waits for its verdict; a nack is recorded by
// fail before it returns.
func (r *orderedRelay) deliverRow(k *keyState, row *schema.OrderedRow, attempts int, stop <-chan struct{}) verdict {
	s := r.s
	row.Attempts = int32(attempts) //nolint:gosec // attempts are small
	c := &claimed{row: row.ClaimedRow}
	msg, err := row.Message(s.cfg.Table)
	if err != nil {
		c.slot = &errorSlot{err: Permanent(err)}
		c.delivered = time.Now()
		r.fail(k, row, c)
		return verdictNack
	}
	c.slot = &errorSlot{}
	t := k.p.term
	select {
	case <-stop:
		return verdictNone
	case <-t.Done():
		return verdictNone
	default:
	}
	// As in the default mode, the message outlives the Subscribe context
	// until CloseTimeout after the relay stopped. Its term's end cancels it
	// (term I2): the handler is told that its partition lease ended.
	cp, err := t.Hand(withErrorSlot(context.WithoutCancel(r.sub.ctx), c.slot), k.name, msg)
	if err != nil {
		if errors.Is(err, term.ErrKeyOut) {
			// Not expected: the key's runner is the only one, and a
			// partition is taken again only once its ended terms have
			// quiesced.
			r.logger.Error("A copy of the key is still in a handler; not delivering it again", err, watermill.LogFields{"sequence": row.Sequence})
		}
		return verdictNone
	}
	c.msg = msg
	select {
	case r.sub.out <- msg:
		c.delivered = time.Now()
	case <-stop:
		cp.End(term.Withdrawn)
		return verdictNone
	case <-t.Done():
		cp.End(term.Withdrawn)
		return verdictNone
	}
	var grace <-chan time.Time
	overrun := time.NewTimer(s.overrunAfter())
	defer overrun.Stop()
	for {
		select {
		case <-overrun.C:
			// As in the default mode: the attempt counts as failed and holds
			// the key like any failure; ending the copy cancels the
			// message's context.
			c.slot.set(s.overrunError())
			if !cp.End(term.Overran) {
				return verdictNone // the term ended first: nothing is written (I3)
			}
			r.logger.Error("Handler overran its dispatch timeout; counting a failed attempt", s.overrunError(),
				watermill.LogFields{"event_id": row.EventID})
			r.fail(k, row, c)
			return verdictNack
		case <-msg.Acked():
			if !cp.End(term.Acked) {
				return verdictNone // a verdict of an ended term is not progress (I3)
			}
			s.observeDispatch(c, metrics.ResultSuccess)
			if m := s.cfg.Metrics; m != nil {
				m.DeliveryLag.WithLabelValues(s.label).Observe(time.Since(row.CreatedAt).Seconds())
			}
			return verdictAck
		case <-msg.Nacked():
			if !cp.End(term.Nacked) {
				return verdictNone // I3
			}
			r.fail(k, row, c)
			return verdictNack
		case <-t.Done():
			// The term ended with the message in the handler: its context
			// is cancelled (I2), and the ledger follows the copy until its
			// verdict (recorded nowhere, I3), its overrun or the relay's
			// stop; the partition is not taken again before (I1).
			return verdictNone
		case <-stop:
			stop = nil
			grace = time.After(s.cfg.CloseTimeout)
		case <-grace:
			// The copy stays out (a handler has it) until its term ends
			// with the relay's shutdown.
			r.logger.Info("Message neither acked nor nacked before the close timeout; the next owner delivers it again",
				watermill.LogFields{"event_id": row.EventID})
			return verdictNone
		}
	}
}

// fail records a failed attempt of row as its key's hold. The rows of the
// key queued behind it are covered once the hold is written.
func (r *orderedRelay) fail(k *keyState, row *schema.OrderedRow, c *claimed) {
	s := r.s
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	err := c.slot.get()
	text := "handler nacked the message without an error (add the subscriber.CaptureError middleware to record it)"
	if err != nil {
		text = err.Error()
	}
	summary := redact.Summary(text, row.Payload, s.cfg.LastErrorMaxBytes)
	attempts := int(row.Attempts)
	backoff := s.cfg.Backoff(attempts)
	var (
		dead, skip bool
		n          int
	)
	// The write is work under the term (term I3): it is not made once the
	// term has ended, and the partition is not taken again while it runs;
	// the statement is fenced on owner and epoch besides.
	leave, live := k.p.term.Enter()
	defer leave()
	qerr := pgx.ErrNoRows
	if live {
		qerr = s.pool.QueryRow(ctx, r.oq.Fail, r.id, row.Partition, k.name, row.Sequence, summary, s.cfg.MaxAttempts,
			IsPermanent(err), backoff.Seconds(), k.p.term.Epoch()).Scan(&dead, &n, &skip)
	}
	s.observeDispatch(c, metrics.ResultFailure)
	if qerr != nil && !errors.Is(qerr, pgx.ErrNoRows) {
		time.Sleep(100 * time.Millisecond) // the database is failing; do not spin
	}
	fields := watermill.LogFields{"event_id": row.EventID, "sequence": row.Sequence, "attempts": attempts, "error": summary}
	r.mu.Lock()
	defer r.mu.Unlock()
	if k.flying == row.Sequence {
		k.flying = 0 // from here on the row is covered by the hold, or queued again
	}
	if r.keys[k.name] != k {
		return // the partition was dropped meanwhile; its next owner delivers the row again
	}
	r.gen++
	k.holdGen = r.gen
	h := k.hold
	switch {
	case errors.Is(qerr, pgx.ErrNoRows), qerr != nil:
		// Not recorded: lease lost, another hold of the key this relay has
		// not read yet, or a database error. The row stays first of its
		// key (open, so the floor stays below it); the holds read tells.
		if qerr != nil && !errors.Is(qerr, pgx.ErrNoRows) {
			r.logger.Error("Could not record nack; delivering the row again", qerr, fields)
		} else {
			s.fenceRejected("nack")
			r.logger.Info("Nack not recorded: the partition passed to another relay, or the key has another hold; reading the holds again", fields)
			k.holdGen = 0
			r.needHolds = true
		}
		if h != nil && h.seq == row.Sequence {
			h.dueAt = time.Now().Add(backoff)
			return
		}
		if _, open := k.p.open[row.Sequence]; open {
			k.queue = append([]*entry{{row: row}}, k.queue...)
		}
		return
	}
	// The hold is written: the row and the key's queued rows are covered
	// (the hold reaches them), also when a holds read applied it first.
	delete(k.p.open, row.Sequence)
	if h == nil || h.seq != row.Sequence || h.resolved {
		r.setHoldLocked(k, &holdState{seq: row.Sequence})
		h = k.hold
	}
	r.freedLocked(k.p)
	h.attempts, h.dead, h.skip = n, dead, skip
	h.dueAt = time.Now().Add(backoff)
	if dead {
		delete(fields, "error")
		r.logger.Error("Outbox message is dead and holds its ordering key; replay or skip it once the cause is fixed", errors.New(summary), fields)
		if m := s.cfg.Metrics; m != nil {
			m.DeadTotal.WithLabelValues(s.label, row.Topic).Inc()
		}
		return
	}
	fields["retry_in"] = backoff.String()
	r.logger.Info("Outbox message nacked; its ordering key waits for the retry", fields)
}

// advance moves the key's hold h on: its row succeeded or was skipped. It
// goes to the key's next row at or below seen (every such row is covered),
// or is resolved; a replay hold is deleted.
func (r *orderedRelay) advance(k *keyState, h *holdState) {
	r.mu.Lock()
	if k.hold != h || r.keys[k.name] != k {
		r.mu.Unlock()
		return
	}
	// Work under the term (term I3): the key is still owned, so the term
	// is live (dropPartLocked ends it and forgets the key together).
	leave, live := k.p.term.Enter()
	defer leave()
	if !live {
		r.mu.Unlock()
		return
	}
	h.advancing = true
	bound := k.p.seen
	seq := h.seq
	r.gen++
	k.holdGen = r.gen
	r.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	var (
		owned, resolved, deleted bool
		next                     *int64
	)
	err := r.s.pool.QueryRow(ctx, r.oq.Advance, r.id, k.p.id, k.name, seq, bound, k.p.term.Epoch()).Scan(&owned, &next, &resolved, &deleted)
	r.mu.Lock()
	defer r.mu.Unlock()
	h.advancing = false
	r.gen++
	k.holdGen = r.gen
	if k.hold != h || r.keys[k.name] != k {
		return
	}
	switch {
	case err != nil:
		r.logger.Error("Could not move a hold on; retrying", err, watermill.LogFields{"sequence": seq})
		h.skip = true // retried as a skip: the row was handled
		h.dueAt = time.Now().Add(100 * time.Millisecond)
		time.AfterFunc(100*time.Millisecond, r.signal)
	case !owned:
		r.s.fenceRejected("ack")
	case next != nil:
		k.lastDone = max(k.lastDone, seq)
		r.setHoldLocked(k, &holdState{seq: *next, dueAt: time.Now()})
		r.freedLocked(k.p)
	case resolved:
		k.lastDone = max(k.lastDone, seq)
		r.setHoldLocked(k, &holdState{seq: seq, resolved: true})
	case deleted:
		k.hold = nil
	default:
		// The hold changed under us (an operator): read it again.
		r.refreshLaterLocked(k)
	}
}

// refreshHeldKeys sets outbox_held_keys.
func (s *Subscriber) refreshHeldKeys(ctx context.Context) {
	var all, dead int64
	if err := s.pool.QueryRow(ctx, s.oq.HeldKeys).Scan(&all, &dead); err != nil {
		if ctx.Err() == nil {
			s.logger.Error("Could not count held keys", err, nil)
		}
		return
	}
	s.cfg.Metrics.HeldKeys.WithLabelValues(s.label).Set(float64(all))
}

// slotFreed starts the runners that waited for MaxInFlight, after a message
// of the subscription's claim loop was answered.
func (r *orderedRelay) slotFreed() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.starved {
		r.startRunnersLocked()
	}
}
