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
	if !ok {
		return nil, fmt.Errorf("subscriber: invalid config: Ordered needs the tables %s, %s and %s; %s: %w",
			t.PartitionsTable(), t.RelaysTable(), t.HoldsTable(), run, ErrOrderedNotMigrated)
	}
	return schema.NewOrderedQueries(t, cols), nil
}

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

	mu      sync.Mutex
	parts   map[int]*partState
	keys    map[string]*keyState
	runners int // key runners alive (each has at most one message in flight)
	runWg   sync.WaitGroup

	// cut: rows up to safe are all committed or aborted (no writer of a key
	// can still commit one); cutS0/cutVx wait for their writers to end.
	safe  int64
	cutS0 int64
	cutVx []string

	// gen counts local hold changes, so that a holds read that started
	// before a change does not undo it.
	gen      int64
	resolved map[string]int64 // key -> gen of a hold deleted here

	abandon bool // tests: stop like a killed process, without giving leases back
}

type partState struct {
	id        int
	floor     int64 // in memory; every keyed row <= floor is done
	persisted int64
	seen      int64 // every visible row in (floor, seen] is loaded
	window    []*entry
	loaded    map[int64]*entry
	deadline  time.Time // local clock: deliver nothing after it
	renewed   time.Time
	releasing bool
	lastScan  int // rows returned by the last scan
}

type entry struct {
	row   *schema.OrderedRow
	acked bool
}

type keyState struct {
	part      int
	p         *partState // the partition state the key belongs to
	queue     []*entry
	busy      bool // a runner works on the key
	hold      *holdState
	holdGen   int64 // gen of the last local change of hold
	pending   int   // entries of the key in its partition's window
	delivered int64 // highest sequence delivered, to check order
}

type holdState struct {
	seq       int64
	attempts  int
	due       bool
	dead      bool
	skip      bool
	advancing bool // an Advance statement is running
}

func newOrderedRelay(sub *subscription) *orderedRelay {
	host, _ := os.Hostname()
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return &orderedRelay{
		sub:      sub,
		s:        sub.s,
		wake:     sub.s.wake.register(),
		oq:       sub.s.oq,
		id:       host + "-" + strconv.Itoa(os.Getpid()) + "-" + hex.EncodeToString(b),
		logger:   sub.logger,
		kick:     make(chan struct{}, 1),
		parts:    map[int]*partState{},
		keys:     map[string]*keyState{},
		resolved: map[string]int64{},
	}
}

func (r *orderedRelay) tickInterval() time.Duration {
	return min(r.s.cfg.ElectionInterval, r.s.cfg.LockTTL/3)
}

// margin is how long before its lease ends a relay stops delivering.
func (r *orderedRelay) margin() time.Duration { return r.s.cfg.LockTTL / 5 }

func (r *orderedRelay) signal() {
	select {
	case r.kick <- struct{}{}:
	default:
	}
}

// run is the relay's main loop: membership and leases each tick, and scan
// cycles on wake-ups, polls and acks.
func (r *orderedRelay) run(stop <-chan struct{}) {
	defer r.shutdown()
	tick := time.NewTicker(r.tickInterval())
	defer tick.Stop()
	poll := time.NewTicker(r.s.cfg.PollInterval)
	defer poll.Stop()
	ctx := r.sub.ctx
	r.tick(ctx)
	for {
		more := r.cycle(ctx)
		if more {
			select {
			case <-stop:
				return
			case <-tick.C:
				r.tick(ctx)
			default:
			}
			continue
		}
		select {
		case <-stop:
			return
		case <-tick.C:
			r.tick(ctx)
		case <-poll.C:
		case <-r.kick:
		case <-r.wake:
		}
	}
}

// shutdown waits for the runners and gives the partitions back.
func (r *orderedRelay) shutdown() {
	defer r.s.wake.unregister(r.wake)
	r.runWg.Wait()
	if r.abandon || r.s.abandon.Load() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	r.mu.Lock()
	var ids []int32
	var floors []int64
	for _, p := range r.parts {
		r.advanceFloorLocked(p)
		ids, floors = append(ids, int32(p.id)), append(floors, p.floor) //nolint:gosec // partition < 64
	}
	r.parts = map[int]*partState{}
	r.mu.Unlock()
	if len(ids) > 0 {
		if _, err := r.s.pool.Exec(ctx, r.oq.Release, r.id, ids, floors); err != nil {
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
// persists floors, and takes assigned partitions that are free.
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
	var relFloors []int64
	var renIDs []int32
	var renFloors []int64
	for id, p := range r.parts {
		if !mine[id] && !p.releasing {
			p.releasing = true
			r.dropQueuesLocked(id)
		}
		r.advanceFloorLocked(p)
		if p.releasing && !r.partBusyLocked(id) {
			relIDs, relFloors = append(relIDs, int32(id)), append(relFloors, p.floor) //nolint:gosec // partition < 64
			r.dropPartLocked(id)
			continue
		}
		if p.floor != p.persisted || now.Sub(p.renewed) >= cfg.LockTTL/3 {
			renIDs, renFloors = append(renIDs, int32(id)), append(renFloors, p.floor) //nolint:gosec // partition < 64
		}
	}
	var want []int32
	for id := range mine {
		if r.parts[id] == nil {
			want = append(want, int32(id)) //nolint:gosec // partition < 64
		}
	}
	r.mu.Unlock()

	if len(relIDs) > 0 {
		if _, err := r.s.pool.Exec(qctx, r.oq.Release, r.id, relIDs, relFloors); err != nil && ctx.Err() == nil {
			r.logger.Error("Could not give partitions back; they pass to other relays after the lock TTL", err, nil)
		}
	}
	if len(renIDs) > 0 {
		t0 := time.Now()
		rows, err := r.s.pool.Query(qctx, r.oq.Renew, r.id, renIDs, renFloors, ttl)
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
				if p == nil {
					continue
				}
				if !got[id] {
					r.logger.Info("Partition lease lost; another relay took it", watermill.LogFields{"partition": id})
					r.fenceRejectedLocked("renew")
					r.dropPartLocked(id)
					continue
				}
				p.persisted = max(p.persisted, renFloors[i])
				p.renewed = t0
				p.deadline = t0.Add(cfg.LockTTL - r.margin())
			}
		}
		r.mu.Unlock()
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
			id    int
			floor int64
		}
		got, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (taken, error) {
			var t taken
			err := row.Scan(&t.id, &t.floor)
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
			r.parts[t.id] = &partState{id: t.id, floor: t.floor, persisted: t.floor, seen: t.floor,
				loaded: map[int64]*entry{}, renewed: t0, deadline: t0.Add(cfg.LockTTL - r.margin())}
		}
		r.mu.Unlock()
		if len(got) > 0 {
			r.signal()
		}
	}
}

// fence drops the partitions whose lease may have ended by the local clock.
func (r *orderedRelay) fence() {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := time.Now()
	for id, p := range r.parts {
		if now.After(p.deadline) {
			r.logger.Info("Partition lease not renewed in time; stopping its deliveries", watermill.LogFields{"partition": id})
			r.dropPartLocked(id)
		}
	}
}

func (r *orderedRelay) fenceRejectedLocked(op string) { r.s.fenceRejected(op) }

// partBusyLocked reports whether a runner works on a key of partition id.
func (r *orderedRelay) partBusyLocked(id int) bool {
	for _, k := range r.keys {
		if k.part == id && k.busy {
			return true
		}
	}
	return false
}

func (r *orderedRelay) dropQueuesLocked(id int) {
	for _, k := range r.keys {
		if k.part == id {
			k.queue = nil
		}
	}
}

// dropPartLocked forgets a partition and its keys; runners of its keys stop
// after their message in flight.
func (r *orderedRelay) dropPartLocked(id int) {
	delete(r.parts, id)
	for name, k := range r.keys {
		if k.part == id {
			k.queue = nil
			delete(r.keys, name)
		}
	}
}

// deliverableLocked reports whether k's partition is still owned (by the
// same lease) and within its lease.
func (r *orderedRelay) deliverableLocked(k *keyState) bool {
	p := r.parts[k.part]
	return p != nil && p == k.p && !p.releasing && time.Now().Before(p.deadline)
}

// cycle runs one cut, hold refresh and scan, advances the floors in memory
// and starts runners. It returns true when a scan was cut by its limit and
// there is room for more.
func (r *orderedRelay) cycle(ctx context.Context) bool {
	cfg := r.s.cfg
	r.mu.Lock()
	var ids []int32
	var froms []int64
	for id, p := range r.parts {
		r.advanceFloorLocked(p)
		if p.releasing || !time.Now().Before(p.deadline) || len(p.window) >= 2*cfg.BatchSize {
			continue
		}
		ids, froms = append(ids, int32(id)), append(froms, p.seen) //nolint:gosec // partition < 64
	}
	oldS0, oldVx := r.cutS0, r.cutVx
	g0 := r.gen
	r.mu.Unlock()
	if len(ids) == 0 {
		return false
	}
	qctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()

	// One round trip, three statements in this order (each reads its own
	// snapshot): the cut, the holds, the scan.
	// 1. The cut: rows up to a last value taken earlier are all committed or
	// aborted once every key writer seen then has ended; the scan that
	// follows sees them all.
	limit := cfg.BatchSize
	batch := &pgx.Batch{}
	batch.Queue(r.oq.Cut, r.s.cfg.Table.OrderingLockClass(), oldVx)
	batch.Queue(r.oq.Holds, ids)
	batch.Queue(r.oq.Scan, ids, froms, limit)
	br := r.s.pool.SendBatch(qctx, batch)
	type dbHold struct {
		key             string
		part            int
		seq             int64
		attempts        int
		due, dead, skip bool
	}
	var (
		s0      int64
		vx      []string
		oldOpen bool
		holds   []dbHold
		scanned []*schema.OrderedRow
	)
	err := func() error {
		defer br.Close()
		if err := br.QueryRow().Scan(&s0, &vx, &oldOpen); err != nil {
			return err
		}
		// 2. Holds of the owned partitions.
		rows, err := br.Query()
		if err != nil {
			return err
		}
		holds, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (dbHold, error) {
			var h dbHold
			err := row.Scan(&h.key, &h.part, &h.seq, &h.attempts, &h.due, &h.dead, &h.skip)
			return h, err
		})
		if err != nil {
			return err
		}
		// 3. Scan above what each partition has loaded.
		if rows, err = br.Query(); err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			row := &schema.OrderedRow{}
			if err := row.Scan(rows, r.oq.Columns); err != nil {
				return err
			}
			scanned = append(scanned, row)
		}
		return rows.Err()
	}()
	if err != nil {
		r.cycleError(ctx, err)
		return false
	}
	r.mu.Lock()
	if !oldOpen {
		r.safe = max(r.safe, oldS0)
	}
	r.cutS0, r.cutVx = s0, vx
	if len(vx) == 0 {
		r.safe = max(r.safe, s0)
	}
	safe := r.safe
	r.mu.Unlock()

	r.mu.Lock()
	defer r.mu.Unlock()
	for _, h := range holds {
		if r.parts[h.part] == nil || r.resolved[h.key] > g0 {
			continue
		}
		k := r.keyLocked(h.key, r.parts[h.part])
		if k.holdGen > g0 {
			continue // changed here since the read began
		}
		if k.hold == nil {
			// A hold this relay did not make (taken over with the
			// partition): the key's rows from its sequence on wait for it.
			k.hold = &holdState{seq: h.seq}
			kept := k.queue[:0]
			for _, e := range k.queue {
				if e.row.Sequence < h.seq {
					kept = append(kept, e)
				}
			}
			k.queue = kept
		}
		if k.hold.advancing || k.hold.seq != h.seq {
			continue
		}
		k.hold.attempts, k.hold.due, k.hold.dead, k.hold.skip = h.attempts, h.due, h.dead, h.skip
	}
	for key, g := range r.resolved {
		if g <= g0 {
			delete(r.resolved, key)
		}
	}
	byPart := map[int][]*schema.OrderedRow{}
	for _, row := range scanned {
		byPart[row.Partition] = append(byPart[row.Partition], row)
	}
	more := false
	for i, id32 := range ids {
		id := int(id32)
		p := r.parts[id]
		if p == nil || p.seen != froms[i] {
			continue
		}
		got := byPart[id]
		for _, row := range got {
			r.loadLocked(p, row)
		}
		p.lastScan = len(got)
		switch {
		case len(got) < limit:
			p.seen = max(p.seen, safe)
		default:
			p.seen = max(p.seen, min(got[len(got)-1].Sequence, safe))
			more = true
		}
		r.advanceFloorLocked(p)
	}
	r.startRunnersLocked()
	return more && r.runners < cfg.MaxInFlight
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
		k = &keyState{part: p.id, p: p}
		r.keys[name] = k
	}
	return k
}

// loadLocked adds a scanned row to its partition's window and, unless its
// key's hold covers it, to its key's queue.
func (r *orderedRelay) loadLocked(p *partState, row *schema.OrderedRow) {
	if row.Sequence <= p.floor || p.loaded[row.Sequence] != nil {
		return
	}
	e := &entry{row: row}
	p.loaded[row.Sequence] = e
	i := sort.Search(len(p.window), func(i int) bool { return p.window[i].row.Sequence > row.Sequence })
	p.window = append(p.window, nil)
	copy(p.window[i+1:], p.window[i:])
	p.window[i] = e
	k := r.keyLocked(row.Key, p)
	k.pending++
	if k.hold != nil && row.Sequence >= k.hold.seq {
		return // covered: delivered after the hold resolves
	}
	if row.Sequence <= k.delivered {
		r.logger.Error("Ordered relay read a row below one already delivered for its key; the writer did not take the key lock",
			errors.New("ordering violated"), watermill.LogFields{"sequence": row.Sequence, "partition": p.id})
	}
	j := sort.Search(len(k.queue), func(i int) bool { return k.queue[i].row.Sequence > row.Sequence })
	k.queue = append(k.queue, nil)
	copy(k.queue[j+1:], k.queue[j:])
	k.queue[j] = e
}

// advanceFloorLocked moves the in-memory floor of p over the done rows at
// the front of its window, never past seen.
func (r *orderedRelay) advanceFloorLocked(p *partState) {
	for len(p.window) > 0 && p.window[0].row.Sequence <= p.seen {
		e := p.window[0]
		k := r.keys[e.row.Key]
		covered := k != nil && k.hold != nil && !k.hold.advancing && e.row.Sequence >= k.hold.seq
		if !e.acked && !covered {
			break
		}
		p.window[0] = nil
		p.window = p.window[1:]
		delete(p.loaded, e.row.Sequence)
		if k != nil {
			k.pending--
			r.pruneKeyLocked(e.row.Key, k)
		}
	}
	if len(p.window) == 0 || p.window[0].row.Sequence > p.seen {
		p.floor = max(p.floor, p.seen)
	} else {
		p.floor = max(p.floor, p.window[0].row.Sequence-1)
	}
}

func (r *orderedRelay) pruneKeyLocked(name string, k *keyState) {
	if k.pending <= 0 && !k.busy && k.hold == nil && len(k.queue) == 0 {
		delete(r.keys, name)
	}
}

// startRunnersLocked starts a runner for every key with work, up to
// MaxInFlight runners.
func (r *orderedRelay) startRunnersLocked() {
	for name, k := range r.keys {
		if r.runners >= r.s.cfg.MaxInFlight {
			return
		}
		if k.busy || !r.deliverableLocked(k) || !r.hasWorkLocked(k) {
			continue
		}
		k.busy = true
		r.runners++
		r.runWg.Add(1)
		go r.runKey(name, k)
	}
}

func (r *orderedRelay) hasWorkLocked(k *keyState) bool {
	if len(k.queue) > 0 {
		return true
	}
	h := k.hold
	return h != nil && !h.advancing && (h.skip || (h.due && !h.dead))
}

// runKey delivers the rows of one key one after another until the key has
// nothing to do.
func (r *orderedRelay) runKey(name string, k *keyState) {
	defer r.runWg.Done()
	stop := r.sub.stopped()
	for {
		r.mu.Lock()
		if !r.deliverableLocked(k) || r.keys[name] != k {
			r.endRunLocked(name, k)
			r.mu.Unlock()
			return
		}
		switch {
		case len(k.queue) > 0:
			e := k.queue[0]
			k.queue = k.queue[1:]
			k.delivered = max(k.delivered, e.row.Sequence)
			if len(k.queue) == r.s.cfg.BatchSize/2 {
				r.signal() // read ahead while the key runs
			}
			r.mu.Unlock()
			switch r.deliverRow(name, k, e.row, 1, stop, func() {
				e.acked = true
			}) {
			case verdictAck:
			case verdictNone:
				// Not delivered or no verdict: the row stays first of its key.
				r.mu.Lock()
				if r.keys[name] == k && k.hold == nil {
					k.queue = append([]*entry{e}, k.queue...)
				}
				r.endRunLocked(name, k)
				r.mu.Unlock()
				return
			default:
				r.mu.Lock()
				r.endRunLocked(name, k)
				r.mu.Unlock()
				return
			}
		case k.hold != nil && !k.hold.advancing && k.hold.skip:
			k.hold.advancing = true
			seq := k.hold.seq
			r.mu.Unlock()
			r.advanceHold(name, k, seq)
		case k.hold != nil && !k.hold.advancing && k.hold.due && !k.hold.dead:
			seq, attempts := k.hold.seq, k.hold.attempts
			k.hold.due = false
			r.mu.Unlock()
			row, err := r.rowAt(name, seq)
			if errors.Is(err, pgx.ErrNoRows) {
				// The held row is gone (deleted by hand): continue after it.
				r.mu.Lock()
				k.hold.advancing = true
				r.mu.Unlock()
				r.advanceHold(name, k, seq)
				continue
			}
			if err != nil {
				r.logger.Error("Could not read a held row; retrying at the next poll", err, watermill.LogFields{"sequence": seq})
				r.mu.Lock()
				k.hold.due = true
				r.endRunLocked(name, k)
				r.mu.Unlock()
				return
			}
			switch r.deliverRow(name, k, row, attempts+1, stop, func() {
				k.hold.advancing = true
			}) {
			case verdictAck:
			case verdictNone:
				r.mu.Lock()
				if k.hold != nil && k.hold.seq == seq && !k.hold.advancing {
					k.hold.due = true
				}
				r.endRunLocked(name, k)
				r.mu.Unlock()
				return
			default:
				r.mu.Lock()
				r.endRunLocked(name, k)
				r.mu.Unlock()
				return
			}
			r.mu.Lock()
			adv := k.hold != nil && k.hold.advancing && k.hold.seq == seq
			r.mu.Unlock()
			if adv {
				r.advanceHold(name, k, seq)
			}
		default:
			r.endRunLocked(name, k)
			r.mu.Unlock()
			return
		}
	}
}

func (r *orderedRelay) endRunLocked(name string, k *keyState) {
	k.busy = false
	r.runners--
	if r.keys[name] == k {
		r.pruneKeyLocked(name, k)
	}
	r.signal()
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

type verdict int

const (
	verdictAck  verdict = iota // acked
	verdictNack                // nacked and recorded (or refused)
	verdictNone                // not sent, or no verdict before the close timeout
)

// deliverRow sends one row and waits for its verdict. onAck runs under the
// relay's lock when the message is acked.
func (r *orderedRelay) deliverRow(name string, k *keyState, row *schema.OrderedRow, attempts int, stop <-chan struct{}, onAck func()) verdict {
	s := r.s
	row.Attempts = int32(attempts) //nolint:gosec // attempts are small
	c := &claimed{row: row.ClaimedRow}
	msg, err := row.Message(s.cfg.Table)
	if err != nil {
		c.slot = &errorSlot{err: Permanent(err)}
		c.delivered = time.Now()
		r.fail(name, k, row, c)
		return verdictNack
	}
	c.slot = &errorSlot{}
	// As in the default mode, the message outlives the Subscribe context
	// until CloseTimeout after the relay stopped.
	msgCtx, cancel := context.WithCancel(withErrorSlot(context.WithoutCancel(r.sub.ctx), c.slot))
	defer cancel()
	msg.SetContext(msgCtx)
	c.msg = msg
	select {
	case <-stop:
		return verdictNone
	default:
	}
	select {
	case r.sub.out <- msg:
		c.delivered = time.Now()
	case <-stop:
		return verdictNone
	}
	var grace <-chan time.Time
	overrun := time.NewTimer(s.overrunAfter())
	defer overrun.Stop()
	for {
		select {
		case <-overrun.C:
			// As in the default mode: the attempt counts as failed and holds
			// the key like any failure.
			c.slot.set(s.overrunError())
			cancel()
			r.logger.Error("Handler overran its dispatch timeout; counting a failed attempt", s.overrunError(),
				watermill.LogFields{"event_id": row.EventID})
			r.fail(name, k, row, c)
			return verdictNack
		case <-msg.Acked():
			r.mu.Lock()
			onAck()
			r.mu.Unlock()
			s.observeDispatch(c, metrics.ResultSuccess)
			if m := s.cfg.Metrics; m != nil {
				m.DeliveryLag.WithLabelValues(s.label).Observe(time.Since(row.CreatedAt).Seconds())
			}
			return verdictAck
		case <-msg.Nacked():
			r.fail(name, k, row, c)
			return verdictNack
		case <-stop:
			stop = nil
			grace = time.After(s.cfg.CloseTimeout)
		case <-grace:
			r.logger.Info("Message neither acked nor nacked before the close timeout; the next owner delivers it again",
				watermill.LogFields{"event_id": row.EventID})
			return verdictNone
		}
	}
}

// fail records a failed attempt of row as its key's hold.
func (r *orderedRelay) fail(name string, k *keyState, row *schema.OrderedRow, c *claimed) {
	s := r.s
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	err := c.slot.get()
	text := "handler nacked the message without an error (add the subscriber.CaptureError middleware to record it)"
	if err != nil {
		text = err.Error()
	}
	summary := redact.Summary(text, []byte(row.Payload), s.cfg.LastErrorMaxBytes)
	attempts := int(row.Attempts)
	backoff := s.cfg.Backoff(attempts)
	var (
		dead bool
		n    int
	)
	qerr := s.pool.QueryRow(ctx, r.oq.Fail, r.id, row.Partition, name, row.Sequence, summary, s.cfg.MaxAttempts,
		IsPermanent(err), backoff.Seconds()).Scan(&dead, &n)
	s.observeDispatch(c, metrics.ResultFailure)
	if qerr != nil && !errors.Is(qerr, pgx.ErrNoRows) {
		time.Sleep(100 * time.Millisecond) // the database is failing; do not spin
	}
	fields := watermill.LogFields{"event_id": row.EventID, "sequence": row.Sequence, "attempts": attempts, "error": summary}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.keys[name] != k {
		return // the partition was dropped meanwhile
	}
	switch {
	case errors.Is(qerr, pgx.ErrNoRows):
		r.fenceRejectedLocked("nack")
		r.logger.Info("Nack ignored: the partition passed to another relay, or the key has another hold", fields)
		if e := r.entryLocked(row); e != nil && k.hold == nil && r.deliverableLocked(k) {
			k.queue = append([]*entry{e}, k.queue...)
		}
		return
	case qerr != nil:
		// Deliver the row again: put it back at the head of its key.
		r.logger.Error("Could not record nack; delivering the row again", qerr, fields)
		if e := r.entryLocked(row); e != nil && k.hold == nil {
			k.queue = append([]*entry{e}, k.queue...)
		}
		return
	}
	if k.hold == nil || k.hold.seq != row.Sequence {
		k.hold = &holdState{seq: row.Sequence}
		// The rows queued behind it wait for the hold.
		k.queue = nil
	}
	k.hold.attempts, k.hold.dead, k.hold.due, k.hold.advancing = n, dead, false, false
	r.gen++
	k.holdGen = r.gen
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

func (r *orderedRelay) entryLocked(row *schema.OrderedRow) *entry {
	if p := r.parts[row.Partition]; p != nil {
		return p.loaded[row.Sequence]
	}
	return nil
}

// advanceHold moves the key's hold past seq (the held row succeeded or was
// skipped): to the key's next row at or below the floor, or away.
func (r *orderedRelay) advanceHold(name string, k *keyState, seq int64) {
	r.mu.Lock()
	p := r.parts[k.part]
	if p == nil || p != k.p {
		k.hold.advancing = false
		r.mu.Unlock()
		return
	}
	floor := p.floor
	r.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	var (
		owned, deleted bool
		next           *int64
	)
	err := r.s.pool.QueryRow(ctx, r.oq.Advance, r.id, k.part, name, seq, floor).Scan(&owned, &next, &deleted)
	r.mu.Lock()
	defer r.mu.Unlock()
	h := k.hold
	if h == nil || h.seq != seq || r.keys[name] != k {
		return
	}
	r.gen++
	k.holdGen = r.gen
	switch {
	case err != nil:
		r.logger.Error("Could not move a hold on; retrying", err, watermill.LogFields{"sequence": seq})
		h.advancing = false
		h.skip = true // retried as a skip: the row was handled
	case !owned:
		h.advancing = false
		r.fenceRejectedLocked("ack")
	case next != nil:
		k.hold = &holdState{seq: *next, due: true}
	case deleted:
		k.hold = nil
		r.resolved[name] = r.gen
		// The key's rows above the floor that the hold covered are
		// delivered now, in order.
		if p := r.parts[k.part]; p != nil && p == k.p {
			k.queue = k.queue[:0]
			for _, e := range p.window {
				if e.row.Key == name && e.row.Sequence > seq && !e.acked {
					k.queue = append(k.queue, e)
				}
			}
		}
	default:
		// The hold changed under us (runbook); reload it next cycle.
		h.advancing = false
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
