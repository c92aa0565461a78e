package schema

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/outboxkit/watermill-outbox/internal/pgmeta"
)

// A table's relay mode is recorded in a companion table, <table>_mode (one
// row; migration 000010), written by the explicit steps that choose it
// (Migrate with WithMode, `outbox migrate --ordered|--wal|--mode=default`)
// and by every relay that starts on the table (the default and ordered
// relays once they hold their mode's lock, the WAL relay at Setup and at
// start). Every reader of state reads the record; a table without one (no
// record yet, or a table migrated by an earlier version) falls back to
// the mode inferred from what exists (ModeProbe, DecideMode).

// suffixMode names the companion table that records the relay mode.
const suffixMode = "_mode"

// modeRecordedByMaxBytes bounds who recorded a mode (a CHECK of the mode
// table; longer names are cut).
const modeRecordedByMaxBytes = 200

// ErrNoModeTable is matched (errors.Is) by the error of RecordMode when
// the table that records the relay mode of an outbox table does not exist:
// migration 000010 (Migrate, `outbox migrate`) creates it. Readers then
// infer the mode from what exists.
var ErrNoModeTable = errors.New("the table that records the relay mode does not exist (migration 000010)")

// modeTable names the companion table that records t's relay mode,
// sanitized for SQL.
func (t Table) modeTable() string { return t.companion(suffixMode) }

// modeStatement creates the mode table of t, idempotently, with the lease
// duration the table relays record (lock_ttl_ms, lockttl.go). It does not
// lock t.
func modeStatement(t Table) string { return modeTableStatement(t, true) }

// modeTableStatement creates the mode table of t, with lock_ttl_ms when
// lockTTL is set (without it, as migration 000010 shipped it).
func modeTableStatement(t Table, lockTTL bool) string {
	ttl := ""
	if lockTTL {
		ttl = ",\n  " + lockTTLColumn + " BIGINT      NULL"
	}
	return `CREATE TABLE IF NOT EXISTS ` + t.modeTable() + ` (
  singleton   BOOLEAN     NOT NULL DEFAULT true PRIMARY KEY CHECK (singleton),
  mode        TEXT        NOT NULL CHECK (mode IN ('` + string(ModeDefault) + `', '` + string(ModeOrdered) + `', '` + string(ModeWAL) + `')),
  recorded_at TIMESTAMPTZ NOT NULL DEFAULT now(),
  recorded_by TEXT        NOT NULL DEFAULT '' CHECK (octet_length(recorded_by) <= ` + itoa(modeRecordedByMaxBytes) + `)` + ttl + `
)`
}

// ModeUpSQL returns the DDL that creates the table recording the relay
// mode of an existing table t (idempotent; the shipped migration 000010,
// kept as shipped: 000014 adds lock_ttl_ms). Until a mode is recorded in
// it, readers infer the mode as before.
func modeUpSQL(t Table) string { return modeTableStatement(t, false) + ";\n" }

// ModeDownSQL reverts ModeUpSQL: readers infer the table's mode from what
// exists again.
func modeDownSQL(t Table) string { return `DROP TABLE IF EXISTS ` + t.modeTable() + ";\n" }

// Valid reports whether m is one of the relay modes.
func (m Mode) Valid() bool {
	switch m {
	case ModeDefault, ModeOrdered, ModeWAL:
		return true
	}
	return false
}

// ModeRecord is the relay mode recorded for a table.
type ModeRecord struct {
	// Mode is the recorded mode.
	Mode Mode
	// RecordedAt is when it was recorded, RecordedBy who recorded it
	// ("migrate", "default relay", "ordered relay", "WAL relay", ...).
	RecordedAt time.Time
	RecordedBy string
	// LockTTL is the lease duration (LockTTL) of the table relay (default
	// or ordered) that started on the table last, which records it at
	// start whatever recorded the mode; 0 when none is recorded (no
	// table relay of this version started since the mode table had
	// lock_ttl_ms, migration 000014).
	LockTTL time.Duration
}

// RecordedMode returns the relay mode recorded for t; ok is false when
// none is (nothing recorded yet, or t has no mode table: a table migrated
// by an earlier version).
func RecordedMode(ctx context.Context, q Querier, t Table) (rec ModeRecord, ok bool, err error) {
	if ok, err = modeTableExists(ctx, q, t); err != nil || !ok {
		return ModeRecord{}, false, err
	}
	var (
		m  string
		ms *int64
	)
	// lock_ttl_ms is read through the row's JSON, so that a mode table
	// without it (before migration 000014) reads as recording none.
	err = q.QueryRow(ctx, `SELECT m.mode, m.recorded_at, m.recorded_by, (to_jsonb(m) ->> '`+lockTTLColumn+`')::bigint FROM `+t.modeTable()+` AS m`).
		Scan(&m, &rec.RecordedAt, &rec.RecordedBy, &ms)
	if errors.Is(err, pgx.ErrNoRows) {
		return ModeRecord{}, false, nil
	}
	if err != nil {
		return ModeRecord{}, false, fmt.Errorf("read the relay mode of %s: %w", t, err)
	}
	rec.Mode = Mode(m)
	if ms != nil && *ms > 0 {
		rec.LockTTL = time.Duration(*ms) * time.Millisecond
	}
	if !rec.Mode.Valid() {
		return ModeRecord{}, false, fmt.Errorf("read the relay mode of %s: unknown mode %q", t, m)
	}
	return rec, true, nil
}

func modeTableExists(ctx context.Context, q Querier, t Table) (bool, error) {
	var ok bool
	if err := q.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, t.modeTable()).Scan(&ok); err != nil {
		return false, fmt.Errorf("look up the relay mode of %s: %w", t, err)
	}
	return ok, nil
}

// recordModeStatement records m as t's mode in SQL, for UpSQL.
func recordModeStatement(t Table, m Mode) string {
	return `INSERT INTO ` + t.modeTable() + ` AS r (mode, recorded_by) VALUES ('` + string(m) + `', 'migration')
ON CONFLICT (singleton) DO UPDATE SET mode = EXCLUDED.mode, recorded_at = now(), recorded_by = EXCLUDED.recorded_by
  WHERE r.mode IS DISTINCT FROM EXCLUDED.mode`
}

// CheckModeSwitch fails with ErrRelayModeMix when a relay of a mode other
// than m may work on t, naming what shows it: a session holding the
// default or the ordered relays' mode lock, a
// live partition lease of an ordered relay, or an active replication slot
// of the table (the default slot, or one its WAL progress table names).
// Relays of m itself are not looked for.
func checkModeSwitch(ctx context.Context, q Querier, t Table, m Mode) error {
	fix := "stop them first (then the relay of " + string(m) + " mode may start), or keep the table's mode"
	for _, ordered := range []bool{false, true} {
		if (ordered && m == ModeOrdered) || (!ordered && m == ModeDefault) {
			continue
		}
		holder, err := pgmeta.Holder(ctx, q, pgmeta.RelayMode(t.Qualified(), ordered))
		if err != nil {
			return fmt.Errorf("look up the relays of %s: %w", t, err)
		}
		if holder != "" {
			return fmt.Errorf("%s relay is subscribed to %s (%s); %s: %w", modeName(ordered), t, holder, fix, ErrRelayModeMix)
		}
	}
	if m != ModeWAL {
		holder, err := pgmeta.Holder(ctx, q, pgmeta.WALRelay(t.Qualified()))
		if err != nil {
			return fmt.Errorf("look up the relays of %s: %w", t, err)
		}
		if holder != "" {
			return fmt.Errorf("a WAL relay is subscribed to %s (%s); %s: %w", t, holder, fix, ErrRelayModeMix)
		}
	}
	var live, slot bool
	var slotName string
	err := q.QueryRow(ctx, `SELECT
  to_regclass($1) IS NOT NULL AND (SELECT count(*) FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname IN ('owner', 'lease_until') AND NOT attisdropped) = 2,
  to_regclass($2) IS NOT NULL`, t.PartitionsTable(), t.WALProgressTable()).Scan(&live, &slot)
	if err != nil {
		return fmt.Errorf("look up the relays of %s: %w", t, err)
	}
	if live && m != ModeOrdered {
		if err := q.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+t.PartitionsTable()+` WHERE owner IS NOT NULL AND lease_until > now())`).Scan(&live); err != nil {
			return fmt.Errorf("look up the ordered relays of %s: %w", t, err)
		}
		if live {
			return fmt.Errorf("ordered relays own partitions of %s; %s: %w", t, fix, ErrRelayModeMix)
		}
	}
	if m == ModeWAL {
		return nil
	}
	slots := `$1::text`
	if slot {
		slots = `$1::text UNION ALL SELECT slot FROM ` + t.WALProgressTable()
	}
	err = q.QueryRow(ctx, `SELECT slot_name::text FROM pg_replication_slots
WHERE active AND database = current_database() AND slot_name IN (SELECT `+slots+`) LIMIT 1`, WALSlotName(t)).Scan(&slotName)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return nil
	case err != nil:
		return fmt.Errorf("look up the WAL relays of %s: %w", t, err)
	}
	return fmt.Errorf("a WAL relay streams %s (replication slot %s is active); %s: %w", t, slotName, fix, ErrRelayModeMix)
}
