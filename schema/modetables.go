package schema

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Each mode has the companion tables it reads and writes, and no others
// (docs/ARCHITECTURE.md, "The table"):
//
//   - every table (Migrate creates them): <table>_mode (the relay mode and
//     the relays' lock TTL), <table>_paused_topics, <table>_dead_notices
//     and <table>_replay_jobs: what the default relay and the operator
//     surfaces (runbook, CLI, console, cleaner, gauges) read and write;
//   - ordered mode adds <table>_partitions (leases and floors),
//     <table>_relays (membership) and <table>_holds (held keys);
//   - the WAL relay adds <table>_holds (and walrelay.Setup its progress
//     table <table>_wal, publication and slot).
//
// The keyed modes' tables come with the switch to the mode (SwitchMode:
// Migrate's WithMode, `outbox migrate --mode`, walrelay.Setup and every
// relay's start), by the DDL of their migrations (orderedCompanionStatements,
// holdsTableStatements); Migrate keeps those a table has in this version's
// shape. A switch away from a keyed mode keeps them (the state they hold is
// settled into the rows' columns; they are read again if the table comes
// back to the mode).

// keyedTablesStatements returns the DDL that gives t the companion tables
// mode m needs (ordered: partitions, relays and holds; wal: holds) that it
// lacks or has in an older version's shape; none when t has them all, or m
// is the default mode. The statements are idempotent and lock only the
// companion tables, never t.
func keyedTablesStatements(ctx context.Context, q Querier, t Table, m Mode) ([]string, error) {
	if m != ModeOrdered && m != ModeWAL {
		return nil, nil
	}
	// The partitions' term (migration 000006) and the holds' state column
	// (000011, over 000005) are the last objects of their tables' DDL.
	var partitions, relays, holds bool
	err := q.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = 'epoch' AND NOT attisdropped),
  to_regclass($2) IS NOT NULL,
  EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($3) AND attname = 'state' AND NOT attisdropped)`,
		t.PartitionsTable(), t.RelaysTable(), t.HoldsTable()).Scan(&partitions, &relays, &holds)
	if err != nil {
		return nil, fmt.Errorf("look up the companion tables of %s: %w", t, err)
	}
	switch {
	case m == ModeOrdered && (!partitions || !relays || !holds):
		return orderedCompanionStatements(t), nil
	case m == ModeWAL && !holds:
		return holdsTableStatements(t), nil
	}
	return nil, nil
}

// keyedTableNames names the companion tables mode m adds, for messages.
func keyedTableNames(t Table, m Mode) string {
	if m == ModeOrdered {
		return strings.Join([]string{t.PartitionsTable(), t.RelaysTable(), t.HoldsTable()}, ", ")
	}
	return t.HoldsTable()
}

// createKeyedTables runs in tx the DDL keyedTablesStatements returns for
// t and mode to (from: the mode t leaves, for the message). A role that may
// not create tables in t's schema (or alter the ones it has) gets an error
// that names the fix: run the switch once as one that may.
func createKeyedTables(ctx context.Context, tx pgx.Tx, t Table, from, to Mode) error {
	stmts, err := keyedTablesStatements(ctx, tx, t, to)
	if err != nil {
		return fmt.Errorf("switch %s from %s to %s mode: %w", t, from, to, err)
	}
	for _, stmt := range stmts {
		if _, err := tx.Exec(ctx, stmt); err != nil {
			fix := ""
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == "42501" { // insufficient_privilege
				fix = fmt.Sprintf("; this role may not create them: run `outbox migrate --mode=%s --table=%s` once as a role that may (the table's owner)", to, t)
			}
			return fmt.Errorf("switch %s from %s to %s mode: create the tables %s mode needs (%s): %w%s; nothing changed",
				t, from, to, to, keyedTableNames(t, to), err, fix)
		}
	}
	return nil
}

// keyedTablesOfMode is keyedTablesStatements for the mode of t that
// Migrate keeps up: m when asked (WithMode), else the recorded mode, else
// the mode inferred from what exists (a table migrated by an earlier
// version, whose ordered tables Migrate brings to this version's shape).
func keyedTablesOfMode(ctx context.Context, tx pgx.Tx, t Table, m Mode) ([]string, error) {
	if m == "" {
		rec, recorded, err := RecordedMode(ctx, tx, t)
		if err != nil {
			return nil, err
		}
		if m = rec.Mode; !recorded {
			if m, err = inferMode(ctx, tx, t); err != nil {
				return nil, err
			}
		}
	}
	return keyedTablesStatements(ctx, tx, t, m)
}
