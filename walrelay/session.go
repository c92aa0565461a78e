package walrelay

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/outboxkit/watermill-outbox/internal/keyed"
	"github.com/outboxkit/watermill-outbox/internal/pgmeta"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/term"
	"github.com/outboxkit/watermill-outbox/schema"
)

// item is one row to deliver.
type item struct {
	row      sqlq.ClaimedRow
	key      string
	tx       *txn // nil for a row read from the table when a hold drains
	attempts int
	replay   bool   // streamed as the UPDATE of a replay
	lastErr  string // the last failure, redacted, while the item waits for its retry
	unseen   int    // how often its verdict waited for its transaction to be visible
}

// txn is one committed transaction: its end position and its rows not
// settled yet. pgoutput sends only committed transactions, and its BEGIN
// carries the commit time: a transaction's rows are queued as they are read
// (the stream's reading pauses at the in-flight bounds, readable), and the
// confirmed position passes the transaction once its COMMIT was read
// (committed) and its rows are settled. A transaction that may have been
// settled before a server restart (settledThrough) is buffered whole
// instead (buffered, items) and decided at its COMMIT by its end.
type txn struct {
	xid       uint32        // the transaction id (BEGIN): its rows are visible once it is (visible.go)
	final     pglogrepl.LSN // its commit record's position (BEGIN)
	end       pglogrepl.LSN
	commit    time.Time
	pending   int
	items     []*item
	buffered  bool
	committed bool
	rows      int  // rows read
	parked    bool // a row of it was parked behind a hold: confirmed only once it is visible (parkedUnseen)
	visible   bool // a snapshot showed it visible: the reads of its replayed rows wait no more
}

// settle is the verdict on a delivered message.
type settle struct {
	it      *item
	ack     bool
	err     error
	stopped bool // the relay stopped before a verdict: the row stays unsettled
}

// stream is one session on the slot.
type stream struct {
	s         *Subscriber
	conn      *pgconn.PgConn
	sendMu    sync.Mutex
	out       chan *message.Message
	rels      map[uint32]*relation
	cur       *txn
	txns      []*txn
	keys      map[string]*keyQueue
	confirmed pglogrepl.LSN
	idleEnd   pglogrepl.LSN // the server's position, when nothing was pending
	settles   chan settle
	gone      chan struct{}  // closed when the loop ends: verdicts are dropped
	term      *term.Term     // the session's term in the relay's ledger
	stopping  bool           // the session ends: no new deliveries
	retry     *keyed.Alarm   // rings at the earliest retry the engine asked for (schedule)
	inFlight  sync.WaitGroup // deliveries under way
	// horizon candidates (xid8 text, the WAL position after it), oldest
	// first; one becomes the horizon once the confirmed position passes it.
	candidates []candidate
	holds      *holdBook  // the keys' holds and their lifecycle (holds.go)
	hand       *handoff   // hands the deliveries to out and their verdicts back (handoff.go)
	vis        visibility // which transactions read are visible yet (visible.go)
	// keyed is the per-key engine (internal/keyed): one slot per key
	// with a message handed out and not settled, with the copies ended
	// sessions left in handlers, at most MaxInFlight however many keys
	// one transaction brings; keys ready beyond it wait in line, oldest
	// first; the earliest retry due arms the retry timer.
	keyed *keyed.Engine
	win   window // the rows read and not settled, against MaxInFlight
	// settledThrough: transactions ending at or before it were settled by
	// an earlier session (the slot moved back after a server restart).
	settledThrough pglogrepl.LSN
	// backfillIDs are the ids of the rows the session's backfill read,
	// until the confirmed position passes backfillUntil (the WAL position
	// after the read): their streamed inserts are not delivered again.
	backfillIDs   map[string]struct{}
	backfillUntil pglogrepl.LSN
	oid           uint32 // the outbox table's relation id
	// The session's write fence: its walsender's pid and the slot's fence
	// lock key (sqlq.WALQueries); fencedOut once a write was refused (the
	// session no longer holds the slot: it ends).
	pid         int64
	fenceKey    int64
	fencedOut   bool
	warnedOther bool // rows of another table were ignored
	// Caught up: the progress is recorded at once, not at the next tick.
	lastStatus time.Time     // when status last ran
	recorded   pglogrepl.LSN // the position status last recorded
	burst      burstState
	burstLSN   pglogrepl.LSN // with burstRecorded: the candidate that closes the burst
	prompt     *time.Timer   // a record put off by the rate limit
	promptSet  bool
}

// burstState follows the records after a burst of transactions: the first
// record after the burst takes a horizon candidate; the record that takes it
// as the horizon goes at once when the position passes it.
type burstState uint8

const (
	burstNone     burstState = iota
	burstRead                // a transaction was read since the last record
	burstRecorded            // recorded since; burstLSN closes the burst
)

type candidate struct {
	xid string
	lsn pglogrepl.LSN
}

// send hands a verdict to the loop, or drops it once the loop ended (the
// row stays unsettled; the next relay delivers it again).
func (st *stream) send(v settle) {
	select {
	case st.settles <- v:
	case <-st.gone:
	}
}

// received is one message of the stream, parsed by the reader goroutine:
// a keepalive, a logical replication message, or the error that ended the
// stream.
type received struct {
	ka  *pglogrepl.PrimaryKeepaliveMessage
	lm  pglogrepl.Message
	err error
}

// parse turns one backend message into a received.
func parse(raw pgproto3.BackendMessage) received {
	switch m := raw.(type) {
	case *pgproto3.ErrorResponse:
		return received{err: pgconn.ErrorResponseToPgError(m)}
	case *pgproto3.CopyData:
		if len(m.Data) == 0 {
			return received{}
		}
		switch m.Data[0] {
		case pglogrepl.PrimaryKeepaliveMessageByteID:
			ka, err := decodeKeepalive(m.Data[1:])
			return received{ka: ka, err: err}
		case pglogrepl.XLogDataByteID:
			// Bounds-checked (frame.go): a malformed frame is an error
			// that ends the session, never a panic.
			lm, err := decodeXLogData(m.Data[1:])
			return received{lm: lm, err: err}
		}
	}
	return received{}
}

func (s *Subscriber) stream(ctx context.Context, out chan *message.Message) error {
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	conn, err := pgconn.Connect(cctx, s.conn)
	cancel()
	if err != nil {
		return fmt.Errorf("connect for replication: %w", err)
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		pid := conn.PID()
		_ = conn.Close(cctx)
		s.waitSlotReleased(cctx, pid)
	}()
	if err := s.stillWAL(ctx, s.pool); err != nil {
		return err
	}
	if err := s.ensureSlot(ctx); err != nil {
		return err
	}
	err = pglogrepl.StartReplication(ctx, conn, s.cfg.Names.Slot, 0, pglogrepl.StartReplicationOptions{
		// Binary values: the server skips the text output functions of
		// uuid, int8, jsonb and timestamptz.
		PluginArgs: []string{"proto_version '1'", "publication_names '" + s.cfg.Names.Publication + "'", "binary 'true'"},
	})
	if err != nil {
		return fmt.Errorf("start replication on slot %s: %w", s.cfg.Names.Slot, err)
	}
	s.setActive(true)
	defer s.setActive(false)
	defer s.oldestUnsettled.Store(0)
	s.logger.Info("WAL relay active", nil)
	st := &stream{s: s, conn: conn, out: out, rels: map[uint32]*relation{}, keys: map[string]*keyQueue{},
		settles: make(chan settle, 1024), gone: make(chan struct{}),
		keyed: keyed.NewEngine(keyed.NewSlots(s.cfg.MaxInFlight, s.terms.Lingering)), vis: visibility{pool: s.pool, waits: &s.unseen}}
	st.holds, st.win = &holdBook{st: st}, window{limit: s.cfg.MaxInFlight}
	if err := s.pool.QueryRow(ctx, sqlq.WALTableOID, s.cfg.Table.Sanitize()).Scan(&st.oid); err != nil {
		return fmt.Errorf("look up the relation id of %s: %w", s.cfg.Table, err)
	}
	defer close(st.gone)
	// The session is a term of the relay's ledger; its context is the
	// deliveries' context, the backfill's included. Every return of the
	// stream ends the term (the contexts of its messages still in handlers
	// are cancelled: a term's end cancels its messages) and waits for the deliveries first (deferred
	// calls run in reverse): none outlives the stream, so none is handed to
	// out once it may be closed, and a copy the term's end left in a
	// handler holds its key back from the next sessions (one copy per key).
	st.term = s.terms.Begin(ctx, 0, s.sessions.Add(1))
	dctx := st.term.Context()
	defer st.stop()
	st.hand = newHandoff(st)
	go st.hand.pump()
	// The session's writes are fenced by its walsender (the fence
	// invariant, at the top of this file): it holds the slot now; every
	// write of an earlier session either committed before the holds are
	// read or finds another walsender on the slot and does nothing.
	st.pid, st.fenceKey = int64(conn.PID()), sqlq.WALFenceKey(s.cfg.Names.Slot)
	if _, err := s.pool.Exec(ctx, sqlq.WALFenceHandover, st.fenceKey); err != nil {
		return fmt.Errorf("wait for the writes of the slot's earlier sessions: %w", err)
	}
	backfill, err := st.start(ctx)
	if err != nil {
		return err
	}
	st.retry = keyed.NewAlarm()
	for _, h := range st.holds.m {
		if h.State == keyed.Retrying {
			st.schedule(h.DueAt) // a retrying hold of an earlier session: due at once
		}
	}
	if backfill != nil {
		st.commit(dctx, backfill)
	}
	return st.loop(ctx, dctx)
}

// ensureSlot recreates the slot when it is gone or the server invalidated
// it (max_slot_wal_keep_size); the stream then starts with a backfill
// from the table (start).
func (s *Subscriber) ensureSlot(ctx context.Context) error {
	var plugin, confirmed string
	var active, lost bool
	err := s.pool.QueryRow(ctx, sqlq.WALSlotState, s.cfg.Names.Slot).Scan(&plugin, &active, &confirmed, &lost)
	gone := errors.Is(err, pgx.ErrNoRows)
	if err != nil && !gone {
		return fmt.Errorf("look up replication slot %s: %w", s.cfg.Names.Slot, err)
	}
	if !gone && !lost {
		return nil
	}
	s.logger.Error("Replication slot lost: recreating it and reading the rows it missed from the table", nil,
		watermill.LogFields{"invalidated": lost, "dropped": gone})
	s.slotLost.Add(1)
	if lost {
		if _, err := s.pool.Exec(ctx, sqlq.WALDropSlot, s.cfg.Names.Slot); err != nil {
			return fmt.Errorf("drop the invalidated replication slot %s: %w", s.cfg.Names.Slot, err)
		}
	}
	// A switch away from the WAL relay (schema.SwitchMode) drops the slot:
	// recreate it only while the table is still the WAL relay's, under the
	// lock every switch holds, so that no switch commits in between.
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("recreate replication slot %s: %w", s.cfg.Names.Slot, err)
	}
	defer conn.Release()
	key := pgmeta.Migrate(s.cfg.Table.Qualified())
	if _, err := conn.Exec(ctx, `SELECT pg_advisory_lock($1)`, key); err != nil {
		return fmt.Errorf("recreate replication slot %s: lock: %w", s.cfg.Names.Slot, err)
	}
	defer func() {
		uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if _, err := conn.Exec(uctx, `SELECT pg_advisory_unlock($1)`, key); err != nil {
			_ = conn.Conn().Close(uctx) // ends the session, and its lock
		}
	}()
	if err := s.stillWAL(ctx, conn); err != nil {
		return err
	}
	var lsn string
	if err := conn.QueryRow(ctx, sqlq.WALCreateSlot, s.cfg.Names.Slot).Scan(&lsn); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "42710" { // duplicate_object: another relay recreated it
			return nil
		}
		return privilegeHint(err, "recreate replication slot "+s.cfg.Names.Slot)
	}
	return nil
}

// waitSlotReleased waits, until ctx ends, for the walsender pid of a
// closed replication connection to let go of the slot: the server ends it
// after the connection is closed, and until then the slot reads active, so
// a mode switch right after Close would be refused.
func (s *Subscriber) waitSlotReleased(ctx context.Context, pid uint32) {
	for {
		var held bool
		err := s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND active_pid = $2)`,
			s.cfg.Names.Slot, int64(pid)).Scan(&held)
		if err != nil || !held {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// errSwitchedAway is returned by a session that finds its table switched to
// another relay mode (schema.SwitchMode, `outbox migrate --mode=`): the
// relay stands by, streaming nothing, until the table is switched back.
var errSwitchedAway = errors.New("the table is switched to another relay mode")

// stillWAL fails with errSwitchedAway, naming the mode and who recorded
// it, when t's recorded mode is no longer wal. A table without a record is
// left to the checks of New.
func (s *Subscriber) stillWAL(ctx context.Context, q schema.Querier) error {
	rec, switched, err := sqlq.SwitchedAway(ctx, q, s.cfg.Table, schema.ModeWAL)
	if err != nil {
		return err
	}
	if switched {
		return fmt.Errorf("%w: %s is relayed in %s mode (recorded by %q at %s); this WAL relay streams nothing: close it, or switch the table back "+
			"(`outbox migrate --mode=wal`)", errSwitchedAway, s.cfg.Table, rec.Mode, rec.RecordedBy, rec.RecordedAt.Format(time.RFC3339))
	}
	return nil
}

// start reads where the slot and the progress record stand. A slot ahead
// of the recorded position was recreated (by this relay or another one
// that stopped before it finished), or was never read since Setup (which
// records the slot's start minus one: the rows written before Setup are
// not in the stream): the rows it never streamed are read from the table
// (sqlq.WALBackfill) and delivered first, as one transaction ending
// where the slot begins.
func (st *stream) start(ctx context.Context) (*txn, error) {
	s := st.s
	var slotText, recorded string
	if err := s.pool.QueryRow(ctx, s.q.Start, s.cfg.Names.Slot).Scan(&slotText, &recorded); err != nil {
		return nil, fmt.Errorf("read the position of slot %s: %w", s.cfg.Names.Slot, err)
	}
	slot, err := pglogrepl.ParseLSN(slotText)
	if err != nil {
		return nil, fmt.Errorf("slot %s position %q: %w", s.cfg.Names.Slot, slotText, err)
	}
	if err := st.holds.loadHolds(ctx); err != nil {
		return nil, err
	}
	st.confirmed = slot
	if recorded == "" {
		return nil, nil // first start after Setup
	}
	rec, err := pglogrepl.ParseLSN(recorded)
	if err != nil {
		return nil, fmt.Errorf("recorded position %q: %w", recorded, err)
	}
	if slot < rec {
		// The slot is behind the record: the server restarted before it
		// saved the slot's confirmed position (PostgreSQL saves it only
		// when the slot is dirty otherwise). Transactions that end at or
		// before rec were settled; their copies are not delivered again (a
		// skipped row among them would be, its tombstone forgotten).
		st.settledThrough = rec
		s.logger.Info("Slot behind the recorded position: the transactions up to it are settled already", watermill.LogFields{"slot": slot.String(), "recorded": rec.String()})
		return nil, nil
	}
	if slot == rec {
		return nil, nil
	}
	st.confirmed = rec
	// The slot Setup created, never read, is one ahead of Setup's record:
	// the rows written before Setup; otherwise the slot was recreated.
	beforeSetup := slot == rec+1
	var commitTS bool
	if err := s.pool.QueryRow(ctx, sqlq.WALCommitTimestamps).Scan(&commitTS); err != nil {
		return nil, fmt.Errorf("read track_commit_timestamp: %w", err)
	}
	items, err := st.readItems(ctx, sqlq.WALBackfill(s.cfg.Table, s.cols, beforeSetup, commitTS), s.cfg.Names.Slot)
	if err != nil {
		return nil, fmt.Errorf("read the rows the slot did not stream: %w", err)
	}
	// The rows read that the stream brings too (committed after the slot
	// began and before the read) are not delivered twice: their streamed
	// inserts, of transactions that committed before this position, are
	// settled without delivery (backfilledCopy).
	var untilText string
	if err := s.pool.QueryRow(ctx, s.q.InsertPosition).Scan(&untilText); err != nil {
		return nil, fmt.Errorf("read the WAL position after the backfill: %w", err)
	}
	if st.backfillUntil, err = pglogrepl.ParseLSN(untilText); err != nil {
		return nil, fmt.Errorf("WAL position %q: %w", untilText, err)
	}
	tx := &txn{end: slot, commit: time.Now(), items: items}
	st.backfillIDs = make(map[string]struct{}, len(items))
	for _, it := range items {
		it.tx = tx
		st.backfillIDs[it.row.ID] = struct{}{}
	}
	s.backfilled.Add(int64(len(tx.items)))
	why := "Backfill from the table after a lost slot"
	if beforeSetup {
		why = "Backfill from the table at the first start: rows written before Setup"
	}
	if !commitTS {
		s.logger.Debug("track_commit_timestamp is off: the backfill reads unkeyed rows in sequence order", nil)
	}
	s.logger.Info(why, watermill.LogFields{"rows": len(tx.items), "from": rec.String(), "slot_starts": slot.String()})
	return tx, nil
}

func (st *stream) loop(ctx, dctx context.Context) error {
	s := st.s
	// The reader outlives ctx until the loop returns (the final status must
	// still go out), then a read deadline in the past stops it. Its reads
	// take context.Background(): pgconn then skips watching a context for
	// every message, which cost a sixth of the reader's time.
	rctx, stopReading := context.WithCancel(context.WithoutCancel(ctx))
	readerDone := make(chan struct{})
	defer func() {
		stopReading()
		_ = st.conn.Conn().SetReadDeadline(time.Now())
		<-readerDone // before the connection is closed
	}()
	recv := make(chan received, 256)
	go func() { //nolint:gosec // G118: Background on purpose (above); the read deadline stops the reads
		defer close(readerDone)
		for {
			m, err := st.conn.ReceiveMessage(context.Background())
			r := received{err: err}
			if err == nil {
				r = parse(m)
			}
			select {
			case recv <- r:
			case <-rctx.Done():
				return
			}
			if r.err != nil {
				return
			}
		}
	}()
	tick := time.NewTicker(s.cfg.StatusInterval)
	defer tick.Stop()
	defer st.retry.Stop()
	st.prompt = time.NewTimer(time.Hour)
	st.prompt.Stop()
	defer st.prompt.Stop()
	for {
		if st.fencedOut {
			return errFenced
		}
		if !st.win.readable() && ctx.Err() == nil {
			st.holds.relieve(dctx) // spill retrying keys' backlogs, so that the stream is read on
		}
		var in chan received
		if st.win.readable() {
			in = recv
		}
		select {
		case <-ctx.Done():
			return st.drain(recv)
		case r := <-in:
			// What else is ready is taken without another full select
			// (its timers make it the loop's dearest step), a bounded
			// number at a time so that the timers are not starved.
			for n := 0; ; n++ {
				if err := st.onReceived(dctx, r); err != nil {
					return err
				}
				if n == loopBatch || !st.win.readable() {
					break
				}
				var ok bool
				if r, ok = tryReceive(recv); !ok {
					break
				}
			}
		case v := <-st.settles:
			for n := 0; ; n++ {
				st.onSettle(dctx, v)
				if n == loopBatch {
					break
				}
				var ok bool
				if v, ok = tryReceive(st.settles); !ok {
					break
				}
			}
			if err := st.caughtUp(); err != nil {
				return err
			}
		case <-st.retry.C():
			st.keyed.Woke()
			if ctx.Err() == nil { // closing: the drain comes next, nothing new goes out
				st.dispatchAll(dctx)
				st.holds.retryHolds(dctx)
			}
		case <-s.terms.Freed():
			// A copy an ended session left in a handler ended: its key
			// may go out again.
			if ctx.Err() == nil {
				st.dispatchAll(dctx)
			}
		case <-st.prompt.C:
			st.promptSet = false
			if err := st.caughtUp(); err != nil {
				return err
			}
		case <-tick.C:
			if st.vis.heldBackVisible(dctx, st.txns, st.s.logger) {
				st.confirmSettled()
			}
			if err := st.status(false); err != nil {
				return err
			}
			st.holds.tickHolds(dctx)
		}
	}
}

// loopBatch bounds the messages of one channel the loop handles per wake-up.
const loopBatch = 64

// replayReadTimeout bounds the wait of the read of a replayed row for the
// replay's transaction to be visible; past it the session ends and the
// next one reads the replay again.
const replayReadTimeout = 30 * time.Second

// tryReceive takes a value from c if one is ready.
func tryReceive[T any](c chan T) (T, bool) {
	select {
	case v := <-c:
		return v, true
	default:
		var zero T
		return zero, false
	}
}

// onReceived handles one message of the reader.
func (st *stream) onReceived(ctx context.Context, r received) error {
	if r.err != nil {
		return fmt.Errorf("read the replication stream: %w", r.err)
	}
	if err := st.handle(ctx, r); err != nil {
		return err
	}
	if r.ka != nil {
		return st.caughtUp()
	}
	return nil
}

// drain waits up to CloseTimeout for the messages in flight, confirms the
// position and returns. A transaction whose rows went out before its COMMIT
// was read is read on to its COMMIT (nothing new is handed out while
// draining): without it the position stopped before rows already acked,
// and the next relay delivered them again (TestWALHandover).
func (st *stream) drain(recv chan received) error {
	st.stopping = true
	deadline := time.After(st.s.cfg.CloseTimeout)
	for st.unsettledInFlight() > 0 || (st.cur != nil && !st.cur.buffered) {
		var in chan received
		if st.cur != nil && !st.cur.buffered {
			in = recv
		}
		select {
		case v := <-st.settles:
			st.onSettle(context.Background(), v)
		case r := <-in:
			if err := st.onReceived(context.Background(), r); err != nil {
				st.s.logger.Info("The stream ended while closing; the rows of its open transaction are left to the next relay", watermill.LogFields{"error": err.Error()})
				st.stop()
				return st.status(true)
			}
		case <-deadline:
			st.s.logger.Info("Close timeout: messages in flight are left to the next relay", watermill.LogFields{"in_flight": st.unsettledInFlight()})
			st.stop()
			return st.status(true)
		}
	}
	st.stop()
	return st.status(true)
}

// stop ends the session's term and waits for the deliveries, dropping the
// verdicts they still send: more of them than the settles buffer holds
// would block on it while the loop waits. A dropped verdict leaves its row
// unsettled (the next relay delivers it again); the position recorded does
// not pass it. The loop applies verdicts only before it calls stop: no
// verdict of an ended term is recorded (a verdict of an ended term is not progress). It is idempotent.
func (st *stream) stop() {
	st.term.End()
	done := make(chan struct{})
	go func() {
		st.inFlight.Wait()
		close(done)
	}()
	for {
		select {
		case <-done:
			return
		case <-st.settles:
		}
	}
}

func (st *stream) unsettledInFlight() int {
	n := 0
	for _, q := range st.keys {
		if q.Out() {
			n++
		}
	}
	return n
}

// position is the position the relay can confirm: the end of the settled
// prefix of transactions, or the server's position when nothing is pending.
func (st *stream) position() pglogrepl.LSN {
	pos := st.confirmed
	if st.cur == nil && len(st.txns) == 0 && st.idleEnd > pos {
		pos = st.idleEnd
	}
	return pos
}

// status records the progress and confirms the settled position to the
// server.
func (st *stream) status(final bool) error {
	pos := st.position()
	st.s.confirmed.Store(uint64(pos))
	st.lastStatus = time.Now()
	// The record goes first: the slot is never ahead of it unless it was
	// recreated (start relies on it).
	if !st.progress(pos) && !final {
		return nil // not recorded: the slot waits for the next tick
	}
	st.recorded = pos
	st.sendMu.Lock()
	err := pglogrepl.SendStandbyStatusUpdate(context.Background(), st.conn, pglogrepl.StandbyStatusUpdate{WALWritePosition: pos})
	st.sendMu.Unlock()
	if err != nil && !final {
		return fmt.Errorf("confirm position %s: %w", pos, err)
	}
	return nil
}

// progress records the confirmed position and the newest horizon it
// covers, and takes the next horizon candidate: one statement per status
// tick. A failure is logged; the horizon then waits for the next tick.
func (st *stream) progress(pos pglogrepl.LSN) bool {
	var horizon *string
	n := 0
	for n < len(st.candidates) && st.candidates[n].lsn <= pos {
		horizon = &st.candidates[n].xid
		n++
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var c candidate
	var lsn string
	ok, err := st.write(ctx, "progress", st.s.q.Progress, []any{&c.xid, &lsn}, st.s.cfg.Names.Slot, pos.String(), horizon)
	if err == nil && ok {
		c.lsn, err = pglogrepl.ParseLSN(lsn)
	}
	if err != nil {
		st.s.logger.Error("Could not record the WAL relay's progress; the cleaner waits", err, nil)
		return false
	}
	if !ok {
		return false // refused: the session ends
	}
	st.candidates = st.candidates[n:]
	if xmin, err := strconv.ParseUint(c.xid, 10, 64); err == nil {
		st.vis.pruneBefore(xmin) // older transactions are visible
	}
	kept := len(st.candidates) < maxCandidates
	if kept {
		st.candidates = append(st.candidates, c)
	}
	switch {
	case st.burst == burstRead && kept:
		st.burst, st.burstLSN = burstRecorded, c.lsn
	case st.burst == burstRead:
		// No candidate kept (a row retries and holds the horizon back):
		// nothing for a prompt record to close; the ticks go on.
		st.burst = burstNone
	case st.burst == burstRecorded && pos >= st.burstLSN:
		st.burst = burstNone // this record took the burst's candidate
	}
	return true
}

// recordSpacing: records other than the one that closes a burst are at
// least StatusInterval/recordSpacing apart.
const recordSpacing = 4

// caughtUp records the progress soon after the relay has settled everything
// it read, instead of at the next StatusInterval tick, so that the runbook
// and the cleaner see a burst settled as soon as it is. Two records close a
// burst: the first takes a horizon candidate; the second takes it as the
// horizon once the position has passed it (the server's keepalive tells,
// after it has sent the first record's own WAL) and goes at once. Other
// records wait for StatusInterval/4 after the last one: a steady trickle of
// small transactions costs one statement per StatusInterval/4, not one per
// transaction, and an idle relay records only at its ticks.
func (st *stream) caughtUp() error {
	if st.burst == burstNone || st.stopping || st.win.unsettled > 0 || st.cur != nil || len(st.txns) > 0 {
		return nil
	}
	pos := st.position()
	if pos <= st.recorded {
		return nil
	}
	closes := st.burst == burstRecorded && pos >= st.burstLSN
	if wait := st.s.cfg.StatusInterval/recordSpacing - time.Since(st.lastStatus); !closes && wait > 0 {
		// Put off, not dropped: the last record of a burst must come.
		if !st.promptSet {
			st.promptSet = true
			st.prompt.Reset(wait)
		}
		return nil
	}
	return st.status(false)
}

// maxCandidates bounds the horizon candidates kept while the confirmed
// position does not move (a row retrying): the oldest are kept, they pass
// first.
const maxCandidates = 120

func (st *stream) handle(ctx context.Context, r received) error {
	if ka := r.ka; ka != nil {
		if st.cur == nil && len(st.txns) == 0 {
			st.idleEnd = max(st.idleEnd, ka.ServerWALEnd)
		}
		if ka.ReplyRequested {
			return st.status(false)
		}
		return nil
	}
	if r.lm == nil {
		return nil
	}
	return st.decode(ctx, r.lm)
}

// errFenced ends a session whose write the fence refused: another
// walsender holds the slot (or none does), so the session has ended on the
// server.
var errFenced = errors.New("walrelay: the session no longer holds the slot")

// write runs one of the session's fenced writes (sqlq.WALQueries): sql
// with args and the fence's arguments (the slot, the session's walsender
// pid, the slot's fence key), its columns scanned into dest and the last
// one into ok. A write the fence refused (ok false) changed nothing: it is
// counted (outbox_fence_rejected_total{op}), logged, not retried, and the
// session ends (fencedOut).
func (st *stream) write(ctx context.Context, op, sql string, dest []any, args ...any) (bool, error) {
	s := st.s
	args = append(args, s.cfg.Names.Slot, st.pid, st.fenceKey)
	var ok bool
	dest = append(dest, &ok)
	if hook := s.hooks.fence; hook != nil {
		hook(op, "before")
		// Tests: a transaction, so that the hook runs between the
		// statement (its check passed or not) and the commit.
		tx, err := s.pool.Begin(ctx)
		if err != nil {
			return false, err
		}
		if err := tx.QueryRow(ctx, sql, args...).Scan(dest...); err != nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
			return false, err
		}
		hook(op, "checked")
		if err := tx.Commit(ctx); err != nil {
			return false, err
		}
	} else if err := s.pool.QueryRow(ctx, sql, args...).Scan(dest...); err != nil {
		return false, err
	}
	if !ok {
		st.fencedOut = true
		if m := s.cfg.Metrics; m != nil {
			m.FenceRejected.WithLabelValues(s.cfg.Table.Qualified(), op).Inc()
		}
		s.logger.Info("A write of a session that no longer holds the slot was refused; the session ends", watermill.LogFields{"op": op})
	}
	return ok, nil
}

// confirmSettled moves the confirmed position over the settled prefix of
// transactions.
func (st *stream) confirmSettled() {
	n := 0
	for n < len(st.txns) && st.txns[n].committed && st.txns[n].pending == 0 && !st.vis.holdsBack(st.txns[n]) {
		st.confirmed = max(st.confirmed, st.txns[n].end)
		n++
	}
	if n > 0 {
		st.txns = append(st.txns[:0], st.txns[n:]...)
	}
	if st.backfillIDs != nil && st.confirmed >= st.backfillUntil {
		st.backfillIDs = nil // the stream is past every copy
	}
	st.markOldest()
}

// markOldest publishes the commit time of the oldest unsettled
// transaction for SlotLag.
func (st *stream) markOldest() {
	if len(st.txns) == 0 {
		st.s.oldestUnsettled.Store(0)
		return
	}
	st.s.oldestUnsettled.Store(st.txns[0].commit.UnixNano())
}
