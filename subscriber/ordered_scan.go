package subscriber

import (
	"context"
	"sort"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"
	"github.com/outboxkit/watermill-outbox/internal/keyed"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/schema"
)

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
	if err := r.locks.resolve(qctx, r.s.pool, r.s.cfg.Table); err != nil {
		cycleError(ctx, r.logger, err)
		return 0, false
	}
	if err := r.s.pool.QueryRow(qctx, r.oq.Cut, r.locks.class, r.locks.legacy).Scan(&s0, &vxids, &hashes); err != nil {
		cycleError(ctx, r.logger, err)
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
		p.full = len(p.open) >= r.times.readAhead
		// A full partition rescans nothing either: what an ended writer
		// committed stays unread until there is room, unless nothing of the
		// partition can move (its open rows are watched, or
		// wait): then the rows that fill it wait for a watch to end, and it
		// ends (at most limit rows more are read, the ended writer's, which
		// come before them). Whether it can move is read once, and only
		// when a watched writer has ended.
		canEnd, known := !p.full, !p.full
		for _, w := range p.watches {
			if locks[cutLock{w.vxid, w.hash}] {
				continue
			}
			if !known {
				canEnd, known = r.stalledLocked(p), true
			}
			if canEnd {
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
		rescan   []*sqlq.OrderedRow
		scanned  []*sqlq.OrderedRow
		readRows = func(dst *[]*sqlq.OrderedRow) error {
			rows, err := br.Query()
			if err != nil {
				return err
			}
			defer rows.Close()
			for rows.Next() {
				row := &sqlq.OrderedRow{}
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
		cycleError(ctx, r.logger, err)
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
	// above it stay watched.
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
	byScan := map[int][]*sqlq.OrderedRow{}
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
			p.watch(l, p.seen, to)
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
		p.advanceFloor()
	}
	r.startRunnersLocked()
	return loaded, more
}

// watch records that the writer of l may commit rows of its hash in
// (from, to] of p later.
func (p *partState) watch(l cutLock, from, to int64) {
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
			if cur.Seq == h.seq && h.skip && cur.Open() {
				cur.State = keyed.SkipRequested // honoured once the attempt in flight ends
			}
			continue
		}
		state := keyed.StateOf(h.dead, h.skip, h.replay, h.resolved)
		due := time.Now().Add(time.Duration(h.dueIn * float64(time.Second)))
		if cur != nil && cur.Seq == h.seq && cur.replay == h.replay && cur.Open() == !h.resolved {
			cur.Attempts, cur.State, cur.DueAt = h.attempts, state, due
			continue
		}
		k.setHold(&holdState{Hold: keyed.Hold{Seq: h.seq, Attempts: h.attempts, DueAt: due, State: state}, replay: h.replay})
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

// setHold makes h the hold of k and applies what it says to the key's
// loaded rows: rows below an active hold are done, rows at or above it are
// covered (the hold delivers them); rows at or below a resolved hold are
// done; a replay hold changes nothing. The relay's mutex is held.
func (k *keyState) setHold(h *holdState) {
	k.hold = h
	if h == nil || h.replay {
		return
	}
	kept := k.queue[:0]
	for _, e := range k.queue {
		if !h.Open() && e.row.Sequence > h.Seq {
			kept = append(kept, e)
			continue
		}
		delete(k.p.open, e.row.Sequence)
	}
	clear(k.queue[len(kept):])
	k.queue = kept
	if k.flying != 0 && (h.Open() || k.flying <= h.Seq) {
		// The row in flight is covered too: its verdict no longer decides
		// the floor (an ack is a duplicate of done work, a nack finds the
		// hold).
		delete(k.p.open, k.flying)
	}
}

// cycleError logs a failed scan and waits a moment before the next.
func cycleError(ctx context.Context, logger watermill.LoggerAdapter, err error) {
	if ctx.Err() != nil {
		return
	}
	logger.Error("Ordered relay scan failed, retrying", err, nil)
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
func (r *orderedRelay) loadLocked(p *partState, row *sqlq.OrderedRow) bool {
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
		if row.Sequence <= h.Seq {
			return false // done, or the held row itself
		}
		if h.Open() && !h.advancing {
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

// advanceFloor raises the in-memory floor of p to the highest value its
// invariant allows: below every open row and every watch, at most seen.
// The relay's mutex is held.
func (p *partState) advanceFloor() {
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
	if !k.Out() && k.hold == nil && len(k.queue) == 0 {
		delete(r.keys, name)
	}
}

// watchedLocked reports whether row waits for a watch of its hash: a writer
// that may still commit a lower row of its key.
func watchedLocked(p *partState, row *sqlq.OrderedRow) bool {
	for _, w := range p.watches {
		if w.hash == row.KeyHash && row.Sequence > w.from {
			return true
		}
	}
	return false
}

// stalledLocked reports whether no key of p can move: none has a runner or
// a next action (its first row is watched, its topic is
// paused, or its hold waits for a retry).
func (r *orderedRelay) stalledLocked(p *partState) bool {
	for _, k := range r.keys {
		if k.p == p && (k.Out() || k.flying != 0 || r.nextActionLocked(k) != actNone) {
			return false
		}
	}
	return true
}
