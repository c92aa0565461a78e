// Package cleaner deletes what an outbox table no longer needs: rows
// published (or skipped by an operator) longer ago than a retention and,
// when asked, dead rows that died longer ago than a dead retention (by
// dead_at, the time of death). It deletes in bounded batches, each its
// own short statement, and never touches pending or recently published rows.
package cleaner

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/state"
	"github.com/outboxkit/watermill-outbox/metrics"
	"github.com/outboxkit/watermill-outbox/schema"
)

// Defaults of Config; the daemon reads them from OUTBOX_CLEANER_*.
const (
	IntervalDefault        = time.Minute
	RetentionDefault       = 168 * time.Hour
	DeleteBatchSizeDefault = 1000
)

// Config configures a Cleaner.
type Config struct {
	// Table is the outbox table. Required.
	Table schema.Table
	// Interval is the pause between cleaning passes. Defaults to 1m.
	Interval time.Duration
	// Retention keeps published rows this long after published_at, and
	// the rows an operator skipped (runbook.Runbook.SkipEvent) this long
	// after skipped_at: a skipped row is done, deleted like a delivered
	// one, never by DeadRetention. Defaults to 168h.
	Retention time.Duration
	// DeadRetention, when positive, also deletes dead rows (dead_at set)
	// that died longer ago than it, however old they are, except the row a
	// held key waits for (ordered mode, the WAL relay): that key waits for
	// an operator's replay or skip. Defaults to 0: dead rows are kept for
	// replay.
	DeadRetention time.Duration
	// BatchSize bounds the rows one DELETE removes. Defaults to
	// DeleteBatchSizeDefault (1000).
	BatchSize int
	// Metrics counts deleted rows (outbox_cleaner_deleted_total). Defaults
	// to nil.
	Metrics *metrics.Metrics
	// Vacuum runs VACUUM (ANALYZE) on the table after a pass that deleted
	// rows, so their space is reused. Leave it off where autovacuum runs (the
	// PostgreSQL default); turn it on where autovacuum is disabled, or the
	// table grows without bound. Defaults to false.
	Vacuum bool
}

// Cleaner cleans one outbox table.
type Cleaner struct {
	pool   *pgxpool.Pool
	cfg    Config
	q      *sqlq.Queries
	logger watermill.LoggerAdapter
}

// New returns a Cleaner for cfg.Table.
func New(pool *pgxpool.Pool, cfg Config, logger watermill.LoggerAdapter) (*Cleaner, error) {
	if pool == nil {
		return nil, errors.New("cleaner: nil pool")
	}
	if cfg.Table.IsZero() {
		return nil, errors.New("cleaner: invalid config: Table is required")
	}
	if cfg.Interval == 0 {
		cfg.Interval = IntervalDefault
	}
	if cfg.Retention == 0 {
		cfg.Retention = RetentionDefault
	}
	if cfg.BatchSize == 0 {
		cfg.BatchSize = DeleteBatchSizeDefault
	}
	if cfg.Interval < 0 || cfg.Retention < 0 || cfg.DeadRetention < 0 || cfg.BatchSize < 0 {
		return nil, errors.New("cleaner: invalid config: negative Interval, Retention, DeadRetention or BatchSize; leave 0 for the defaults")
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return &Cleaner{pool: pool, cfg: cfg, q: sqlq.NewQueries(cfg.Table, schema.Columns{}),
		logger: logger.With(watermill.LogFields{"table": cfg.Table.String(), "component": "cleaner"})}, nil
}

// Run cleans every Interval until ctx is done; it returns nil then.
func (c *Cleaner) Run(ctx context.Context) error {
	t := time.NewTicker(c.cfg.Interval)
	defer t.Stop()
	for {
		if published, dead, err := c.CleanOnce(ctx); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			c.logger.Error("Cleaning pass failed; retrying next interval", err, nil)
		} else if published+dead > 0 {
			c.logger.Info("Cleaned outbox table", watermill.LogFields{"published_deleted": published, "dead_deleted": dead})
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// CleanOnce deletes, batch by batch, every row the retentions allow, and
// returns how many done rows (published, delivered or skipped: Retention)
// and dead rows (DeadRetention) it deleted.
func (c *Cleaner) CleanOnce(ctx context.Context) (published, dead int64, err error) {
	published, err = c.deleteAll(ctx, "published", c.q.DeletePublished, c.cfg.Retention.Seconds(), c.cfg.BatchSize)
	if err != nil {
		return published, 0, err
	}
	// What else is done depends on where the table's mode keeps a row's
	// state: the one state reader every reader uses (internal/state).
	st, err := state.Of(ctx, c.pool, c.cfg.Table)
	if err != nil {
		return published, 0, fmt.Errorf("clean %s: %w", c.cfg.Table, err)
	}
	var done int64
	switch st.Mode {
	case schema.ModeOrdered:
		done, err = c.cleanKeyed(ctx, st.StateQueries)
	case schema.ModeWAL:
		done, err = c.cleanWAL(ctx, st.StateQueries)
	}
	published += done
	if err != nil {
		return published, 0, err
	}
	// A skipped row is done like a delivered one: deleted by Retention
	// after skipped_at, never by DeadRetention.
	if q := st.DeleteSkipped(); q != "" {
		done, err = c.deleteAll(ctx, "published", q, c.cfg.Retention.Seconds(), c.cfg.BatchSize)
		published += done
		if err != nil {
			return published, 0, err
		}
	}
	if c.cfg.DeadRetention <= 0 {
		if c.cfg.Vacuum && published > 0 {
			err = c.vacuum(ctx)
		}
		return published, 0, err
	}
	dead, err = c.deleteAll(ctx, "dead", st.DeleteDead(), c.cfg.DeadRetention.Seconds(), c.cfg.BatchSize)
	if err == nil && c.cfg.Vacuum && published+dead > 0 {
		err = c.vacuum(ctx)
	}
	return published, dead, err
}

func (c *Cleaner) vacuum(ctx context.Context) error {
	if _, err := c.pool.Exec(ctx, sqlq.VacuumStatement(c.cfg.Table)); err != nil {
		return fmt.Errorf("vacuum %s: %w", c.cfg.Table, err)
	}
	return nil
}

func (c *Cleaner) deleteAll(ctx context.Context, kind, query string, args ...any) (int64, error) {
	var total int64
	for {
		tag, err := c.pool.Exec(ctx, query, args...)
		if err != nil {
			return total, fmt.Errorf("clean %s rows of %s: %w", kind, c.cfg.Table, err)
		}
		n := tag.RowsAffected()
		total += n
		if m := c.cfg.Metrics; m != nil && n > 0 {
			m.CleanerDeleted.WithLabelValues(c.cfg.Table.Qualified(), kind).Add(float64(n))
		}
		if n < int64(c.cfg.BatchSize) {
			return total, nil
		}
	}
}

// cleanKeyed deletes, in an ordered table, the keyed rows at or below their
// partition's floor (relayed; such rows are never marked published) that are
// older than Retention, never a row a held key still waits for or any row
// after it (docs/ORDERING.md).
func (c *Cleaner) cleanKeyed(ctx context.Context, sq sqlq.StateQueries) (int64, error) {
	oq := sqlq.NewOrderedQueries(c.cfg.Table, sq.Columns)
	return c.deleteAll(ctx, "published", oq.DeleteDone, c.cfg.Retention.Seconds(), c.cfg.BatchSize)
}

// cleanWAL deletes, in a table the WAL relay streams, the rows the relay
// delivered (it never marks them published) that are older than
// Retention: those written by transactions older than the horizon every
// slot has recorded in the last sqlq.WALStaleAfter (docs/WAL.md,
// "Retention"), except the rows parked behind a held key, which the relay
// delivers once the key's dead row is replayed or skipped
// (sqlq.StateQueries.DeleteStreamed).
func (c *Cleaner) cleanWAL(ctx context.Context, sq sqlq.StateQueries) (int64, error) {
	return c.deleteAll(ctx, "published", sq.DeleteStreamed(), c.cfg.Retention.Seconds(), c.cfg.BatchSize)
}
