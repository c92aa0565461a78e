package runbook

import (
	"context"
	"crypto/md5" //nolint:gosec // the snapshot's digest is the SQL's md5 of a row set, not a secret
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/schema"
)

// Reasons a row cannot be replayed; a *NotReplayableError wraps one of them,
// so test them with errors.Is.
var (
	// ErrEventNotFound: no row of the table has the event_id.
	ErrEventNotFound = errors.New("event not found")
	// ErrAlreadyPublished: the row was acked; there is nothing to replay.
	ErrAlreadyPublished = errors.New("event already published")
	// ErrNotFailed: the row is pending, not dead and without last_error;
	// the relay delivers it when it is due.
	ErrNotFailed = errors.New("event is pending and has not failed")
	// ErrLocked: a relay leased the row less than the lock TTL ago and may
	// be delivering it right now.
	ErrLocked = errors.New("event is leased by a relay")
)

// ErrReplaySetChanged is returned (wrapped) by ReplayDead given an Expect
// snapshot when the dead rows matching the filter are no longer the rows the
// preview counted (one was replayed, deleted or leased meanwhile, or an older
// one went dead). Nothing was changed: preview again.
var ErrReplaySetChanged = errors.New("the dead rows changed since the preview")

// ReplaySnapshot identifies the rows a bulk replay preview counted: how many,
// the greatest sequence among them, and a digest of their sequences.
type ReplaySnapshot struct {
	// Rows is the number of rows previewed.
	Rows int64 `json:"rows"`
	// MaxSequence is the greatest sequence previewed (0 when none); the
	// replay leaves alone rows that went dead later with a higher one.
	MaxSequence int64 `json:"max_sequence"`
	// Digest is the md5 of the previewed sequences, in order ("" when
	// none).
	Digest string `json:"digest"`
}

// ErrNoReplayFilter is returned (wrapped) by ReplayDead when the filter has
// neither a Topic nor AllTopics: a bulk replay of every dead row is never
// the default.
var ErrNoReplayFilter = errors.New("bulk replay needs a topic or an explicit all-topics flag")

// NotReplayableError says why ReplayEvent refused a row. Nothing was
// changed. It unwraps to one of ErrEventNotFound, ErrAlreadyPublished,
// ErrNotFailed and ErrLocked.
type NotReplayableError struct {
	// Table is the table, as given.
	Table string
	// EventID is the event asked for.
	EventID uuid.UUID
	// Reason is one of the sentinel errors above.
	Reason error
	// Row is the row as found, or nil when it was not found.
	Row *Row
	// LockTTL is the lease duration the row was judged with.
	LockTTL time.Duration
}

// Error says why the row was refused and what to do instead.
func (e *NotReplayableError) Error() string {
	head := fmt.Sprintf("cannot replay event %s of %s", e.EventID, e.Table)
	var why string
	switch {
	case errors.Is(e.Reason, ErrEventNotFound) || e.Row == nil:
		why = "no row has this event_id; check the table name and the event_id"
	case errors.Is(e.Reason, ErrAlreadyPublished) && e.Row.PublishedAt != nil:
		why = fmt.Sprintf("it was already published at %s; replay only re-delivers dead or failed rows",
			e.Row.PublishedAt.UTC().Format(time.RFC3339))
	case errors.Is(e.Reason, ErrNotFailed) && e.Row.AvailableAt != nil:
		why = fmt.Sprintf("it is pending (%d attempts, no last_error), neither dead nor failed; the relay delivers it when it is due (available_at %s)",
			e.Row.Attempts, e.Row.AvailableAt.UTC().Format(time.RFC3339))
	case errors.Is(e.Reason, ErrLocked) && e.Row.LockedAt != nil:
		why = fmt.Sprintf("a relay leased it at %s and may be delivering it now; wait until the lease (lock TTL %s) has ended and look again",
			e.Row.LockedAt.UTC().Format(time.RFC3339), e.LockTTL)
	default:
		why = e.Reason.Error()
	}
	return head + ": " + why + "; nothing changed"
}

// Unwrap returns Reason.
func (e *NotReplayableError) Unwrap() error { return e.Reason }

// ReplayOptions configures ReplayEvent.
type ReplayOptions struct {
	// LockTTL is a lower bound on the relays' lease duration: a row leased
	// less than the larger of LockTTL and the LockTTL the table relays
	// recorded (schema.ModeRecord.LockTTL) ago is refused with ErrLocked.
	// 0 judges by the recorded one alone (60s, the relays' default, when
	// none is recorded).
	LockTTL time.Duration
	// DryRun checks the row and returns the statement without changing
	// anything.
	DryRun bool
}

// EventReplay reports a ReplayEvent.
type EventReplay struct {
	// Table is the table, as given.
	Table string `json:"table"`
	// Row is the row as it was before the replay.
	Row Row `json:"row"`
	// Dead is true when the row was dead (dead_at set), false when it was
	// failed and still being retried.
	Dead bool `json:"dead"`
	// Statement is the UPDATE that resets the row.
	Statement Statement `json:"-"`
	// Changed is the number of rows changed: 1, or 0 for a dry run.
	Changed int64 `json:"changed"`
	// DryRun is true when nothing was changed on purpose.
	DryRun bool `json:"dry_run"`
}

// ReplayEvent resets the row of the table whose event_id is eventID so that
// the relay delivers it again (dead_at = NULL, attempts = 0, available_at =
// now(), locked_at = NULL, last_error = NULL), and wakes the table's relays.
// It acts only on a row that is dead, failed or skipped (published_at IS
// NULL AND (dead_at IS NOT NULL OR last_error IS NOT NULL OR skipped_at IS
// NOT NULL)) and not leased by a relay right now (leaseTTL: judged by the
// LockTTL the table relays recorded, or opts.LockTTL when larger), and clears skipped_at: the
// row is pending again, and a later skip sets it aside again
// (docs/OPERATIONS.md, "The row's states"); any other row is refused with
// a *NotReplayableError and left as it is. In an ordered table a keyed row
// already relayed (delivered or skipped) becomes a replay hold. A row that holds its ordering key (ordered mode or the WAL relay)
// is replayed only when its hold's state allows it (HoldState.Allows: not
// while a skip is requested, a replay is pending or the hold drains);
// otherwise the error is a *HoldRuleError (ErrHoldRefused) and nothing
// changes. With opts.DryRun it checks the row the same way and changes
// nothing.
func (r *Runbook) ReplayEvent(ctx context.Context, eventID uuid.UUID, opts ReplayOptions) (EventReplay, error) {
	if err := r.check(); err != nil {
		return EventReplay{}, err
	}
	db, t := r.db, r.table
	if eventID == uuid.Nil {
		return EventReplay{}, errors.New("runbook: replay: the event_id is the nil UUID; pass the event_id of the row to replay")
	}
	if opts.LockTTL < 0 {
		return EventReplay{}, fmt.Errorf("runbook: lock TTL %s is negative; pass 0 to judge leases by the relays' recorded LockTTL", opts.LockTTL)
	}
	rd, err := readerOf(ctx, db, t)
	if err != nil {
		return EventReplay{}, err
	}
	return replayEvent(ctx, db, rd.StateQueries, eventID, leaseTTL(rd, opts.LockTTL), opts.DryRun)
}

// replayEvent is ReplayEvent on the table of the state reader sq: the one
// rule of a replay in each mode, which ReplayDead applies to each row of
// an ordered table too. A dry run refuses what the replay would refuse.
func replayEvent(ctx context.Context, db DB, sq sqlq.StateQueries, eventID uuid.UUID, lockTTL time.Duration, dryRun bool) (EventReplay, error) {
	t := sq.Table
	q := sqlq.NewRunbookQueries(t)
	id := eventID.String()

	// In an ordered table, a keyed row that failed is recorded as its key's
	// hold (docs/ORDERING.md).
	if sq.Mode == schema.ModeOrdered {
		oq := sqlq.NewOrderedQueries(t, sq.Columns)
		if held, ok, err := replayHeld(ctx, db, oq, eventID, lockTTL, dryRun); ok || err != nil {
			return held, err
		}
		if keyed, ok, err := replayKeyed(ctx, db, oq, eventID, lockTTL, dryRun); ok || err != nil {
			return keyed, err
		}
	}
	// In a WAL table, the hold of a keyed row's key decides, by the one
	// rule of every replay path (walReplayRule), and the statement keeps
	// it while it resets the row.
	wal := walKeyed(sq)
	if wal {
		if err := walReplayRefused(ctx, db, t, eventID); err != nil {
			return EventReplay{}, err
		}
	}
	// A table with skipped_at records a skip in the row (every mode): a
	// skipped row can be replayed, and its replay clears skipped_at.
	skippable := wal
	if !wal {
		var err error
		if skippable, err = hasSkippedAt(ctx, db, t); err != nil {
			return EventReplay{}, err
		}
	}
	res, err := inspectEvent(ctx, db, q, eventID, lockTTL, skippable)
	if err != nil {
		return EventReplay{}, err
	}
	switch {
	case wal:
		res.Statement = Statement(sqlq.WALReplayEvent(walReplayGuard(t), id, lockTTL))
	case skippable:
		res.Statement = Statement(q.ReplayEventSkipped(id, lockTTL))
	default:
		res.Statement = Statement(q.ReplayEvent(id, lockTTL))
	}
	if dryRun {
		res.DryRun = true
		return res, nil
	}
	var seq int64
	err = db.QueryRow(ctx, res.Statement.SQL, res.Statement.Args...).Scan(&seq)
	if errors.Is(err, pgx.ErrNoRows) {
		// The row changed between the look-up and the update: say how.
		if _, again := inspectEvent(ctx, db, q, eventID, lockTTL, skippable); again != nil {
			return EventReplay{}, again
		}
		if wal {
			return EventReplay{}, movedOn(ctx, db, t, eventID, OpReplay)
		}
		return EventReplay{}, fmt.Errorf("runbook: replay event %s of %s: the row changed while it was being replayed; nothing changed, look at it again and retry", eventID, t)
	}
	if err != nil {
		return EventReplay{}, dbError(t, "replay event "+id+" of", err)
	}
	res.Changed = 1
	wake(ctx, db, q)
	return res, nil
}

// inspectEvent looks the row up and returns a *NotReplayableError unless it
// can be replayed. keyed: the table has skipped_at (a skip is recorded in
// the row), and a skipped row can be replayed, whether or not it failed.
func inspectEvent(ctx context.Context, db DB, q sqlq.RunbookQueries, eventID uuid.UUID, lockTTL time.Duration, keyed bool) (EventReplay, error) {
	st := q.Event(eventID.String(), lockTTL)
	var dead, leased bool
	row, err := scanRow(db.QueryRow(ctx, st.SQL, st.Args...), &dead, &leased)
	refuse := func(reason error, r *Row) (EventReplay, error) {
		return EventReplay{}, &NotReplayableError{Table: q.Table.String(), EventID: eventID, Reason: reason, Row: r, LockTTL: lockTTL}
	}
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return refuse(ErrEventNotFound, nil)
	case err != nil:
		return EventReplay{}, dbError(q.Table, "look up event "+eventID.String()+" in", err)
	case row.PublishedAt != nil:
		return refuse(ErrAlreadyPublished, &row)
	case !dead && row.LastError == nil && !skippedRow(ctx, db, q.Table, eventID, keyed):
		return refuse(ErrNotFailed, &row)
	case leased:
		return refuse(ErrLocked, &row)
	}
	return EventReplay{Table: q.Table.String(), Row: row, Dead: dead}, nil
}

// skippedRow reports whether the row eventID of the table t was skipped
// (skipped_at); false for a table without the column (keyed false)
// or when it cannot tell (the replay statement checks again).
func skippedRow(ctx context.Context, db DB, t schema.Table, eventID uuid.UUID, keyed bool) bool {
	if !keyed {
		return false
	}
	var skipped bool
	err := db.QueryRow(ctx, sqlq.Skipped(t), eventID.String()).Scan(&skipped)
	return err == nil && skipped
}

// walReplayRefused returns the refusal of walReplayRule for the row of
// the WAL table t whose event_id is eventID, given the hold of its key;
// nil when the rule allows the replay (or the key holds nothing).
func walReplayRefused(ctx context.Context, db DB, t schema.Table, eventID uuid.UUID) error {
	var (
		key, word string
		seq       int64
		held      bool
	)
	err := db.QueryRow(ctx, sqlq.WALHoldOfKeyOfEvent(t), eventID.String()).Scan(&key, &seq, &word, &held)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil
	}
	if err != nil {
		return dbError(t, "look up the hold of the key of event "+eventID.String()+" in", err)
	}
	s, err := parseHoldState(word)
	if err != nil {
		return err
	}
	if err := walReplayRule(s, held); err != nil {
		return refusal(OpReplay, eventID, t, err)
	}
	return nil
}

// wake notifies the table's relays that rows are due. A failure is ignored:
// the rows are already due and the relays find them at their next poll.
func wake(ctx context.Context, db DB, q sqlq.RunbookQueries) {
	st := q.Wake()
	_, _ = db.Exec(ctx, st.SQL, st.Args...)
}

// BulkReplay reports a ReplayDead.
type BulkReplay struct {
	// Table is the table, as given.
	Table string `json:"table"`
	// Statement is the UPDATE that resets the rows; after a dry run, the
	// one guarded by its snapshot, which a replay with Expect runs.
	Statement Statement `json:"-"`
	// Rows is, for a dry run, the number of rows the statement would
	// change, and otherwise the number it changed.
	Rows int64 `json:"rows"`
	// Snapshot identifies the rows of a dry run (pass it as
	// DeadFilter.Expect to replay exactly them), or the rows a replay with
	// Expect found.
	Snapshot ReplaySnapshot `json:"snapshot"`
	// DryRun is true when nothing was changed on purpose.
	DryRun bool `json:"dry_run"`
	// EventIDs are the event_ids of the rows a replay with Expect changed,
	// for ReplayProgress; nil otherwise.
	EventIDs []uuid.UUID `json:"-"`
	// LeftAlone counts, in an ordered table, the dead rows matching the
	// filter that the rule of ReplayEvent refuses now (such as a keyed row
	// whose key is held by another row, or one its relay has not recorded
	// as done): the bulk replay leaves them alone, as ReplayEvent would.
	// Elsewhere the statement leaves such rows out uncounted (0).
	LeftAlone int64 `json:"left_alone,omitempty"`
	// LockTTL is the lease duration the rows were judged by: rows leased
	// less than it ago were left alone (the larger of DeadFilter.LockTTL
	// and the LockTTL the table relays recorded).
	LockTTL time.Duration `json:"-"`
}

// replayFilter checks the filter of a bulk replay of t and returns it as
// the statements take it.
func replayFilter(t schema.Table, f DeadFilter) (sqlq.RunbookFilter, error) {
	if err := checkTable(t); err != nil {
		return sqlq.RunbookFilter{}, err
	}
	switch {
	case f.Topic == "" && !f.AllTopics:
		return sqlq.RunbookFilter{}, fmt.Errorf("runbook: replay dead rows of %s: %w; set DeadFilter.Topic to one topic, or AllTopics to replay every topic (CLI: --topic or --all)", t, ErrNoReplayFilter)
	case f.Topic != "" && f.AllTopics:
		return sqlq.RunbookFilter{}, fmt.Errorf("runbook: replay dead rows of %s: both a topic (%q) and AllTopics are set; keep only one", t, f.Topic)
	case f.Limit < 0:
		return sqlq.RunbookFilter{}, fmt.Errorf("runbook: replay dead rows of %s: limit %d is negative; pass 0 to replay every matching row", t, f.Limit)
	}
	return f.schemaFilter()
}

// ReplayDead resets every dead row of the table that matches f (in sequence
// order, at most f.Limit when it is positive) so that the relay delivers
// them again, and wakes the table's relays. It replays exactly what
// ReplayEvent would, row by row, and leaves alone what ReplayEvent refuses:
// rows leased by a relay less than the larger of f.LockTTL and the LockTTL
// the table relays recorded ago (BulkReplay.LockTTL); in a WAL table the rows
// whose key's hold refuses their replay (a replay while the key's hold
// drains; HoldState.Allows for the held row); in an ordered table every dead
// row the state reader lists (Dead: keyed rows a dead hold holds included)
// goes through ReplayEvent's own rule and is replayed as it replays it (a
// held row's hold is retried, a keyed row that died before the switch and is
// below its floor becomes a replay hold), and the refused ones are counted
// in LeftAlone. f must name a Topic or set AllTopics.
//
// With dryRun it changes nothing and returns in Rows the number of rows the
// statement would change now, and their Snapshot. Otherwise Rows is the
// number it changed. Pass the dry run's Snapshot as f.Expect to change
// exactly the previewed rows or none (ErrReplaySetChanged); without Expect
// the replay takes whatever matches when it runs.
func (r *Runbook) ReplayDead(ctx context.Context, f DeadFilter, dryRun bool) (BulkReplay, error) {
	if err := r.check(); err != nil {
		return BulkReplay{}, err
	}
	db, t := r.db, r.table
	sf, err := replayFilter(t, f)
	if err != nil {
		return BulkReplay{}, err
	}
	rd, err := readerOf(ctx, db, t)
	if err != nil {
		return BulkReplay{}, err
	}
	sq := rd.StateQueries
	sf.LockTTL = leaseTTL(rd, f.LockTTL)
	if sq.Mode == schema.ModeOrdered {
		return replayDeadOrdered(ctx, db, sq, f, sf, dryRun)
	}
	// In a WAL table, the rows whose key's hold refuses their replay (the
	// one rule of every replay path, walReplayRule) are left alone, in the
	// preview too.
	if walKeyed(sq) {
		g := walReplayGuard(t)
		sf.WALReplay = &g
	}
	q := sqlq.NewRunbookQueries(t)
	res := BulkReplay{Table: t.String(), Statement: Statement(q.ReplayDead(sf)), DryRun: dryRun, LockTTL: sf.LockTTL}
	if dryRun {
		count := q.CountReplayDead(sf)
		s := &res.Snapshot
		if err := db.QueryRow(ctx, count.SQL, count.Args...).Scan(&s.Rows, &s.MaxSequence, &s.Digest); err != nil {
			return BulkReplay{}, dbError(t, "count dead rows to replay of", err)
		}
		res.Rows = s.Rows
		res.Statement = Statement(q.ReplayDeadExpecting(sf, s.MaxSequence, s.Rows, s.Digest))
		return res, nil
	}
	if e := f.Expect; e != nil {
		res.Statement = Statement(q.ReplayDeadExpecting(sf, e.MaxSequence, e.Rows, e.Digest))
		var (
			changed int64
			ids     []string
		)
		s := &res.Snapshot
		if err := db.QueryRow(ctx, res.Statement.SQL, res.Statement.Args...).Scan(&s.Rows, &s.Digest, &changed, &ids); err != nil {
			return BulkReplay{}, dbError(t, "replay dead rows of", err)
		}
		for _, id := range ids {
			u, err := uuid.Parse(id)
			if err != nil {
				return res, fmt.Errorf("runbook: replay dead rows of %s: the server returned %q as an event_id: %w", t, id, err)
			}
			res.EventIDs = append(res.EventIDs, u)
		}
		s.MaxSequence = e.MaxSequence
		if s.Rows != e.Rows || s.Digest != e.Digest {
			return res, fmt.Errorf("runbook: replay dead rows of %s: %w: the preview counted %d rows up to sequence %d, %d match now; nothing changed, preview again",
				t, ErrReplaySetChanged, e.Rows, e.MaxSequence, s.Rows)
		}
		res.Rows = changed
		if res.Rows > 0 {
			wake(ctx, db, q)
		}
		return res, nil
	}
	tag, err := db.Exec(ctx, res.Statement.SQL, res.Statement.Args...)
	if err != nil {
		return BulkReplay{}, dbError(t, "replay dead rows of", err)
	}
	res.Rows = tag.RowsAffected()
	if res.Rows > 0 {
		wake(ctx, db, q)
	}
	return res, nil
}

// replayDeadOrdered is ReplayDead for the ordered table of sq: each dead
// row matching f (sf) that replayEvent's rule accepts, judging leases by
// sf.LockTTL, in sequence order, up to f.Limit, is replayed by
// replayEvent. With f.Expect it runs in one
// transaction (when db can begin one: *pgxpool.Pool, *pgx.Conn, pgx.Tx)
// and changes exactly the previewed rows or none.
func replayDeadOrdered(ctx context.Context, db DB, sq sqlq.StateQueries, f DeadFilter, sf sqlq.RunbookFilter, dryRun bool) (BulkReplay, error) {
	t := sq.Table
	lockTTL := sf.LockTTL
	sel := sf
	sel.Limit = 0
	res := BulkReplay{Table: t.String(), DryRun: dryRun, Statement: Statement(sq.Dead(sel)), LockTTL: lockTTL}
	res.Statement.SQL = "-- ordered mode: each dead row this lists is replayed as `outbox dead replay --event-id` replays it (Runbook.ReplayEvent),\n" +
		"-- and left alone when that refuses it\n" + res.Statement.SQL
	// plan lists the rows the rule accepts now, up to maxSeq when capped.
	plan := func(db DB, maxSeq int64, capped bool) (ids []uuid.UUID, seqs []int64, left int64, err error) {
		rows, err := queryStateRows(ctx, db, t, "list the dead rows to replay of", sq.Dead(sel))
		if err != nil {
			return nil, nil, 0, err
		}
		for _, r := range rows {
			if (capped && r.Sequence > maxSeq) || (f.Limit > 0 && len(ids) == f.Limit) {
				break
			}
			if _, err := replayEvent(ctx, db, sq, r.EventID, lockTTL, true); isRefusal(err) {
				left++
				continue
			} else if err != nil {
				return nil, nil, 0, err
			}
			ids, seqs = append(ids, r.EventID), append(seqs, r.Sequence)
		}
		return ids, seqs, left, nil
	}
	if dryRun || f.Expect == nil {
		ids, seqs, left, err := plan(db, 0, false)
		if err != nil {
			return BulkReplay{}, err
		}
		res.LeftAlone = left
		if dryRun {
			res.Snapshot = snapshotOf(seqs)
			res.Rows = res.Snapshot.Rows
			return res, nil
		}
		for _, id := range ids {
			_, err := replayEvent(ctx, db, sq, id, lockTTL, false)
			switch {
			case isRefusal(err):
				res.LeftAlone++ // it changed since the plan
			case err != nil:
				return res, err
			default:
				res.Rows++
			}
		}
		return res, nil
	}
	e := f.Expect
	apply := func(db DB) error {
		ids, seqs, left, err := plan(db, e.MaxSequence, true)
		if err != nil {
			return err
		}
		res.Snapshot, res.LeftAlone = snapshotOf(seqs), left
		res.Snapshot.MaxSequence = e.MaxSequence
		if res.Snapshot.Rows != e.Rows || res.Snapshot.Digest != e.Digest {
			return fmt.Errorf("runbook: replay dead rows of %s: %w: the preview counted %d rows up to sequence %d, %d match now; nothing changed, preview again",
				t, ErrReplaySetChanged, e.Rows, e.MaxSequence, res.Snapshot.Rows)
		}
		for _, id := range ids {
			if _, err := replayEvent(ctx, db, sq, id, lockTTL, false); err != nil {
				return fmt.Errorf("runbook: replay dead rows of %s: %w: event %s changed since the preview (%w); nothing changed, preview again",
					t, ErrReplaySetChanged, id, err)
			}
		}
		res.Rows, res.EventIDs = int64(len(ids)), ids
		return nil
	}
	b, ok := db.(interface {
		Begin(ctx context.Context) (pgx.Tx, error)
	})
	if !ok {
		return res, apply(db)
	}
	err := pgx.BeginFunc(ctx, b, func(tx pgx.Tx) error { return apply(tx) })
	if err != nil {
		res.Rows, res.EventIDs = 0, nil
		return res, err
	}
	return res, nil
}

// isRefusal tells whether err is a refusal of replayEvent's rule (the row
// is left as it is), not a failure.
func isRefusal(err error) bool {
	var nr *NotReplayableError
	return err != nil && (errors.As(err, &nr) || errors.Is(err, ErrHoldRefused) || errors.Is(err, ErrNotHeld) || errors.Is(err, ErrNotRelayedYet))
}

// snapshotOf is the snapshot of the rows with sequences seqs (ascending),
// as sqlq.RunbookQueries.CountReplayDead computes it.
func snapshotOf(seqs []int64) ReplaySnapshot {
	s := ReplaySnapshot{Rows: int64(len(seqs))}
	if len(seqs) == 0 {
		return s
	}
	parts := make([]string, len(seqs))
	for i, n := range seqs {
		parts[i] = strconv.FormatInt(n, 10)
	}
	s.MaxSequence = seqs[len(seqs)-1]
	s.Digest = fmt.Sprintf("%x", md5.Sum([]byte(strings.Join(parts, ",")))) //nolint:gosec // a digest of a row set, as the SQL's md5, not a secret
	return s
}

// Progress is how far the relay got with the rows of a bulk replay.
type Progress struct {
	// Rows counts the replayed rows still in the table (the cleaner may
	// have deleted published ones).
	Rows int64 `json:"rows"`
	// Published counts those delivered since (in the table's mode: in an
	// ordered or WAL table, also those delivered without published_at, and
	// those an operator skipped).
	Published int64 `json:"published"`
	// Dead counts those dead again.
	Dead int64 `json:"dead"`
	// Pending counts those not delivered yet.
	Pending int64 `json:"pending"`
}

// ReplayProgress counts how many of the rows with eventIDs (a replay's
// BulkReplay.EventIDs) are published, dead again, or still pending.
func (r *Runbook) ReplayProgress(ctx context.Context, eventIDs []uuid.UUID) (Progress, error) {
	if err := r.check(); err != nil {
		return Progress{}, err
	}
	db, t := r.db, r.table
	ids := make([]string, len(eventIDs))
	for i, id := range eventIDs {
		ids[i] = id.String()
	}
	sq, err := stateOf(ctx, db, t)
	if err != nil {
		return Progress{}, err
	}
	st := sq.Progress(ids)
	var p Progress
	if err := db.QueryRow(ctx, st.SQL, st.Args...).Scan(&p.Rows, &p.Published, &p.Dead, &p.Pending); err != nil {
		return Progress{}, dbError(t, "read the replay progress of", err)
	}
	return p, nil
}
