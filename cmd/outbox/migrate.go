package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/walrelay"
)

func init() {
	registerCommand("migrate", "create outbox tables (--table or OUTBOX_RELAY_TABLES); --print shows the up SQL only (--down adds the down SQL, commented out); --create-schema for a new schema; --ordered or --wal set the table up for that relay mode and record it, --mode=default records the default mode", runMigrate)
}

func runMigrate(ctx context.Context, env Env, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("migrate", flag.ContinueOnError)
	fs.SetOutput(stderr)
	table := fs.String("table", "", "outbox table, such as public.org_outbox (default: OUTBOX_RELAY_TABLES)")
	trace := fs.Bool("trace", false, "add the optional traceparent and tracestate columns")
	headers := fs.Bool("headers", false, "add the optional headers column")
	ordered := fs.Bool("ordered", false, "add the ordering_key column, and switch the table to ordered mode (which adds its companion tables) unless relays of another mode run; with --wal only the column (default: OUTBOX_RELAY_ORDERED)")
	wal := fs.Bool("wal", false, "also create the WAL relay's publication, replication slot and progress table, and record wal as the table's mode (needs wal_level = logical and a REPLICATION role; default: OUTBOX_RELAY_SOURCE=wal)")
	modeFlag := fs.String("mode", "", "switch the table's relay mode: default, ordered (as --ordered) or wal (as --wal), from any mode: the rows the old mode delivered are marked published, dead and skipped rows stay as they are; refused while relays of another mode run or any key is held (`outbox keys held`). A new table is recorded as default; a relay records its own mode when it starts")
	rewrite := fs.Bool("rewrite", false, "with --ordered on an existing table of more than 10,000 rows: allow the table rewrite that adding the ordering columns needs (it blocks the table meanwhile)")
	createSchema := fs.Bool("create-schema", false, "create the table's schema if it does not exist (otherwise a missing schema is an error)")
	printSQL := fs.Bool("print", false, "print the up migration's SQL instead of running it (safe to pipe into psql)")
	down := fs.Bool("down", false, "with --print: also print the down migration, every line commented out (it drops the table and every event in it); never run by outbox")
	if err := parseFlags(fs, args, "outbox migrate [--table=T] [flags]",
		helpVar{"OUTBOX_RELAY_TABLES", "-", "the tables to migrate when --table is not given (comma-separated, such as public.org_outbox)"},
		helpVar{"OUTBOX_RELAY_ORDERED", "false", "true: as --ordered"},
		helpVar{"OUTBOX_RELAY_SOURCE", "table", "wal: as --wal"}); err != nil {
		return err
	}
	var tables []schema.Table
	if *table != "" {
		t, err := schema.ParseTable(*table)
		if err != nil {
			return fmt.Errorf("%w: --table: %w", errUsage, err)
		}
		tables = []schema.Table{t}
	} else {
		var err error
		if tables, err = env.Tables("OUTBOX_RELAY_TABLES", nil); err != nil {
			return fmt.Errorf("%w: %w", errUsage, err)
		}
		if len(tables) == 0 {
			return fmt.Errorf("%w: no table: pass --table=public.org_outbox or set OUTBOX_RELAY_TABLES", errUsage)
		}
	}
	var opts []schema.MigrateOption
	if *createSchema {
		opts = append(opts, schema.WithCreateSchema())
	}
	if *trace {
		opts = append(opts, schema.WithTraceColumns())
	}
	if *headers {
		opts = append(opts, schema.WithHeadersColumn())
	}
	envOrdered, err := env.Bool("OUTBOX_RELAY_ORDERED", false)
	if err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	wantOrdered := *ordered || envOrdered
	mode := schema.Mode(*modeFlag)
	switch {
	case mode != "" && !mode.Valid():
		return fmt.Errorf("%w: --mode=%q: use default, ordered or wal", errUsage, *modeFlag)
	case mode == schema.ModeDefault && (*ordered || *wal):
		return fmt.Errorf("%w: --mode=default excludes --ordered and --wal; keep one", errUsage)
	case mode == schema.ModeOrdered && *wal:
		return fmt.Errorf("%w: --mode=ordered excludes --wal; keep one", errUsage)
	case mode == schema.ModeWAL && *ordered:
		return fmt.Errorf("%w: --mode=wal excludes --ordered; keep one", errUsage)
	case mode == schema.ModeOrdered:
		wantOrdered = true
		opts = append(opts, schema.WithMode(schema.ModeOrdered))
	case mode == schema.ModeDefault:
		wantOrdered = false
		opts = append(opts, schema.WithMode(schema.ModeDefault))
	case mode == schema.ModeWAL:
		*wal = true
	}
	if wantOrdered {
		opts = append(opts, schema.WithOrderingKeyColumn())
	}
	if *rewrite {
		opts = append(opts, schema.WithTableRewrite())
	}
	if env.String("OUTBOX_RELAY_SOURCE", "") == "wal" && mode == "" {
		*wal = true
	}
	if *down && !*printSQL {
		return fmt.Errorf("%w: --down only prints the down migration (with --print); outbox never runs it", errUsage)
	}
	if *printSQL {
		popts := opts
		if wantOrdered && mode == "" && !*wal {
			// What `outbox migrate --ordered` does: the columns, then the
			// switch to ordered mode, which adds its companion tables.
			popts = append(popts[:len(popts):len(popts)], schema.WithMode(schema.ModeOrdered))
		}
		for _, t := range tables {
			fmt.Fprintf(stdout, "-- up: %s\n%s", t, schema.UpSQL(t, popts...))
			if *wal {
				n := walrelay.DefaultNames(t)
				fmt.Fprintf(stdout, "\n-- WAL relay of %s: progress and holds tables\n%s;\n\n%s;\n\n%s", t,
					sqlq.WALCreateProgressTable(t), strings.TrimSuffix(strings.TrimSpace(sqlq.WALCreateHoldsTable(t)), ";"),
					commentOut(fmt.Sprintf("Run once (outbox migrate --wal does it, checking first), by a role with REPLICATION, on wal_level = logical:\n%s;\n%s;",
						sqlq.WALCreatePublication(n.Publication, t), strings.Replace(sqlq.WALCreateSlot, "$1", "'"+n.Slot+"'", 1))))
			}
			if *down {
				fmt.Fprintf(stdout, "\n%s", commentOut(fmt.Sprintf("down (DESTRUCTIVE: drops %s, its companion tables and every event in them).\n"+
					"Every line is commented out so that piping this output into psql drops nothing;\n"+
					"uncomment it on purpose, in a migration tool's down file.\n%s", t, schema.DownSQL(t))))
			}
		}
		return nil
	}
	url, err := env.Required("OUTBOX_DATABASE_URL", "postgres://user:password@host:5432/db")
	if err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return fmt.Errorf("%w: OUTBOX_DATABASE_URL is not a valid PostgreSQL URL or DSN: %s", errUsage, parseProblem(err))
	}
	defer pool.Close()
	timeout := time.Minute
	if *rewrite {
		timeout = 24 * time.Hour // a rewrite takes as long as the table needs
	}
	mctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for _, t := range tables {
		before, _ := recordedModeOf(mctx, pool, t)
		if err := schema.Migrate(mctx, pool, t, opts...); err != nil {
			return err
		}
		if wantOrdered {
			// --ordered records the mode, which adds ordered mode's tables,
			// unless relays of another mode still run: they are stopped
			// after the columns are added, and the first ordered relay's
			// start switches then. With --wal the columns key the WAL
			// relay's rows, and walrelay.Setup records its mode below.
			var refused error
			switched := mode == schema.ModeOrdered
			if mode == "" && !*wal {
				err := schema.SwitchMode(mctx, pool, t, schema.ModeOrdered, "outbox migrate --ordered")
				switch {
				case errors.Is(err, schema.ErrRelayModeMix):
					refused = err
				case err != nil && !errors.Is(err, schema.ErrNoModeTable):
					return err
				default:
					switched = err == nil
				}
			}
			// Never a silent success: check that ordered mode is in place.
			cols, err := schema.DetectColumns(mctx, pool, t)
			if err != nil {
				return err
			}
			ok := true
			if switched {
				if ok, err = sqlq.OrderedTablesExist(mctx, pool, t); err != nil {
					return err
				}
				if ok {
					if ok, err = sqlq.OrderedTermExists(mctx, pool, t); err != nil {
						return err
					}
				}
			}
			if !cols.OrderingKey || !ok {
				return fmt.Errorf("migrate %s: ordered mode is still missing after the migration (ordering_key column %v, companion tables %v); run this SQL:\n%s",
					t, cols.OrderingKey, ok, schema.OrderedUpgradeSQL(t))
			}
			if switched {
				fmt.Fprintf(stdout, "migrated %s (ordered mode: ordering_key column, its indexes and the companion tables %s, %s, %s in place)\n",
					t, t.PartitionsTable(), t.RelaysTable(), t.HoldsTable())
			} else {
				fmt.Fprintf(stdout, "migrated %s (ordering_key column and its indexes in place)\n", t)
			}
			if refused != nil {
				fmt.Fprintf(stdout, "mode of %s not recorded as ordered yet: %v\nthe first ordered relay records it, and creates ordered mode's tables %s, %s, %s, "+
					"once they are stopped (or run `outbox migrate --mode=ordered --table=%s` then)\n", t, refused, t.PartitionsTable(), t.RelaysTable(), t.HoldsTable(), t)
			}
		} else {
			fmt.Fprintf(stdout, "migrated %s\n", t)
		}
		if mode != "" && mode != schema.ModeWAL {
			fmt.Fprintf(stdout, "recorded %s as relayed in %s mode\n", t, mode)
		}
		if *wal {
			n, err := walrelay.Setup(mctx, pool, t, walrelay.Names{})
			if err != nil {
				return err
			}
			fmt.Fprintf(stdout, "set up the WAL relay of %s: publication %s, slot %s, progress table %s; recorded as relayed in wal mode\n", t, n.Publication, n.Slot, t.WALProgressTable())
		}
		if after, ok := recordedModeOf(mctx, pool, t); ok && before != "" && after != before {
			fmt.Fprintf(stdout, "switched %s from %s to %s mode: the rows %s mode delivered are marked published, its dead and skipped rows kept as they were\n",
				t, before, after, before)
			if before == schema.ModeWAL {
				fmt.Fprintf(stdout, "dropped the replication slot of %s (its publication %s and progress table stay until walrelay.Teardown)\n",
					t, walrelay.DefaultNames(t).Publication)
			}
		}
	}
	return nil
}

// recordedModeOf is t's recorded relay mode, if any (ok false when none is
// recorded or t does not exist yet).
func recordedModeOf(ctx context.Context, pool *pgxpool.Pool, t schema.Table) (schema.Mode, bool) {
	rec, ok, err := schema.RecordedMode(ctx, pool, t)
	if err != nil || !ok {
		return "", false
	}
	return rec.Mode, true
}

// commentOut prefixes every line of sql with "-- ", so that no statement of
// it runs when the text is fed to psql.
func commentOut(sql string) string {
	var b strings.Builder
	for _, line := range strings.Split(strings.TrimRight(sql, "\n"), "\n") {
		b.WriteString("-- ")
		b.WriteString(line)
		b.WriteString("\n")
	}
	return b.String()
}
