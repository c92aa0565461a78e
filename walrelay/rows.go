package walrelay

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/outboxkit/watermill-outbox/internal/keyed"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/schema"
)

func (st *stream) decode(ctx context.Context, lm pglogrepl.Message) error {
	switch m := lm.(type) {
	case *pglogrepl.RelationMessage:
		st.rels[m.RelationID] = newRelation(m)
	case *pglogrepl.BeginMessage:
		st.cur = &txn{commit: m.CommitTime, xid: m.Xid, final: m.FinalLSN}
		if st.settledThrough != 0 && m.FinalLSN <= st.settledThrough {
			// Perhaps settled before the server restarted: its end, read
			// at its COMMIT, tells.
			st.cur.buffered = true
		} else {
			st.txns = append(st.txns, st.cur)
			st.markOldest()
		}
	case *pglogrepl.InsertMessage:
		return st.row(ctx, m.RelationID, m.Tuple, false)
	case *pglogrepl.UpdateMessage:
		return st.row(ctx, m.RelationID, m.NewTuple, true)
	case *pglogrepl.CommitMessage:
		tx := st.cur
		st.cur = nil
		if tx == nil {
			return nil
		}
		tx.end, tx.commit = m.TransactionEndLSN, m.CommitTime
		if tx.buffered && tx.end <= st.settledThrough {
			tx.items = nil // settled before the restart
			tx.rows = 0
		}
		if tx.rows > 0 {
			// Only a transaction with rows opens a burst: before
			// PostgreSQL 15, pgoutput also sends the empty transactions,
			// among them the relay's own progress records, which would
			// otherwise keep prompting records.
			st.burst = burstRead
		}
		if tx.buffered {
			st.commit(ctx, tx)
			return nil
		}
		tx.committed = true
		st.confirmSettled()
	}
	return nil
}

// queue queues a row of the transaction being read behind its key and
// dispatches the key; the row of a held key is parked (settled without
// delivery).
func (st *stream) queue(ctx context.Context, it *item) {
	if st.holds.parks(it) {
		it.tx.parked = true
		if it.replay {
			h := st.holds.holdOf(it)
			st.s.logger.Trace("Replay parked behind the key's hold", watermill.LogFields{"key": *it.row.OrderingKey, "sequence": it.row.Sequence,
				"hold": h.Seq, "state": h.State.String(), "through": h.through, "max_read": h.maxRead, "more": h.more})
		}
		return
	}
	if st.backfilledCopy(it) {
		return
	}
	st.replayed(it)
	it.tx.pending++
	st.win.unsettled++
	st.peakRows()
	q := st.keys[it.key]
	if q == nil {
		q = &keyQueue{}
		st.keys[it.key] = q
	}
	q.items = append(q.items, it)
	if q.backoff {
		st.win.behind++
		if len(q.items) > st.s.cfg.MaxInFlight && st.holds.spill(ctx, it.key, q) {
			return
		}
	}
	st.dispatch(ctx, it.key)
}

// backfilledCopy reports whether a streamed row is the insert of a row
// the session's backfill read from the table (it committed after the slot
// began and before the read): settled without delivery, the backfill
// delivers it.
func (st *stream) backfilledCopy(it *item) bool {
	if st.backfillIDs == nil || it.replay || it.tx.final >= st.backfillUntil {
		return false
	}
	_, ok := st.backfillIDs[it.row.ID]
	return ok
}

// replayed: an operator's replay of the held row of a retrying hold is
// delivered now, as the replay of a dead held row is; the hold no longer
// retries on its own (its drain follows the replay's ack).
func (st *stream) replayed(it *item) {
	if h := st.holds.holdOf(it); h != nil && h.State == keyed.Retrying && it.replay && it.row.Sequence == h.Seq {
		h.State = keyed.Replayed
	}
}

// peakRows records the most rows the session held read and not settled
// (buffered transactions included), for the tests.
func (st *stream) peakRows() {
	n := int64(st.win.unsettled + st.win.fromTable)
	if st.cur != nil && st.cur.buffered {
		n += int64(len(st.cur.items))
	}
	if n > st.s.peakRows.Load() {
		st.s.peakRows.Store(n)
	}
}

// commit queues the rows of a committed transaction read whole (a
// backfill, or a transaction buffered after a server restart) behind their
// keys; the rows of a held key are parked (settled without delivery).
func (st *stream) commit(ctx context.Context, tx *txn) {
	tx.committed = true
	kept := tx.items[:0]
	for _, it := range tx.items {
		if !st.holds.parks(it) {
			st.replayed(it)
			kept = append(kept, it)
		}
	}
	tx.items = kept
	tx.pending = len(tx.items)
	if tx.pending == 0 {
		if len(st.txns) == 0 {
			st.confirmed = max(st.confirmed, tx.end)
		} else {
			st.txns = append(st.txns, tx)
		}
		return
	}
	st.txns = append(st.txns, tx)
	st.win.unsettled += tx.pending
	st.peakRows()
	for _, it := range tx.items {
		q := st.keys[it.key]
		if q == nil {
			q = &keyQueue{}
			st.keys[it.key] = q
		}
		q.items = append(q.items, it)
		if q.backoff {
			st.win.behind++ // every item here is streamed (it.tx != nil)
		}
	}
	st.markOldest()
	// Only the keys of this transaction can have become deliverable.
	for _, it := range tx.items {
		st.dispatch(ctx, it.key)
	}
	tx.items = nil
}

// keyOf is the ordering of a row: its ordering key, else its topic.
func keyOf(r sqlq.ClaimedRow) string {
	if r.OrderingKey != nil && *r.OrderingKey != "" {
		return "k:" + *r.OrderingKey
	}
	return "t:" + r.Topic
}

// relation is a table's columns as the stream describes them, with the
// position of each column the relay reads (-1: the table has none).
type relation struct {
	*pglogrepl.RelationMessage
	id, eventID, tenantID, topic, payload, sequence, traceParent, traceState,
	headers, orderingKey, publishedAt, deadAt, lockedAt, attempts, skippedAt int
}

func newRelation(m *pglogrepl.RelationMessage) *relation {
	r := &relation{RelationMessage: m}
	for _, f := range []struct {
		name string
		pos  *int
	}{
		{"id", &r.id}, {"event_id", &r.eventID}, {"tenant_id", &r.tenantID}, {"topic", &r.topic}, {"payload", &r.payload},
		{"sequence", &r.sequence}, {"traceparent", &r.traceParent}, {"tracestate", &r.traceState}, {"headers", &r.headers},
		{"ordering_key", &r.orderingKey}, {"published_at", &r.publishedAt}, {"dead_at", &r.deadAt}, {"locked_at", &r.lockedAt},
		{"attempts", &r.attempts}, {"skipped_at", &r.skippedAt},
	} {
		*f.pos = -1
		for i, c := range m.Columns {
			if c.Name == f.name {
				*f.pos = i
				break
			}
		}
	}
	return r
}

// text is the text of column i of tuple; ok is false when the table has no
// such column, the value is NULL or unchanged (an UPDATE that left it in
// TOAST).
func (r *relation) text(tuple *pglogrepl.TupleData, i int) (v string, ok bool, err error) {
	if i < 0 || i >= len(tuple.Columns) || i >= len(r.Columns) {
		return "", false, nil
	}
	c := tuple.Columns[i]
	switch c.DataType {
	case 't':
		return string(c.Data), true, nil
	case 'b':
		v, err := binaryText(r.Columns[i].DataType, c.Data)
		if err != nil {
			return "", false, fmt.Errorf("walrelay: column %s: %w", r.Columns[i].Name, err)
		}
		return v, true, nil
	}
	return "", false, nil
}

// value is text as a pointer: nil when it is not ok.
func (r *relation) value(tuple *pglogrepl.TupleData, i int) (*string, error) {
	v, ok, err := r.text(tuple, i)
	if !ok {
		return nil, err
	}
	return &v, nil
}

// int is column i of tuple as an integer, read from the binary form of an
// int8 or int4 without a detour through text.
func (r *relation) int(tuple *pglogrepl.TupleData, i int) (int64, error) {
	if i >= 0 && i < len(tuple.Columns) && i < len(r.Columns) {
		if c := tuple.Columns[i]; c.DataType == 'b' {
			switch {
			case r.Columns[i].DataType == 20 && len(c.Data) == 8: // int8
				return int64(binary.BigEndian.Uint64(c.Data)), nil //nolint:gosec // a bit pattern
			case r.Columns[i].DataType == 23 && len(c.Data) == 4: // int4
				return int64(int32(binary.BigEndian.Uint32(c.Data))), nil //nolint:gosec // a bit pattern
			}
		}
	}
	v, _, err := r.text(tuple, i)
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(v, 10, 64)
}

// bytes is the text of column i of tuple as a new byte slice (nil as for
// value): the payload goes to the message as it is read, in one copy.
func (r *relation) bytes(tuple *pglogrepl.TupleData, i int) ([]byte, error) {
	if i >= 0 && i < len(tuple.Columns) && i < len(r.Columns) {
		c := tuple.Columns[i]
		switch {
		case c.DataType == 't':
			return bytes.Clone(c.Data), nil
		case c.DataType == 'b' && r.Columns[i].DataType == 3802 && len(c.Data) > 0 && c.Data[0] == 1: // jsonb, version 1
			return bytes.Clone(c.Data[1:]), nil
		}
	}
	v, err := r.value(tuple, i)
	if v == nil {
		return nil, err
	}
	return []byte(*v), err
}

// row turns an INSERT (or the UPDATE of a replay) into an item of the
// current transaction. It reads only the columns a message needs.
func (st *stream) row(ctx context.Context, rel uint32, tuple *pglogrepl.TupleData, update bool) error {
	if rel != st.oid {
		// Another table of the publication (New refuses such a
		// publication; a table added later is ignored, with a warning).
		if !st.warnedOther {
			st.warnedOther = true
			st.s.logger.Error("The publication streams rows of another table; ignoring them (give the outbox table a publication of its own)", nil,
				watermill.LogFields{"relation": rel})
		}
		return nil
	}
	r := st.rels[rel]
	if r == nil || tuple == nil || st.cur == nil {
		return fmt.Errorf("walrelay: row of an unknown relation %d", rel)
	}
	var err error
	get := func(i int) *string {
		v, verr := r.value(tuple, i)
		if verr != nil && err == nil {
			err = verr
		}
		return v
	}
	str := func(i int) string {
		v, _, verr := r.text(tuple, i)
		if verr != nil && err == nil {
			err = verr
		}
		return v
	}
	replay := false
	fromTable := false
	if update {
		replay = true
		// Only a replay's reset is delivered: not published, not dead,
		// not skipped, attempts 0, no lease. The relay's own UPDATE (a dead
		// or skipped row) is not.
		if get(r.publishedAt) != nil || get(r.deadAt) != nil || get(r.lockedAt) != nil || get(r.skippedAt) != nil || str(r.attempts) != "0" {
			return err
		}
		for _, c := range tuple.Columns {
			fromTable = fromTable || c.DataType == 'u'
		}
		// A keyed row's replay is delivered as the table has the row now
		// (readsReplay): an operator may have skipped it since.
		fromTable = fromTable || readsReplay(st.s.cols, get(r.orderingKey))
	}
	var row sqlq.ClaimedRow
	if update && fromTable {
		// The payload was not in the UPDATE, or the replay is of a keyed
		// row: read the row.
		id := str(r.id)
		if err != nil {
			return err
		}
		// The read must see the replay, not the row before it.
		if !st.cur.visible {
			wctx, cancel := context.WithTimeout(ctx, replayReadTimeout)
			err = st.vis.waitVisible(wctx, st.cur.xid)
			cancel()
			if err != nil {
				return err
			}
			st.cur.visible = true
		}
		if serr := row.Scan(st.s.pool.QueryRow(ctx, st.s.q.Row, id), st.s.cols); serr != nil {
			st.s.logger.Info("Replayed row not found, or skipped since; not delivered", watermill.LogFields{"sequence": str(r.sequence)})
			return nil //nolint:nilerr // the row was deleted, published, dead again or skipped since
		}
	} else {
		row = sqlq.ClaimedRow{ID: str(r.id), EventID: str(r.eventID), TenantID: str(r.tenantID), Topic: str(r.topic),
			TraceParent: get(r.traceParent), TraceState: get(r.traceState), Headers: get(r.headers)}
		if err != nil {
			return err
		}
		if row.Payload, err = r.bytes(tuple, r.payload); err != nil {
			return err
		}
		if row.Sequence, err = r.int(tuple, r.sequence); err != nil {
			return fmt.Errorf("walrelay: row without a sequence in relation %s: %w", r.RelationName, err)
		}
	}
	row.OrderingKey = get(r.orderingKey)
	if err != nil {
		return err
	}
	it := &item{row: row, key: keyOf(row), tx: st.cur, replay: replay}
	st.vis.saw(st.cur.xid)
	st.cur.rows++
	if st.cur.buffered {
		st.cur.items = append(st.cur.items, it)
		st.peakRows()
		return nil
	}
	st.queue(ctx, it)
	return nil
}

// readsReplay reports whether the replay of a row with ordering key key,
// in a table with columns cols, is read from the table before it is delivered: every replay of a keyed
// row. The UPDATE the stream carries is the replay as it committed; an
// operator may have skipped the row since (a skip of the replay applied
// while the stream was behind it, or the skip of a dead row that holds no
// key), or the row may be dead again (the stream carries an old replay
// again after a session's end). A row with skipped_at set is never
// delivered by the stream: the read (sqlq.WALQueries.Row) finds only a
// row still reset, and the replay is dropped otherwise. Unkeyed rows are
// never skipped, and their replays are delivered from the UPDATE.
func readsReplay(cols schema.Columns, key *string) bool {
	return cols.OrderingKey && key != nil && *key != ""
}

// readItems reads rows from the table (the columns of ClaimedRow.Scan,
// then ordering_key) as items without a transaction.
func (st *stream) readItems(ctx context.Context, sql string, args ...any) ([]*item, error) {
	rows, err := st.s.pool.Query(ctx, sql, args...)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (*item, error) {
		var r sqlq.ClaimedRow
		err := r.ScanKeyed(row, st.s.cols)
		return &item{row: r, key: keyOf(r)}, err
	})
}

// binaryText renders a binary-format value of type oid as the text the
// row needs. Timestamps are not used by the message and render as "".
func binaryText(oid uint32, b []byte) (string, error) {
	switch oid {
	case 25, 1043, 19: // text, varchar, name
		return string(b), nil
	case 2950: // uuid
		if len(b) != 16 {
			return "", fmt.Errorf("uuid of %d bytes", len(b))
		}
		u, _ := uuid.FromBytes(b)
		return u.String(), nil
	case 20: // int8
		if len(b) != 8 {
			return "", fmt.Errorf("int8 of %d bytes", len(b))
		}
		return strconv.FormatInt(int64(binary.BigEndian.Uint64(b)), 10), nil //nolint:gosec // a bit pattern
	case 23: // int4
		if len(b) != 4 {
			return "", fmt.Errorf("int4 of %d bytes", len(b))
		}
		return strconv.FormatInt(int64(int32(binary.BigEndian.Uint32(b))), 10), nil //nolint:gosec // a bit pattern
	case 3802: // jsonb: version byte 1, then the text
		if len(b) == 0 || b[0] != 1 {
			return "", errors.New("jsonb of an unknown binary version")
		}
		return string(b[1:]), nil
	case 1184, 1114: // timestamptz, timestamp: set or not is all the relay reads
		return "", nil
	}
	return "", fmt.Errorf("type oid %d in binary form is not read by the WAL relay", oid)
}
