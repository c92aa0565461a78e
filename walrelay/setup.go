package walrelay

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/schema"
)

// ErrWALLevel is returned (wrapped) by Setup and New when the server's
// wal_level is not logical.
var ErrWALLevel = errors.New("walrelay: the server's wal_level is not logical")

// ErrNotSetUp is returned (wrapped) by New when the table's publication,
// its slot, or this version's holds table is missing: run Setup (or
// `outbox migrate --wal`) first.
var ErrNotSetUp = errors.New("walrelay: the table is not set up for the WAL relay")

// ErrTopicsPaused is returned (wrapped) by Setup and New while topics of
// the table are paused (runbook.PauseTopic, `outbox topics pause`): the WAL
// relay cannot pause a topic (its slot would retain WAL for as long as the
// pause lasts), so it does not take a table over while a pause it would
// ignore is in force. Resume the topics first, or keep the table on the
// default or ordered relay until the pause can end.
var ErrTopicsPaused = errors.New("walrelay: topics of the table are paused")

// Names are the publication and slot of one table.
type Names struct {
	// Publication publishes the table's inserts and updates.
	Publication string
	// Slot is the logical replication slot (pgoutput) the relay reads.
	Slot string
}

// DefaultNames returns the names Setup and New use when the config leaves
// them empty: both schema.WALSlotName(t).
func DefaultNames(t schema.Table) Names {
	n := schema.WALSlotName(t)
	return Names{Publication: n, Slot: n}
}

func (n Names) withDefaults(t schema.Table) (Names, error) {
	d := DefaultNames(t)
	if n.Publication == "" {
		n.Publication = d.Publication
	}
	if n.Slot == "" {
		n.Slot = d.Slot
	}
	if !sqlq.ValidSlotName(n.Slot) {
		return n, fmt.Errorf("walrelay: invalid config: slot name %q: use at most 63 characters of a-z, 0-9 and _", n.Slot)
	}
	return n, nil
}

func checkWALLevel(ctx context.Context, pool *pgxpool.Pool) error {
	var level string
	if err := pool.QueryRow(ctx, sqlq.WALLevel).Scan(&level); err != nil {
		return fmt.Errorf("walrelay: read wal_level: %w", err)
	}
	if level != "logical" {
		return fmt.Errorf("%w: it is %q; set wal_level = logical in postgresql.conf (or ALTER SYSTEM SET wal_level = logical) and restart the server, "+
			"and give the relay's role the REPLICATION attribute", ErrWALLevel, level)
	}
	return nil
}

// privilegeHint explains a permission error of the set-up.
func privilegeHint(err error, what string) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42501" {
		return fmt.Errorf("walrelay: %s: %w; the role needs the REPLICATION attribute (ALTER ROLE ... REPLICATION) for the slot, "+
			"and ownership of the table (or CREATE on the database) for the publication", what, err)
	}
	return fmt.Errorf("walrelay: %s: %w", what, err)
}

// Setup creates the publication and the logical replication slot of table
// t (names n, defaults when empty), unless they exist, and the progress
// table (schema.Table.WALProgressTable) the cleaner and the runbook read,
// and records the WAL relay as the table's relay mode (schema.RecordMode:
// refused while default or ordered relays work on it). The slot starts at
// the current WAL position; the rows committed before it and still pending
// (not published, not dead) are read from the table by the relay's first
// session and delivered before the stream (a backfill, as after a lost
// slot): nothing committed before Setup is lost. It needs wal_level =
// logical and a role with the REPLICATION attribute. It is idempotent.
func Setup(ctx context.Context, pool *pgxpool.Pool, t schema.Table, n Names) (Names, error) {
	n, err := n.withDefaults(t)
	if err != nil {
		return n, err
	}
	if err := checkWALLevel(ctx, pool); err != nil {
		return n, err
	}
	cols, err := schema.DetectColumns(ctx, pool, t)
	if err != nil {
		return n, fmt.Errorf("walrelay: %w", err)
	}
	// Before anything is created: a table with the WAL relay's tables reads
	// as streamed to writers and readers.
	if err := refuseSwitch(ctx, pool, t, "walrelay.Setup"); err != nil {
		return n, err
	}
	if _, err := pool.Exec(ctx, sqlq.WALCreateProgressTable(t)); err != nil {
		return n, fmt.Errorf("walrelay: create the progress table of %s: %w", t, err)
	}
	if err := setupHolds(ctx, pool, t, cols.OrderingKey); err != nil {
		return n, err
	}
	// Before the publication and the slot, so that a refusal leaves no
	// slot retaining WAL.
	if err := recordMode(ctx, pool, t, "walrelay.Setup"); err != nil {
		return n, err
	}
	var exists, hasTable, ins, upd bool
	var others []string
	if err := pool.QueryRow(ctx, sqlq.WALPublicationExists, n.Publication, t.Sanitize()).Scan(&exists, &hasTable, &ins, &upd, &others); err != nil {
		return n, fmt.Errorf("walrelay: look up publication %s: %w", n.Publication, err)
	}
	switch {
	case len(others) > 0:
		return n, otherTablesError(n.Publication, t, others)
	case !exists:
		if _, err := pool.Exec(ctx, sqlq.WALCreatePublication(n.Publication, t)); err != nil {
			return n, privilegeHint(err, "create publication "+n.Publication)
		}
	case !hasTable || !ins || !upd:
		return n, fmt.Errorf("walrelay: publication %s exists but does not publish the inserts and updates of %s; drop it or name another publication", n.Publication, t)
	}
	var plugin, confirmed string
	var active, lost bool
	err = pool.QueryRow(ctx, sqlq.WALSlotState, n.Slot).Scan(&plugin, &active, &confirmed, &lost)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		if err := pool.QueryRow(ctx, sqlq.WALCreateSlot, n.Slot).Scan(&confirmed); err != nil {
			return n, privilegeHint(err, "create replication slot "+n.Slot)
		}
	case err != nil:
		return n, fmt.Errorf("walrelay: look up replication slot %s: %w", n.Slot, err)
	case plugin != "pgoutput":
		return n, fmt.Errorf("walrelay: replication slot %s exists with plugin %q, not pgoutput; drop it or name another slot", n.Slot, plugin)
	}
	// The rows committed before the slot are not in its stream: a
	// progress record just behind it (its start minus one: setupRecord)
	// makes the first session deliver them from the table (start), and
	// counts none of them streamed until then.
	if confirmed == "" {
		return n, nil // a slot without a position (invalidated): the relay recreates it and backfills
	}
	start, err := pglogrepl.ParseLSN(confirmed)
	if err != nil {
		return n, fmt.Errorf("walrelay: replication slot %s: read its position %q: %w", n.Slot, confirmed, err)
	}
	if start == 0 {
		return n, fmt.Errorf("walrelay: replication slot %s has no confirmed position; drop it and run Setup again", n.Slot)
	}
	if _, err := pool.Exec(ctx, sqlq.WALProgressBeforeSetup(t), n.Slot, setupRecord(start).String()); err != nil {
		return n, fmt.Errorf("walrelay: record the start of slot %s: %w", n.Slot, err)
	}
	return n, nil
}

// recordMode switches t to the WAL relay's mode (schema.SwitchMode, the
// one switch every path takes: it settles the old mode's state into the
// rows' columns, so the relay's backfill delivers only what was pending),
// refusing with schema.ErrRelayModeMix while default or ordered relays work
// on t and with schema.ErrKeysHeld while a hold of any mode is open; any
// other failure of the switch stops the relay too (it would deliver again
// what the old mode delivered). A table without the mode table (migrated
// by an earlier version) is left to readers that infer its mode.
//
// It first refuses a table the relay must not take over (refuseSwitch):
// Setup and every start of the relay record the mode through it, and once
// the mode is recorded a pause is refused (runbook.PauseTopic), so a pause
// made before is never left in force beside the relay.
func recordMode(ctx context.Context, pool *pgxpool.Pool, t schema.Table, by string) error {
	if err := refuseSwitch(ctx, pool, t, by); err != nil {
		return err
	}
	if err := schema.SwitchMode(ctx, pool, t, schema.ModeWAL, by); err != nil && !errors.Is(err, schema.ErrNoModeTable) {
		return fmt.Errorf("walrelay: %w", err)
	}
	return nil
}

// setupHolds creates the holds table of t, or brings it to this version's
// shape, and moves into it, in one transaction, the holds a WAL relay of an
// older version kept in <table>_wal_holds (sqlq.WALMoveLegacyHolds); a
// keyed table gets skipped_at (sqlq.WALAddSkippedAt) in the same
// transaction.
func setupHolds(ctx context.Context, pool *pgxpool.Pool, t schema.Table, keyed bool) error {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("walrelay: create the holds table of %s: %w", t, err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, sqlq.WALCreateHoldsTable(t)); err != nil {
		return fmt.Errorf("walrelay: create the holds table of %s: %w", t, err)
	}
	var legacy bool
	if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, sqlq.LegacyWALHoldsTable(t)).Scan(&legacy); err != nil {
		return fmt.Errorf("walrelay: look up %s: %w", sqlq.LegacyWALHoldsTable(t), err)
	}
	if legacy {
		var moved, total int64
		if err := tx.QueryRow(ctx, sqlq.WALMoveLegacyHolds(t)).Scan(&moved, &total); err != nil {
			return fmt.Errorf("walrelay: move the holds of %s into %s: %w", sqlq.LegacyWALHoldsTable(t), t.HoldsTable(), err)
		}
		if moved != total {
			return fmt.Errorf("walrelay: %w: moving the holds of %s into %s refused: %d of its %d key(s) are held by ordered mode too; resolve ordered "+
				"mode's holds with the ordered relay running (`outbox keys held`), then run Setup again; nothing changed",
				schema.ErrKeysHeld, sqlq.LegacyWALHoldsTable(t), t.HoldsTable(), total-moved, total)
		}
		if _, err := tx.Exec(ctx, `DROP TABLE `+sqlq.LegacyWALHoldsTable(t)); err != nil {
			return fmt.Errorf("walrelay: drop %s: %w", sqlq.LegacyWALHoldsTable(t), err)
		}
	}
	// skipped_at (migration 000012), where the relay records a skip: added
	// only when missing (the ALTER locks t).
	if keyed {
		var has bool
		if err := tx.QueryRow(ctx, sqlq.WALSkippedAtExists(t)).Scan(&has); err != nil {
			return fmt.Errorf("walrelay: look up skipped_at of %s: %w", t, err)
		}
		if !has {
			if _, err := tx.Exec(ctx, sqlq.WALAddSkippedAt(t)); err != nil {
				return fmt.Errorf("walrelay: add skipped_at to %s: %w", t, err)
			}
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("walrelay: create the holds table of %s: %w", t, err)
	}
	return nil
}

// refuseSwitch refuses a table the WAL relay must not take over: one with
// paused topics (refusePaused), or with keys ordered mode holds
// (schema.ErrKeysHeld): the WAL relay reads neither.
func refuseSwitch(ctx context.Context, pool *pgxpool.Pool, t schema.Table, by string) error {
	if err := refusePaused(ctx, pool, t, by); err != nil {
		return err
	}
	n, err := sqlq.OpenHoldsOfOtherMode(ctx, pool, t, schema.ModeWAL)
	if err != nil {
		return fmt.Errorf("walrelay: %w", err)
	}
	if n > 0 {
		return fmt.Errorf("walrelay: %w: %s refused for %s: ordered mode holds %d key(s) (%s: a failing or dead row each), and the WAL relay does not read "+
			"those holds; resolve them with the ordered relay running (`outbox keys held` lists them; replay or skip each held row, or wait for the failing ones "+
			"to be delivered), then switch; nothing changed", schema.ErrKeysHeld, by, t, n, t.HoldsTable())
	}
	return nil
}

// refusePaused fails with ErrTopicsPaused, naming the topics and how to
// resume them, while topics of t are paused.
func refusePaused(ctx context.Context, pool *pgxpool.Pool, t schema.Table, by string) error {
	ok, err := sqlq.PausedTopicsExist(ctx, pool, t)
	if err != nil || !ok {
		return err // no table of paused topics: nothing is paused
	}
	rows, err := pool.Query(ctx, sqlq.NewPausedTopicsQueries(t).Topics)
	if err != nil {
		return fmt.Errorf("walrelay: read the paused topics of %s: %w", t, err)
	}
	topics, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("walrelay: read the paused topics of %s: %w", t, err)
	}
	if len(topics) == 0 {
		return nil
	}
	return fmt.Errorf("%w: %s refused for %s: %d topic(s) paused (%s), and the WAL relay cannot pause a topic (its slot would retain WAL for as long as "+
		"the pause lasts); resume them first (`outbox topics resume --table=%s <topic>`, or runbook.ResumeTopic), or keep the table on the default "+
		"or ordered relay until the pause can end; nothing changed", ErrTopicsPaused, by, t, len(topics), strings.Join(topics, ", "), t)
}

// setupRecord is the position Setup records for a slot that starts at
// start: one before it. A slot found exactly one ahead of its record was
// never read since Setup (start then reads the rows written before
// Setup); one further ahead was recreated after a loss.
func setupRecord(start pglogrepl.LSN) pglogrepl.LSN { return start - 1 }

// Teardown drops the slot, the publication, the progress table and the
// holds of t (names n, defaults when empty; the holds table itself when
// ordered mode has no tables on t). A dropped slot retains no WAL; events committed after it are no
// longer streamed. A slot still active is waited for up to
// teardownSlotWait: the walsender of a relay that has just closed ends a
// moment after the relay's connection.
func Teardown(ctx context.Context, pool *pgxpool.Pool, t schema.Table, n Names) error {
	n, err := n.withDefaults(t)
	if err != nil {
		return err
	}
	for deadline := time.Now().Add(teardownSlotWait); ; {
		_, err := pool.Exec(ctx, sqlq.WALDropSlot, n.Slot)
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "55006" && time.Now().Before(deadline) { // object_in_use: still read
			select {
			case <-ctx.Done():
				return fmt.Errorf("walrelay: drop replication slot %s: %w", n.Slot, ctx.Err())
			case <-time.After(50 * time.Millisecond):
			}
			continue
		}
		if err != nil {
			return fmt.Errorf("walrelay: drop replication slot %s: %w", n.Slot, err)
		}
		break
	}
	if _, err := pool.Exec(ctx, sqlq.WALDropPublication(n.Publication)); err != nil {
		return fmt.Errorf("walrelay: drop publication %s: %w", n.Publication, err)
	}
	if _, err := pool.Exec(ctx, `DROP TABLE IF EXISTS `+t.WALProgressTable()+`, `+sqlq.LegacyWALHoldsTable(t)); err != nil {
		return fmt.Errorf("walrelay: drop the progress table of %s: %w", t, err)
	}
	return dropHolds(ctx, pool, t)
}

// dropHolds deletes the WAL relay's holds of t: the holds table with them
// when it is the WAL relay's alone (t has no ordered mode's tables), else
// only the holds the WAL relay wrote.
func dropHolds(ctx context.Context, pool *pgxpool.Pool, t schema.Table) error {
	var holds, ordered bool
	if err := pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL, to_regclass($2) IS NOT NULL`, t.HoldsTable(), t.PartitionsTable()).Scan(&holds, &ordered); err != nil {
		return fmt.Errorf("walrelay: look up the holds table of %s: %w", t, err)
	}
	sql := `DROP TABLE IF EXISTS ` + t.HoldsTable()
	switch {
	case !holds:
		return nil
	case ordered:
		sql = `DELETE FROM ` + t.HoldsTable() + ` WHERE mode = 'wal'`
	}
	if _, err := pool.Exec(ctx, sql); err != nil {
		return fmt.Errorf("walrelay: drop the holds of %s: %w", t, err)
	}
	return nil
}

// checkSetUp verifies what New needs: wal_level, the publication and the
// slot.
func checkSetUp(ctx context.Context, pool *pgxpool.Pool, t schema.Table, n Names) error {
	if err := checkWALLevel(ctx, pool); err != nil {
		return err
	}
	var exists, hasTable, ins, upd bool
	var others []string
	if err := pool.QueryRow(ctx, sqlq.WALPublicationExists, n.Publication, t.Sanitize()).Scan(&exists, &hasTable, &ins, &upd, &others); err != nil {
		return fmt.Errorf("walrelay: look up publication %s: %w", n.Publication, err)
	}
	if len(others) > 0 {
		return otherTablesError(n.Publication, t, others)
	}
	if !exists || !hasTable || !ins || !upd {
		return fmt.Errorf("%w: publication %s does not publish the inserts and updates of %s; run walrelay.Setup (outbox migrate --wal)", ErrNotSetUp, n.Publication, t)
	}
	var plugin, confirmed string
	var active, lost bool
	err := pool.QueryRow(ctx, sqlq.WALSlotState, n.Slot).Scan(&plugin, &active, &confirmed, &lost)
	if errors.Is(err, pgx.ErrNoRows) {
		// A slot that streamed before, or that Setup created (either has a
		// progress record), and is gone is recreated by the relay, which
		// reads what it missed from the table; one never set up needs Setup.
		var recorded bool
		if err := pool.QueryRow(ctx, sqlq.WALProgressTableExists(t)).Scan(&recorded); err != nil {
			return fmt.Errorf("walrelay: look up the progress table of %s: %w", t, err)
		}
		if recorded {
			err = pool.QueryRow(ctx, sqlq.WALProgressRecorded(t), n.Slot).Scan(&recorded)
			if err != nil {
				return fmt.Errorf("walrelay: look up the progress of slot %s: %w", n.Slot, err)
			}
		}
		if recorded {
			if err := recordMode(ctx, pool, t, "WAL relay"); err != nil {
				return err
			}
			return checkSequence(ctx, pool, t)
		}
		return fmt.Errorf("%w: replication slot %s does not exist; run walrelay.Setup (outbox migrate --wal)", ErrNotSetUp, n.Slot)
	}
	if err != nil {
		return fmt.Errorf("walrelay: look up replication slot %s: %w", n.Slot, err)
	}
	if plugin != "pgoutput" {
		return fmt.Errorf("walrelay: replication slot %s uses plugin %q, not pgoutput", n.Slot, plugin)
	}
	if err := recordMode(ctx, pool, t, "WAL relay"); err != nil {
		return err
	}
	return checkSequence(ctx, pool, t)
}

// checkSequence refuses a sequence that caches values per session: holds
// park a key's rows from the dead row's sequence on, and drains and the
// backfill read rows in sequence order, which must be commit order within
// a key.
func checkSequence(ctx context.Context, pool *pgxpool.Pool, t schema.Table) error {
	if err := sqlq.CheckOrderedSequence(ctx, pool, t); err != nil {
		return fmt.Errorf("walrelay: %w", err)
	}
	return nil
}

// teardownSlotWait bounds how long Teardown waits for an active slot to be
// released; a slot a live relay reads stays active, and Teardown then fails.
const teardownSlotWait = 5 * time.Second

// ErrPublicationHasOtherTables is matched (errors.Is) by the error of Setup
// and New when the relay's publication also publishes other tables: their
// rows would be streamed to the relay, which reads only its table's.
var ErrPublicationHasOtherTables = errors.New("walrelay: the publication publishes other tables")

func otherTablesError(pub string, t schema.Table, others []string) error {
	return fmt.Errorf("%w: publication %s publishes %s besides %s; give the outbox table a publication of its own (walrelay.Names.Publication), or ALTER PUBLICATION %s DROP TABLE the others",
		ErrPublicationHasOtherTables, pub, strings.Join(others, ", "), t, pub)
}
