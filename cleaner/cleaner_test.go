package cleaner_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/outboxkit/watermill-outbox/cleaner"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/metrics"
	"github.com/outboxkit/watermill-outbox/publisher"
)

// TestCleanerRetention: only rows the retentions allow are deleted; pending,
// locked, recently published and (without dead retention) dead rows stay;
// dead retention deletes by time of death (dead_at), not created_at.
func TestCleanerRetention(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "clean_outbox")
	ctx := context.Background()
	kinds := map[string]string{ // event kind -> SQL that puts a row in that state
		"old_published":    `published_at = now() - interval '200 hours'`,
		"recent_published": `published_at = now() - interval '1 hour'`,
		"pending":          `attempts = 0`,
		"retrying":         `attempts = 3, last_error = 'x', available_at = now() + interval '1 minute'`,
		"locked":           `attempts = 1, locked_at = now()`,
		"old_dead": `attempts = 25, last_error = 'x', available_at = 'infinity', created_at = now() - interval '200 hours',
			dead_at = now() - interval '100 hours'`,
		// Created long ago, dead only recently: dead retention counts from
		// the time of death, so it stays.
		"recent_dead": `attempts = 25, last_error = 'x', available_at = 'infinity', created_at = now() - interval '200 hours',
			dead_at = now() - interval '1 hour'`,
		// Many attempts, old, but still retrying (a relay with a higher
		// MaxAttempts): not dead, never deleted.
		"old_retrying": `attempts = 40, last_error = 'x', created_at = now() - interval '200 hours'`,
	}
	ids := map[string][]string{}
	for kind, set := range kinds {
		msgs := make([]publisher.Message, 7) // more than one batch of 5
		for i := range msgs {
			msgs[i] = publisher.Message{TenantID: uuid.New(), Topic: "org.clean.v1", EventID: uuid.New(), Payload: json.RawMessage(`{}`)}
			ids[kind] = append(ids[kind], msgs[i].EventID.String())
		}
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if _, err := publisher.EnqueueBatch(ctx, tx, tbl, msgs); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `UPDATE `+tbl.Sanitize()+` SET `+set+` WHERE event_id = ANY($1::uuid[])`, ids[kind])
			return err
		}); err != nil {
			t.Fatal(err)
		}
	}
	remaining := func() map[string]int {
		out := map[string]int{}
		for kind, list := range ids {
			var n int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+tbl.Sanitize()+` WHERE event_id = ANY($1::uuid[])`, list).Scan(&n); err != nil {
				t.Fatal(err)
			}
			out[kind] = n
		}
		return out
	}
	m, _ := metrics.New(nil)
	c, err := cleaner.New(pool, cleaner.Config{Table: tbl, BatchSize: 5, Metrics: m}, nil)
	if err != nil {
		t.Fatal(err)
	}
	pub, dead, err := c.CleanOnce(ctx)
	if err != nil || pub != 7 || dead != 0 {
		t.Fatalf("first pass: published %d dead %d err %v", pub, dead, err)
	}
	got := remaining()
	for kind, n := range got {
		want := 7
		if kind == "old_published" {
			want = 0
		}
		if n != want {
			t.Errorf("after default retention: %s has %d rows, want %d", kind, n, want)
		}
	}
	c, _ = cleaner.New(pool, cleaner.Config{Table: tbl, BatchSize: 5, DeadRetention: 48 * time.Hour, Metrics: m}, nil)
	if pub, dead, err = c.CleanOnce(ctx); err != nil || pub != 0 || dead != 7 {
		t.Fatalf("dead retention pass: published %d dead %d err %v", pub, dead, err)
	}
	got = remaining()
	for kind, n := range got {
		want := 7
		if kind == "old_published" || kind == "old_dead" {
			want = 0
		}
		if n != want {
			t.Errorf("after dead retention: %s has %d rows, want %d", kind, n, want)
		}
	}
	if v := testutil.ToFloat64(m.CleanerDeleted.WithLabelValues(tbl.Qualified(), "published")); v != 7 {
		t.Errorf("cleaner metric published = %v", v)
	}
	if v := testutil.ToFloat64(m.CleanerDeleted.WithLabelValues(tbl.Qualified(), "dead")); v != 7 {
		t.Errorf("cleaner metric dead = %v", v)
	}
	// Run stops when its context ends.
	rctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	if err := c.Run(rctx); err != nil {
		t.Fatal(err)
	}
}

// TestCleanerVacuum: with Vacuum on, a pass that deleted rows vacuums the
// table (for servers where autovacuum is off).
func TestCleanerVacuum(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "vacuum_outbox")
	ctx := context.Background()
	msgs := []publisher.Message{{TenantID: uuid.New(), Topic: "org.clean.v1", EventID: uuid.New(), Payload: json.RawMessage(`{}`)}}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := publisher.EnqueueBatch(ctx, tx, tbl, msgs); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `UPDATE `+tbl.Sanitize()+` SET published_at = now() - interval '200 hours'`)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	c, err := cleaner.New(pool, cleaner.Config{Table: tbl, Vacuum: true}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if pub, _, err := c.CleanOnce(ctx); err != nil || pub != 1 {
		t.Fatalf("clean: %d %v", pub, err)
	}
	deadline := time.Now().Add(2 * time.Minute)
	for {
		var vacuums int64
		if err := pool.QueryRow(ctx, `SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = $1::regclass`, tbl.Sanitize()).Scan(&vacuums); err != nil {
			t.Fatal(err)
		}
		if vacuums > 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the cleaner did not vacuum the table")
		}
		time.Sleep(100 * time.Millisecond)
	}
}
