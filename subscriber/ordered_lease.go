package subscriber

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"
)

// tick heartbeats, releases partitions no longer assigned, renews leases and
// persists floors, cleans resolved holds below the written floors, and takes
// assigned partitions that are free.
func (r *orderedRelay) tick(ctx context.Context) {
	cfg := r.s.cfg
	ttl := cfg.LockTTL.Seconds()
	qctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	if err := r.s.modeLock.modeReady(r.s); err != nil {
		// The mode lock is down, or the table was switched away
		// (modelock.go): no partition is taken or renewed.
		r.fence()
		return
	}
	var live []string
	if err := r.s.pool.QueryRow(qctx, r.oq.Heartbeat, r.id, ttl).Scan(&live); err != nil {
		if ctx.Err() == nil {
			r.logger.Error("Ordered relay heartbeat failed", err, nil)
		}
		r.fence()
		return
	}
	mine := assigned(r.id, live)
	pinned := r.horizon.pinned(qctx, r.s.pool, r.times.pinnedAfter)
	now := time.Now()

	r.mu.Lock()
	var relIDs []int32
	var relFloors, relEpochs []int64
	var renIDs []int32
	var renFloors, renEpochs []int64
	for id, p := range r.parts {
		if !mine[id] {
			p.releasing = true
		}
		p.advanceFloor()
		if p.releasing && !r.releaseKeysLocked(p) {
			relIDs, relFloors, relEpochs = append(relIDs, int32(id)), append(relFloors, p.floor), append(relEpochs, p.term.Epoch()) //nolint:gosec // partition < 64
			r.dropPartLocked(id)
			continue
		}
		if p.floorDue(pinned, now, r.times) {
			renIDs, renFloors, renEpochs = append(renIDs, int32(id)), append(renFloors, p.floor), append(renEpochs, p.term.Epoch()) //nolint:gosec // partition < 64
		}
	}
	var want []int32
	for id := range mine {
		// A partition whose earlier term still has a message in a
		// handler is not taken again before that copy ends (its verdict,
		// its overrun): one copy of a key in a handler at a time (term
		// one copy per key, quiescence).
		if r.parts[id] == nil && r.terms.Quiesced(id) {
			want = append(want, int32(id)) //nolint:gosec // partition < 64
		}
	}
	r.mu.Unlock()

	if len(relIDs) > 0 {
		if _, err := r.oq.Release(r.id, relIDs, relFloors, relEpochs).Exec(qctx, r.s.pool); err != nil && ctx.Err() == nil {
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
				p.deadline = t0.Add(cfg.LockTTL - r.times.margin)
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
				open: map[int64]struct{}{}, renewed: t0, deadline: t0.Add(cfg.LockTTL - r.times.margin),
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
		if h := k.hold; h != nil && !h.Open() && h.Seq <= k.p.persisted && r.parts[k.p.id] == k.p {
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

// releaseKeysLocked stops the deliveries of the keys of p, which is being
// given back (their rows stay open, so the floor stays below them), and
// reports whether a runner still works on one of them.
func (r *orderedRelay) releaseKeysLocked(p *partState) (busy bool) {
	for _, k := range r.keys {
		if k.p == p {
			k.queue = nil
			busy = busy || k.Out()
		}
	}
	return busy
}

// dropPartLocked ends a partition's term and forgets it and its keys: the
// contexts of its messages in handlers are cancelled (a term's end cancels its messages), runners of
// its keys stop, the ledger follows the copies left in handlers (their
// verdicts are written nowhere: a verdict of an ended term is not progress), and the partition is not taken again
// until those have ended (one copy per key, quiescence).
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

// floorDue reports whether the tick writes p's lease and floor. A floor
// that moved is written at the tick, with the lease, unless the xmin horizon
// is pinned: then a floor that keeps moving is written at most every
// floorEvery, so that the progress of a busy relay leaves a bounded number
// of row versions (the pinned horizon keeps them all): 64 partitions every
// 6 s at the default LockTTL. A floor that stopped moving (the partition has
// nothing open and its floor did not move since the previous tick: a burst
// or a drain ended) is written at once, so the written progress follows a
// burst's end within two ticks even then. The lease is renewed every
// LockTTL/3 whatever the floor does. It records the floor of this tick.
func (p *partState) floorDue(pinned bool, now time.Time, t orderedTimes) bool {
	quiet := p.floor == p.ticked && len(p.open) == 0 && len(p.watches) == 0
	p.ticked = p.floor
	moved := p.floor != p.persisted && (!pinned || quiet || now.Sub(p.renewed) >= t.floorEvery)
	return moved || now.Sub(p.renewed) >= t.renew
}
