package walrelay

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pglogrepl"

	"github.com/outboxkit/watermill-outbox/internal/keyed"
)

// holdBook is the session's holds, by ordering key, and their lifecycle:
// a key held by a dead row, a retrying key's backlog spilled to its hold,
// drains of parked rows in bounded batches, tombstones until the confirmed
// position passes them. Its statements are the session's fenced writes.
type holdBook struct {
	st *stream
	m  map[string]*hold // by ordering key
	// spillPause: a spill failed (a database error); none is tried again
	// before it.
	spillPause time.Time
}

// hold is an ordering key held back by a dead row (persisted in the holds
// table): the key's later rows are parked, not delivered, until the dead
// row is delivered again (a replay) or skipped; then the parked rows are
// read from the table and delivered in order (draining) and the hold
// becomes a tombstone until the relay's confirmed position passes every
// row the drain read: the stream's own copies of those rows (the relay may
// be behind) are parked, not delivered again.
//
// A retrying hold (retrying) holds the key of a row that failed and waits
// for its retry, its key's backlog spilled to the table (spill): at
// retryAt the relay reads the key's rows from the held row on and delivers
// them (startRetry), the held row first, with its attempts.
type hold struct {
	// keyed.Hold: the held row (Seq), its attempts so far, when a
	// retrying hold's row is due (DueAt), and the state: Dead (also after
	// an operator's replay of it, until its ack), Retrying (spilled: its
	// retry reads the key's rows from the table), Replayed (a retrying
	// hold's row replayed by an operator), Draining (the parked rows are
	// delivered from the table), Resolved (a tombstone).
	keyed.Hold
	through   int64         // rows of the key up to it went through a drain (or were skipped): park their copies
	untilLSN  pglogrepl.LSN // the WAL position after the last drain's read
	wantDrain bool          // a drain was asked for and its statements failed
	maxRead   int64         // draining: the last sequence read from the table
	left      int           // draining: rows read and not settled yet
	// more: the drain's last batch was full; the key's rows after maxRead
	// are read from the table in the next batch once this one is settled
	// (drained), and their streamed copies are parked meanwhile.
	more bool
	// retried: the drain is a retrying hold's retry, which delivers the
	// held row itself again; a drain after the held row's skip (or its
	// replay's ack) does not, and a copy of the held row still in a handler
	// then is one the skip found there (onSettle).
	retried bool
	unseen  int // the drain waits for streamed rows to be visible: its tries so far (visible.go)
	// read holds the ids of the rows the drain's current batch read from
	// the table: the stream's copy of a replay of one of them is a copy of
	// a row the drain delivers (parked); a replay of a row it passed (dead
	// when it read) is new work, and so is one of a row an earlier batch
	// delivered (at least once).
	read map[string]struct{}
	// acked is the held row's replay, acked and not settled until the
	// drain it starts is written (a replay's ack waits for its drain): the confirmed position
	// does not pass the replay's UPDATE before the hold says draining, so
	// a session that ends first leaves the replay to be streamed again.
	acked *item
}

// replayedBy reports whether it, acked, is the held row delivered again
// (a replay): its ack starts the hold's drain. A nil hold holds nothing.
func (h *hold) replayedBy(it *item) bool {
	return h != nil && h.State != keyed.Draining && h.Open() && it.row.Sequence == h.Seq
}

// ownRowOnly reports whether it, failed for good, is parked dead without
// holding its key: an operator's replay of a row that does not hold its
// key (a skipped or delivered row, or a dead row the key went past). A
// failed replay holds only its own row: the key's later rows, delivered
// before the replay or written after it, are neither delivered again nor
// held back. The row waits, dead, for a replay or a skip, which the
// runbook applies on the row itself (sqlq.WALSkipDeadRow). The replay of
// the row an open hold holds holds the key again as it did.
func (hb *holdBook) ownRowOnly(it *item) bool {
	if !it.replay {
		return false
	}
	h := hb.holdOf(it)
	return h == nil || !h.Open() || h.Seq != it.row.Sequence
}

// settleAcked settles the held row's acked replay that waited for its
// drain (hold.acked), if any.
func (hb *holdBook) settleAcked(h *hold) {
	st := hb.st
	if h != nil && h.acked != nil {
		st.settled(h.acked)
		h.acked = nil
	}
}

// holdOf is the hold of the item's key, or nil.
func (hb *holdBook) holdOf(it *item) *hold {
	if it.row.OrderingKey == nil || *it.row.OrderingKey == "" {
		return nil
	}
	return hb.m[*it.row.OrderingKey]
}

// parks reports whether a streamed row of a held key is parked instead of
// delivered: a copy of a row a drain delivered (or skipped), every row of
// the key from the dead row on but the dead row's own replay, and while the
// hold drains, the rows it read from the table.
func (hb *holdBook) parks(it *item) bool {
	h := hb.holdOf(it)
	if h == nil {
		return false
	}
	seq := it.row.Sequence
	replayOfHeld := it.replay && seq == h.Seq && h.State != keyed.Draining && h.Open()
	switch {
	case replayOfHeld:
		return false
	case it.replay && h.State == keyed.Resolved:
		// An operator's replay after the hold was resolved (of the skipped
		// row, say) is new work, not a copy of a drained row.
		return false
	case h.earlierReplay(it):
		// An operator's replay of an earlier row of the key (a dead row the
		// key went past): new work too. The hold's own drains read only
		// rows after its row; an earlier drain that read this row after
		// the replay delivered it already, and this is a copy (at least
		// once). Parked, it was lost: no drain reads it again.
		return false
	case it.replay && h.State == keyed.Draining && !h.drainReads(it):
		// A replay of a row the drain read past (dead when it read: the
		// replay committed after the read, before the write that marked
		// the hold draining, so the runbook accepted it), or of a row after
		// its last batch: no batch of this drain delivers it, new work as
		// above. Parked, it was lost.
		return false
	case seq <= h.through:
		return true
	case h.State == keyed.Resolved:
		return false
	case h.State == keyed.Draining:
		return seq <= h.maxRead || h.more
	}
	return seq >= h.Seq
}

// earlierReplay reports whether it is an operator's replay of a row of
// h's key before its held row: new work, never parked, since the hold's
// drains read only rows after its row (parks, holdKey).
func (h *hold) earlierReplay(it *item) bool { return it.replay && it.row.Sequence < h.Seq }

// drainReads reports whether a batch of h's drain delivers it's row from
// the table: one the current batch read, or one after it when more
// batches follow.
func (h *hold) drainReads(it *item) bool {
	if _, ok := h.read[it.row.ID]; ok {
		return true
	}
	return h.more && it.row.Sequence > h.maxRead
}

// holdKey holds the key of a row that went dead: its queued rows are
// parked (the holds table keeps them back). A tombstone's or an earlier
// drain's through is kept.
func (hb *holdBook) holdKey(key string, seq int64, q *keyQueue) {
	st := hb.st
	st.win.backedOff(q)
	h := &hold{Hold: keyed.Hold{Seq: seq, State: keyed.Dead}}
	if old := hb.m[key]; old != nil {
		h.through = max(old.through, old.maxRead)
		hb.settleAcked(old)
	}
	hb.m[key] = h
	parked := 0
	keep := q.items[:0:0]
	for _, it := range q.items {
		if h.earlierReplay(it) {
			// An operator's replay of an earlier row of the key, queued
			// behind the row that went dead: new work, as parks says of
			// one streamed after the hold. Parked here, it was lost: the
			// hold's drains read only rows after its row.
			keep = append(keep, it)
			continue
		}
		st.settled(it)
		parked++
	}
	q.items = keep
	st.s.logger.Info("Key held by a dead row: its later rows wait for a replay or a skip", watermill.LogFields{"sequence": seq})
	st.s.logger.Trace("Hold", watermill.LogFields{"key": key, "sequence": seq, "parked": parked, "kept": len(keep)})
}

// afterAck drains a hold whose dead row was delivered again, and releases
// a draining hold once its rows are delivered.
func (hb *holdBook) afterAck(ctx context.Context, it *item) {
	h := hb.holdOf(it)
	if h == nil {
		return
	}
	key := *it.row.OrderingKey
	switch {
	case h.replayedBy(it):
		hb.startDrain(ctx, key, h)
	case h.State == keyed.Draining && h.left == 0:
		hb.drained(ctx, key, h)
	}
}

// drained follows a drain whose rows read so far are all settled: it
// reads the next batch when the last one was full, and releases the hold
// otherwise.
func (hb *holdBook) drained(ctx context.Context, key string, h *hold) {
	if h.more {
		hb.drainFrom(ctx, key, h, drainNext)
		return
	}
	hb.release(ctx, key, h)
}

// drainMode is what drainFrom reads: the rows after the held row (a
// replay's ack or a skip), the held row and those after it (the retry of a
// retrying hold), or the batch after the last one read (a drain under way).
type drainMode uint8

const (
	drainStart drainMode = iota
	drainRetry
	drainNext
)

// startDrain reads the rows the hold kept back and queues them first.
func (hb *holdBook) startDrain(ctx context.Context, key string, h *hold) {
	hb.drainFrom(ctx, key, h, drainStart)
}

// startRetry retries a retrying hold: it reads the key's rows from the
// held row on and queues them, the held row first with its attempts.
// When a skip was requested meanwhile (RetryDrain changes nothing), the
// skip is applied instead (startDrain).
func (hb *holdBook) startRetry(ctx context.Context, key string, h *hold) {
	hb.drainFrom(ctx, key, h, drainRetry)
}

// drainFrom reads the rows of the hold's key after its row (and, for a
// retry, the held row too; for drainNext, after the last row read) and
// queues them in sequence order before the key's rows streamed after the
// read. It reads at most MaxInFlight rows (a batch): when the batch is
// full (more), the key's streamed rows stay parked and the next batch is
// read once this one is settled (drained), so a drain holds at most
// MaxInFlight rows read from the table and not settled, however long the
// key's backlog.
func (hb *holdBook) drainFrom(ctx context.Context, key string, h *hold, mode drainMode) {
	st := hb.st
	retry := mode == drainRetry
	s := st.s
	h.wantDrain = true
	// The drain reads the rows parked behind the hold from the table: it
	// waits until every row the stream parked is visible (a dead write waits for its row to be visible).
	if ok, err := st.vis.visible(ctx); err != nil || !ok {
		if err != nil {
			s.logger.Error("Could not tell whether the streamed rows are visible; retrying at the next tick", err, nil)
			return
		}
		st.schedule(time.Now().Add(visibleDelay(h.unseen)))
		h.unseen++
		s.unseen.Add(1)
		return
	}
	h.unseen = 0
	after, sql, op := h.Seq, s.q.Drain, "drain"
	switch mode {
	case drainRetry:
		after, sql, op = h.Seq-1, s.q.RetryDrain, "retry"
	case drainNext:
		after = h.maxRead
	}
	batch := s.cfg.MaxInFlight
	items, err := st.readItems(ctx, s.q.Parked, key, after, batch)
	if err != nil {
		s.logger.Error("Could not read the rows of a held key; retrying at the next tick", err, nil)
		return
	}
	// Every row read was committed before this position: once the relay
	// confirmed it, the stream holds no more copies of them.
	var lsnText string
	if err := s.pool.QueryRow(ctx, s.q.InsertPosition).Scan(&lsnText); err != nil {
		s.logger.Error("Could not read the WAL position; retrying at the next tick", err, nil)
		return
	}
	lsn, err := pglogrepl.ParseLSN(lsnText)
	if err != nil {
		s.logger.Error("Could not read the WAL position; retrying at the next tick", err, nil)
		return
	}
	maxRead := h.Seq
	if mode == drainNext {
		maxRead = h.maxRead
	}
	if len(items) > 0 {
		maxRead = max(maxRead, items[len(items)-1].row.Sequence)
	}
	var n int
	if ok, err := st.write(ctx, op, sql, []any{&n}, key, h.Seq, maxRead, lsnText); err != nil || !ok {
		if err != nil {
			s.logger.Error("Could not mark a hold draining; retrying at the next tick", err, nil)
		}
		return
	}
	if retry && n == 0 {
		// A skip was requested while the hold was retrying: the held row
		// is not delivered, the rows behind it are.
		h.State = keyed.SkipRequested
		hb.startDrain(ctx, key, h)
		return
	}
	if retry && len(items) > 0 && items[0].row.Sequence == h.Seq {
		items[0].attempts = max(h.Attempts, int(items[0].row.Attempts))
	}
	// A drain after the held row's ack or skip retries no more; nor does
	// a retry's next batch (its held row was acked: the batch before it
	// is settled).
	h.State, h.wantDrain, h.maxRead, h.left, h.untilLSN = keyed.Draining, false, maxRead, len(items), lsn
	h.read = make(map[string]struct{}, len(items)) // this batch's: at most MaxInFlight ids
	for _, it := range items {
		h.read[it.row.ID] = struct{}{}
	}
	h.more = len(items) == batch
	if mode != drainNext {
		h.retried = retry
	}
	if h.acked != nil {
		hb.settleAcked(h) // the hold says draining: the replay's position may pass
		st.confirmSettled()
	}
	if mode != drainNext {
		s.logger.Info("Hold drains: the key's parked rows are delivered", watermill.LogFields{"rows": len(items), "retry": retry, "more": h.more})
	}
	s.logger.Trace("Drain", watermill.LogFields{"key": key, "sequence": h.Seq, "rows": len(items), "max_read": h.maxRead, "retry": retry, "more": h.more})
	if len(items) == 0 {
		hb.release(ctx, key, h)
		return
	}
	k := keyOf(items[0].row)
	q := st.keys[k]
	if q == nil {
		q = &keyQueue{}
		st.keys[k] = q
	}
	q.items = mergeDrained(q, items)
	st.win.fromTable += len(items)
	st.peakRows()
	st.dispatch(ctx, k)
}

// spill spills the backlog of q, whose head waits for its retry, to a
// retrying hold (a spill loses nothing): the hold is written first, at the head
// (sqlq.WALQueries.Spill, fenced, with the head's attempts and last
// error on its row); then the key's rows leave memory, settled in the
// stream as parked rows, and the hold retries at the head's retry time.
// It reports whether the key was spilled; a key that cannot be
// (spillable) or a failed write leaves q as it is.
func (hb *holdBook) spill(ctx context.Context, key string, q *keyQueue) bool {
	st := hb.st
	if !hb.spillable(q) || time.Now().Before(hb.spillPause) {
		return false
	}
	head := q.items[0]
	okey := *head.row.OrderingKey
	var through int64
	if old := hb.m[okey]; old != nil {
		through = max(old.through, old.maxRead)
	}
	var n int
	ok, err := st.write(ctx, "spill", st.s.q.Spill, []any{&n}, head.row.ID, okey, through, head.attempts, head.lastErr)
	switch {
	case err == nil && !ok:
		st.stopping = true // refused: the session ends (as for a dead row)
		return false
	case err != nil || n == 0:
		if err == nil {
			err = errors.New("the key's hold could not be written")
		}
		st.s.logger.Error("Could not spill a retrying key's rows; they stay in memory", err, watermill.LogFields{"sequence": head.row.Sequence})
		hb.spillPause = time.Now().Add(st.s.cfg.StatusInterval)
		return false
	}
	st.win.backedOff(q)
	rows := len(q.items)
	for _, it := range q.items {
		if it.tx != nil {
			st.win.unsettled--
			it.tx.pending--
		} else {
			st.win.fromTable-- // a drained row is read again at the retry
		}
	}
	h := &hold{Hold: keyed.Hold{Seq: head.row.Sequence, State: keyed.Retrying, DueAt: q.RetryAt, Attempts: head.attempts}, through: through}
	hb.m[okey] = h
	q.items, q.RetryAt = nil, time.Time{}
	st.s.spilled.Add(1)
	st.schedule(h.DueAt)
	st.s.logger.Info("A retrying key's rows spilled to its hold: they are delivered from the table at the retry", watermill.LogFields{"sequence": h.Seq, "rows": rows})
	st.s.logger.Trace("Spill", watermill.LogFields{"key": okey, "sequence": h.Seq, "rows": rows})
	st.confirmSettled()
	st.dispatch(ctx, key) // drops the empty queue
	return true
}

// moreInTable reports whether the key of it drains a backlog longer than
// the batch it read (hold.more): the key's backlog is in the table, and
// its head that waits for a retry is spilled again rather than kept in
// memory with the batch.
func (hb *holdBook) moreInTable(it *item) bool {
	h := hb.holdOf(it)
	return h != nil && h.State == keyed.Draining && h.more
}

// spillable reports whether q's backlog can be spilled: the relay is not
// stopping, the table has keys to hold (ordering_key), q's head waits for its
// retry and has an ordering key, no queued row is an operator's replay (a
// replayed head's later rows may have been delivered, and a replayed row
// behind the head may come before it in sequence order: the retry reads
// neither back), and its key is not held by a dead row.
func (hb *holdBook) spillable(q *keyQueue) bool {
	st := hb.st
	if !st.s.cols.OrderingKey || st.stopping || !q.backoff || q.Out() || len(q.items) == 0 {
		return false
	}
	head := q.items[0]
	if k := head.row.OrderingKey; k == nil || *k == "" {
		return false
	}
	for _, it := range q.items {
		if it.replay {
			return false
		}
	}
	h := hb.holdOf(head)
	return h == nil || h.State == keyed.Resolved || h.State == keyed.Draining
}

// relieve spills the retrying keys with the most rows queued while the
// read-ahead bound (backoffReadAhead x MaxInFlight rows, those behind
// retrying heads included) is what stops the stream, until it no longer
// does or no key can be spilled.
func (hb *holdBook) relieve(ctx context.Context) {
	st := hb.st
	for st.s.cols.OrderingKey && !st.stopping && st.win.crowded() {
		var key string
		var most *keyQueue
		for k, q := range st.keys {
			if (most == nil || len(q.items) > len(most.items)) && hb.spillable(q) {
				key, most = k, q
			}
		}
		if most == nil || !hb.spill(ctx, key, most) {
			return
		}
	}
}

// retryHolds retries the retrying holds that are due, and arms the retry
// timer for the others.
func (hb *holdBook) retryHolds(ctx context.Context) {
	st := hb.st
	if st.stopping {
		return
	}
	now := time.Now()
	for key, h := range hb.m {
		if h.State == keyed.Draining && h.left == 0 && h.more && h.wantDrain {
			hb.drainFrom(ctx, key, h, drainNext) // its next batch waited for the stream's rows to be visible
			continue
		}
		if h.State == keyed.Draining || h.State == keyed.Resolved {
			continue
		}
		if h.State != keyed.Retrying {
			if h.unseen > 0 && h.wantDrain {
				hb.startDrain(ctx, key, h) // it waited for the stream's rows to be visible
			}
			continue
		}
		if h.Next(now) != keyed.Deliver {
			st.schedule(h.DueAt)
			continue
		}
		hb.startRetry(ctx, key, h)
		if st.fencedOut {
			return
		}
	}
}

// mergeDrained puts the rows a drain read into q in sequence order. The
// head of q stays first while it is in flight: its verdict settles q's
// first item (a skip while the held row's replay is in flight, or a drain
// restarted behind a streamed row of the key).
func mergeDrained(q *keyQueue, drained []*item) []*item {
	head := 0
	if q.Out() && len(q.items) > 0 {
		head = 1
	}
	rest := q.items[head:]
	out := make([]*item, 0, len(q.items)+len(drained))
	out = append(out, q.items[:head]...)
	i, j := 0, 0
	for i < len(rest) || j < len(drained) {
		if j == len(drained) || (i < len(rest) && rest[i].row.Sequence <= drained[j].row.Sequence) {
			out = append(out, rest[i])
			i++
			continue
		}
		out = append(out, drained[j])
		j++
	}
	return out
}

// release turns a drained hold into a tombstone.
func (hb *holdBook) release(ctx context.Context, key string, h *hold) {
	st := hb.st
	through := max(h.through, h.maxRead)
	var n int
	if ok, err := st.write(ctx, "release", st.s.q.Release, []any{&n}, key, h.Seq, through); err != nil || !ok {
		if err != nil {
			st.s.logger.Error("Could not release a hold; retrying at the next tick", err, nil)
		}
		return
	}
	h.State, h.through = keyed.Resolved, through
	st.s.logger.Trace("Release", watermill.LogFields{"key": key, "sequence": h.Seq, "through": through})
	hb.forget(ctx, key, h)
}

// forget deletes a tombstone once the confirmed position passed every copy
// of the rows it parks.
func (hb *holdBook) forget(ctx context.Context, key string, h *hold) {
	st := hb.st
	if h.Open() || h.untilLSN > st.confirmed {
		return
	}
	var n int
	if ok, err := st.write(ctx, "forget", st.s.q.Forget, []any{&n}, key, h.Seq); err != nil || !ok {
		if err != nil {
			st.s.logger.Error("Could not delete a hold's tombstone; retrying at the next tick", err, nil)
		}
		return
	}
	delete(hb.m, key)
}

// holdRow is one row of the holds table.
type holdRow struct {
	key                                 string
	seq, through                        int64
	draining, skipd, released, retrying bool
	until                               string
}

func (hb *holdBook) readHolds(ctx context.Context) ([]holdRow, error) {
	st := hb.st
	rows, err := st.s.pool.Query(ctx, st.s.q.Holds)
	if err != nil {
		return nil, fmt.Errorf("read the holds: %w", err)
	}
	defer rows.Close()
	var out []holdRow
	for rows.Next() {
		var r holdRow
		if err := rows.Scan(&r.key, &r.seq, &r.draining, &r.skipd, &r.through, &r.released, &r.until, &r.retrying); err != nil {
			return nil, fmt.Errorf("read the holds: %w", err)
		}
		out = append(out, r)
	}
	return out, rows.Err()
}

// loadHolds reads the holds table at the start of a session.
func (hb *holdBook) loadHolds(ctx context.Context) error {
	st := hb.st
	hb.m = map[string]*hold{}
	if !st.s.cols.OrderingKey {
		return nil
	}
	list, err := hb.readHolds(ctx)
	if err != nil {
		return err
	}
	for _, r := range list {
		h := &hold{Hold: keyed.Hold{Seq: r.seq, State: keyed.Dead}, through: r.through}
		if r.released {
			h.State = keyed.Resolved
		}
		if r.until != "" {
			if h.untilLSN, err = pglogrepl.ParseLSN(r.until); err != nil {
				return fmt.Errorf("read the holds: %w", err)
			}
		}
		// A hold that was draining drains again from the start (at the
		// first tick): until then its key's rows are parked. A retrying
		// hold is retried at once, from its held row (draining or not:
		// its held row's ack was not recorded).
		if r.retrying && !r.released {
			h.State, h.DueAt = keyed.Retrying, time.Now()
		}
		h.wantDrain = r.draining && !r.released && h.State != keyed.Retrying
		hb.m[r.key] = h
	}
	return nil
}

// tickHolds, at each status tick while keys are held, applies skips,
// restarts drains (a session that began with a draining hold, or a drain
// whose statements failed), retries releases and forgets tombstones the
// confirmed position passed.
func (hb *holdBook) tickHolds(ctx context.Context) {
	st := hb.st
	if len(hb.m) == 0 {
		return
	}
	list, err := hb.readHolds(ctx)
	if err != nil {
		st.s.logger.Error("Could not read the holds", err, nil)
		return
	}
	for _, r := range list {
		h := hb.m[r.key]
		if h == nil || h.Seq != r.seq {
			continue
		}
		switch {
		case h.State == keyed.Resolved:
			hb.forget(ctx, r.key, h)
		case h.State == keyed.Retrying && !r.skipd:
			if h.Next(time.Now()) == keyed.Deliver {
				hb.startRetry(ctx, r.key, h) // a retry whose statements failed before
			}
		case h.State != keyed.Draining && (r.skipd || r.draining || h.wantDrain):
			hb.startDrain(ctx, r.key, h)
		case h.State == keyed.Draining && h.left == 0:
			hb.drained(ctx, r.key, h) // a next batch or a release that failed before
		}
	}
}
