package schema

import (
	"context"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/internal/pgmeta"
)

// A table's delivery state has one form at rest: the row's own columns
// (published_at, dead_at, skipped_at), which the default relay reads and
// writes. Ordered mode and the WAL relay keep, while they relay a table,
// part of it elsewhere (ordered mode: the partitions' floors and the resolved
// holds say which keyed rows are delivered; the WAL relay: the horizon of
// its progress table says which streamed rows are). SwitchMode is the one
// operation that moves a table from one mode to another: it settles the old
// mode's state into the rows' columns, so the relay of the new mode reads
// the columns first and delivers exactly the rows that were pending.

// SwitchMode records m as the relay mode of table t, by who ("outbox
// migrate", "default relay", ...), as one operation whatever the old mode:
// every path that records a mode goes through it (Migrate with WithMode,
// `outbox migrate --mode=`, walrelay.Setup, and each relay when it starts).
//
// When m is already t's recorded mode it does nothing. Otherwise, in one
// transaction that holds t's migration lock (so switches, and migrations,
// of t run one at a time; a relay that starts meanwhile runs its own switch
// after this one), it:
//
//  1. refuses with ErrRelayModeMix, naming it, while a relay of another
//     mode works on t (a default or ordered relay subscribed, a live
//     partition lease of an ordered relay, an active replication slot);
//  2. refuses with ErrKeysHeld, counting them per mode, while any hold of
//     any mode is open (a failing, dead or draining row that holds its
//     key): the relay of the new mode would not read it; resolve the
//     holds with the old mode's relay running first (`outbox keys held`:
//     replay or skip each held row, or let a retrying one be delivered);
//  3. settles the old mode into the rows' columns: the rows it delivered
//     get published_at (ordered mode: keyed rows at or below their
//     partition's floor or covered by a resolved hold; the WAL relay: rows
//     written before the horizon its slots confirmed); dead rows stay dead
//     and are never marked published; skipped rows keep skipped_at;
//     pending rows stay pending. The old mode's resolved holds
//     (tombstones) go: the rows they covered are published now;
//  4. into ordered mode, lowers each partition's floor below its oldest
//     pending keyed row, so that the ordered relays read every row that
//     is pending (one the floor of an earlier ordered era had passed: a
//     dead row replayed in another mode, say);
//  5. creates the companion tables of m that t lacks (ordered mode:
//     <table>_partitions, <table>_relays and <table>_holds; the WAL relay:
//     <table>_holds), or brings those of an older version to this one's
//     shape, by the DDL of their migrations: a table has the keyed modes'
//     tables once it was switched to one (modetables.go). A role that may
//     not create them gets an error naming `outbox migrate --mode=<m>`;
//  6. records m last.
//
// A switch away from the WAL relay also drops the table's replication
// slots (the default one and those its progress table names), which are
// inactive then: an unread slot retains WAL. Its publication and progress
// table stay (walrelay.Teardown drops them; walrelay.Setup sets the table
// up again, with a new slot).
//
// Nothing changes when it refuses. It fails with ErrNoModeTable (wrapped)
// when t has no mode table (migration 000010).
func SwitchMode(ctx context.Context, db DB, t Table, m Mode, by string) error {
	_, err := switchMode(ctx, db, t, m, by)
	return err
}

// switchResult says what a mode switch did.
type switchResult struct {
	// From is the mode the table was relayed in (recorded, or inferred
	// when none was recorded); To the mode now recorded.
	From, To Mode
	// Settled is the number of rows the old mode had delivered that the
	// switch marked published.
	Settled int64
	// Reopened is the number of ordered-mode partitions whose floor a
	// switch into ordered mode lowered below a pending keyed row.
	Reopened int64
	// DroppedSlots are the replication slots of the table the switch
	// dropped, from the WAL relay.
	DroppedSlots []string
	// Changed is false when To was already the recorded mode.
	Changed bool
}

// switchMode is SwitchMode, with what it did.
func switchMode(ctx context.Context, db DB, t Table, m Mode, by string) (switchResult, error) {
	res := switchResult{To: m}
	if !m.Valid() {
		return res, fmt.Errorf("switch the relay mode of %s: unknown mode %q; use %s, %s or %s", t, m, ModeDefault, ModeOrdered, ModeWAL)
	}
	if db == nil {
		return res, fmt.Errorf("switch the relay mode of %s: nil DB; pass a *pgxpool.Pool, *pgx.Conn or pgx.Tx", t)
	}
	// The record first, in a transaction of its own that holds no lock
	// afterwards: a relay that starts in the table's mode changes nothing,
	// and waits for no migration.
	unchanged, err := modeIs(ctx, db, t, m)
	if err != nil || unchanged {
		res.From = m
		return res, err
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return res, fmt.Errorf("switch the relay mode of %s: begin: %w", t, err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	// Serialize switches and migrations of t before reading anything of t
	// (Migrate takes the same lock first, then t's: reading t first would
	// hold a lock Migrate's DDL waits for while waiting for Migrate), then
	// read the record again: another switch may have committed meanwhile.
	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, t.migrateLockKey()); err != nil {
		return res, fmt.Errorf("switch the relay mode of %s: lock: %w", t, err)
	}
	rec, recorded, err := RecordedMode(ctx, tx, t)
	if err != nil {
		return res, err
	}
	if recorded && rec.Mode == m {
		res.From = m
		return res, nil
	}
	res.From = rec.Mode
	if !recorded {
		if res.From, err = inferMode(ctx, tx, t); err != nil {
			return res, err
		}
	}
	if err := checkModeSwitch(ctx, tx, t, m); err != nil {
		return res, fmt.Errorf("switch %s from %s to %s mode: %w; nothing changed", t, res.From, m, err)
	}
	if err := refuseOpenHolds(ctx, tx, t, res.From, m); err != nil {
		return res, err
	}
	if res.From != ModeDefault || m == ModeOrdered {
		facts, err := readSwitchFacts(ctx, tx, t)
		if err != nil {
			return res, err
		}
		if res.Settled, err = settle(ctx, tx, t, res.From, facts); err != nil {
			return res, err
		}
		if m == ModeOrdered {
			if res.Reopened, err = reopenBelowFloors(ctx, tx, t, facts); err != nil {
				return res, err
			}
		}
	}
	if res.From == ModeWAL {
		if res.DroppedSlots, err = dropSlots(ctx, tx, t); err != nil {
			return res, err
		}
	}
	if err := createKeyedTables(ctx, tx, t, res.From, m); err != nil {
		return res, err
	}
	if len(by) > modeRecordedByMaxBytes {
		by = strings.ToValidUTF8(by[:modeRecordedByMaxBytes], "")
	}
	if _, err := tx.Exec(ctx, `INSERT INTO `+t.modeTable()+` AS r (mode, recorded_by) VALUES ($1, $2)
ON CONFLICT (singleton) DO UPDATE SET mode = EXCLUDED.mode, recorded_at = now(), recorded_by = EXCLUDED.recorded_by`, string(m), by); err != nil {
		return res, fmt.Errorf("record the relay mode of %s: %w", t, err)
	}
	if err := tx.Commit(ctx); err != nil {
		return res, fmt.Errorf("switch the relay mode of %s: commit: %w", t, err)
	}
	res.Changed = true
	return res, nil
}

// modeIs reports whether m is t's recorded mode, in a transaction of its
// own (ended before it returns). It fails with ErrNoModeTable (wrapped)
// when t has no mode table.
func modeIs(ctx context.Context, db DB, t Table, m Mode) (bool, error) {
	tx, err := db.Begin(ctx)
	if err != nil {
		return false, fmt.Errorf("switch the relay mode of %s: begin: %w", t, err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	ok, err := modeTableExists(ctx, tx, t)
	if err != nil {
		return false, err
	}
	if !ok {
		return false, fmt.Errorf("record the relay mode of %s: %w; run `outbox migrate --table=%s` (or schema.Migrate)", t, ErrNoModeTable, t)
	}
	rec, recorded, err := RecordedMode(ctx, tx, t)
	return recorded && rec.Mode == m, err
}

// inferMode is the mode of a table without a recorded one, from what
// exists (pgmeta.InferMode, the state reader's rule too).
func inferMode(ctx context.Context, q Querier, t Table) (Mode, error) {
	var walProgress, published, ordered, orderingKey bool
	err := q.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL, EXISTS (SELECT 1 FROM pg_publication_rel WHERE prrelid = to_regclass($2)),
  to_regclass($3) IS NOT NULL AND to_regclass($4) IS NOT NULL,
  EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($2) AND attname = 'ordering_key' AND NOT attisdropped)`,
		t.WALProgressTable(), t.Sanitize(), t.PartitionsTable(), t.HoldsTable()).Scan(&walProgress, &published, &ordered, &orderingKey)
	if err != nil {
		return "", fmt.Errorf("find the relay mode of %s: %w", t, err)
	}
	return Mode(pgmeta.InferMode(walProgress, published, ordered, orderingKey)), nil
}

// refuseOpenHolds fails with ErrKeysHeld while any hold of t is open (not
// resolved), whatever mode wrote it.
func refuseOpenHolds(ctx context.Context, tx pgx.Tx, t Table, from, to Mode) error {
	var exists bool
	if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, t.HoldsTable()).Scan(&exists); err != nil {
		return fmt.Errorf("look up the holds table %s: %w", t.HoldsTable(), err)
	}
	if !exists {
		return nil
	}
	// The mode is read through to_jsonb: a holds table made by an older
	// version has no mode column, and holds ordered mode's only.
	var ordered, wal, dead int64
	err := tx.QueryRow(ctx, `SELECT count(*) FILTER (WHERE COALESCE(to_jsonb(h)->>'mode', 'ordered') = 'ordered'),
  count(*) FILTER (WHERE COALESCE(to_jsonb(h)->>'mode', 'ordered') = 'wal'), count(*) FILTER (WHERE h.dead_at IS NOT NULL)
FROM `+t.HoldsTable()+` AS h WHERE h.resolved_at IS NULL`).Scan(&ordered, &wal, &dead)
	if err != nil {
		return fmt.Errorf("count the open holds of %s: %w", t.HoldsTable(), err)
	}
	if ordered+wal == 0 {
		return nil
	}
	relay := "the ordered relay"
	if wal > 0 {
		relay = "the WAL relay"
	}
	return fmt.Errorf("switch %s from %s to %s mode: %w: %d key(s) held (ordered mode %d, the WAL relay %d; %d dead) in %s, and the relay of %s mode "+
		"would not read those holds; resolve them with %s running (`outbox keys held --table=%s` lists them; replay or skip each held row, or let "+
		"the retrying ones be delivered), then switch; nothing changed", t, from, to, ErrKeysHeld, ordered+wal, ordered, wal, dead, t.HoldsTable(), to, relay, t)
}

// switchFacts is what a switch reads of t's tables, once, for the settle
// of the old mode and the floors of ordered mode.
type switchFacts struct {
	partitions bool // <table>_partitions exists
	// ordered: the partitions table and a holds table with the hold
	// states of migration 000005 (resolved_at, replay) exist.
	ordered           bool
	holdsMode         bool // the holds table has its mode column (migration 000011)
	wal               bool // the WAL relay's progress table exists
	orderingKey       bool // t has ordering_key
	orderingPartition bool // t has ordering_partition
	skippedAt         bool // t has skipped_at
}

// readSwitchFacts reads switchFacts in one round trip.
func readSwitchFacts(ctx context.Context, tx pgx.Tx, t Table) (switchFacts, error) {
	var f switchFacts
	col := func(rel, name string) string {
		return `EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass(` + rel + `) AND attname = '` + name + `' AND NOT attisdropped)`
	}
	err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL,
  to_regclass($1) IS NOT NULL AND to_regclass($2) IS NOT NULL AND `+col("$2", "resolved_at")+` AND `+col("$2", "replay")+`,
  `+col("$2", "mode")+`,
  to_regclass($3) IS NOT NULL,
  `+col("$4", "ordering_key")+`, `+col("$4", "ordering_partition")+`, `+col("$4", "skipped_at"),
		t.PartitionsTable(), t.HoldsTable(), t.WALProgressTable(), t.Sanitize()).
		Scan(&f.partitions, &f.ordered, &f.holdsMode, &f.wal, &f.orderingKey, &f.orderingPartition, &f.skippedAt)
	if err != nil {
		return f, fmt.Errorf("switch the relay mode of %s: look up its tables: %w", t, err)
	}
	return f, nil
}

// settle marks published the rows mode from delivered and does not mark
// itself (see SwitchMode), and deletes from's resolved holds. It returns
// the rows marked.
func settle(ctx context.Context, tx pgx.Tx, t Table, from Mode, f switchFacts) (int64, error) {
	if from == ModeDefault {
		return 0, nil
	}
	var stmt string
	switch {
	case from == ModeOrdered && f.ordered && f.orderingKey:
		stmt = settleOrderedStatement(t, f.skippedAt)
	case from == ModeWAL && f.wal:
		stmt = settleWALStatement(t, f.skippedAt)
	default:
		return 0, nil // the mode's tables are gone: nothing it delivered is known
	}
	tag, err := tx.Exec(ctx, stmt)
	if err != nil {
		return 0, fmt.Errorf("switch %s from %s mode: mark published the rows it delivered: %w", t, from, err)
	}
	if f.ordered || (f.wal && f.orderingKey) {
		del := `DELETE FROM ` + t.HoldsTable() + ` WHERE resolved_at IS NOT NULL`
		if f.holdsMode {
			del += ` AND mode = '` + string(from) + `'`
		}
		if _, err := tx.Exec(ctx, del); err != nil {
			return 0, fmt.Errorf("switch %s from %s mode: delete its resolved holds: %w", t, from, err)
		}
	}
	return tag.RowsAffected(), nil
}

// settleOrderedStatement marks published the keyed rows ordered mode
// delivered: at or below their partition's written floor, or covered by a
// resolved hold of their key (its row and the rows before it were acked
// or skipped), and neither dead (a row that went dead under the default
// relay stays dead, below the floor or not) nor skipped. Run with no open
// hold.
func settleOrderedStatement(t Table, skippedAt bool) string {
	notSkipped := ``
	if skippedAt {
		notSkipped = ` AND o.skipped_at IS NULL`
	}
	return `UPDATE ` + t.Sanitize() + ` AS o SET published_at = now()
FROM ` + t.PartitionsTable() + ` AS p
WHERE p.partition = o.ordering_partition
  AND o.ordering_key IS NOT NULL AND o.published_at IS NULL AND o.dead_at IS NULL` + notSkipped + `
  AND (o.sequence <= p.floor_sequence OR EXISTS (SELECT 1 FROM ` + t.HoldsTable() + ` AS h
    WHERE h.ordering_key = o.ordering_key AND h.resolved_at IS NOT NULL AND o.sequence <= h.sequence))`
}

// settleWALStatement marks published the rows the WAL relay delivered:
// written (by their last insert or update) before the horizon every slot
// of the table confirmed, neither dead nor skipped. The WAL relay never
// marks a row published; a row is delivered once its transaction is older
// than the horizon and no hold parks it (none is open at a switch). Unlike
// the cleaner, an old horizon counts: what was delivered stays delivered.
// No horizon (a slot that confirmed nothing): nothing is marked, and the
// next relay delivers those rows again (duplicates, never a loss).
func settleWALStatement(t Table, skippedAt bool) string {
	notSkipped := ``
	if skippedAt {
		notSkipped = ` AND o.skipped_at IS NULL`
	}
	return `UPDATE ` + t.Sanitize() + ` AS o SET published_at = now()
WHERE o.published_at IS NULL AND o.dead_at IS NULL` + notSkipped + `
  AND age(o.xmin) > (SELECT age((min(horizon)::text::numeric % 4294967296)::text::xid) FROM ` + t.WALProgressTable() + `
    HAVING count(*) > 0 AND bool_and(horizon IS NOT NULL))`
}

// reopenBelowFloors lowers, on a switch into ordered mode, the floor of
// every partition that has a pending keyed row (not published, dead or
// skipped) at or below it, to just below its oldest such row, and returns
// the partitions lowered. Ordered mode reads only rows above the floors,
// and its state reader and cleaner take a keyed row at or below the floor
// for delivered; a row can be pending there after an earlier ordered era
// passed it: a row dead under the default relay and replayed while the
// table was relayed in another mode, or a row that mode had not delivered
// yet. The settle of the old mode has marked published every row it
// delivered, so the rows above the lowered floor that are not published
// are exactly the pending ones.
func reopenBelowFloors(ctx context.Context, tx pgx.Tx, t Table, f switchFacts) (int64, error) {
	if !f.partitions || !f.orderingKey || !f.orderingPartition {
		return 0, nil // no floors yet: ordered mode reads every row
	}
	notSkipped := ``
	if f.skippedAt {
		notSkipped = ` AND o.skipped_at IS NULL`
	}
	tag, err := tx.Exec(ctx, `UPDATE `+t.PartitionsTable()+` AS p SET floor_sequence = s.low - 1
FROM (SELECT o.ordering_partition AS part, min(o.sequence) AS low FROM `+t.Sanitize()+` AS o
  WHERE o.ordering_key IS NOT NULL AND o.published_at IS NULL AND o.dead_at IS NULL`+notSkipped+`
  GROUP BY o.ordering_partition) AS s
WHERE p.partition = s.part AND p.floor_sequence >= s.low`)
	if err != nil {
		return 0, fmt.Errorf("switch %s to ordered mode: lower the floors below its pending rows: %w", t, err)
	}
	return tag.RowsAffected(), nil
}

// dropSlots drops the inactive replication slots of t: the default slot
// and those its WAL progress table names.
func dropSlots(ctx context.Context, tx pgx.Tx, t Table) ([]string, error) {
	var progress bool
	if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, t.WALProgressTable()).Scan(&progress); err != nil {
		return nil, fmt.Errorf("switch %s from wal mode: look up its progress table: %w", t, err)
	}
	slots := `$1::text`
	if progress {
		slots = `$1::text UNION ALL SELECT slot FROM ` + t.WALProgressTable()
	}
	rows, err := tx.Query(ctx, `SELECT slot_name::text, pg_drop_replication_slot(slot_name) IS NULL FROM pg_replication_slots
WHERE NOT active AND database = current_database() AND slot_name IN (SELECT `+slots+`)`, WALSlotName(t))
	if err != nil {
		return nil, fmt.Errorf("switch %s from wal mode: drop its replication slots (the role needs the REPLICATION attribute): %w", t, err)
	}
	var dropped []string
	for rows.Next() {
		var name string
		var ignored bool
		if err := rows.Scan(&name, &ignored); err != nil {
			rows.Close()
			return nil, fmt.Errorf("switch %s from wal mode: drop its replication slots: %w", t, err)
		}
		dropped = append(dropped, name)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("switch %s from wal mode: drop its replication slots (the role needs the REPLICATION attribute): %w", t, err)
	}
	return dropped, nil
}
