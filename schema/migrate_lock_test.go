package schema_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
)

// TestMigrateBehindALongReaderDoesNotStallWriters: a REPEATABLE READ report
// that has read the outbox holds its ACCESS SHARE lock until it ends; a
// migration that needs ACCESS EXCLUSIVE (here 000009's ALTER) queues behind
// it, and every writer queues behind the migration while it waits. Each
// try of Migrate waits at most 200 ms for a lock, then backs off, so the
// writers keep committing, also when three processes migrate at once; when
// it gives up (here at its context's
// deadline) the error names the session that holds it back. It prints the
// worst writer stall. Before, each try waited 5 s (lock_timeout) with every
// writer blocked behind it, and the error said only "lock timeout".
//
// The verdict reads how long a writer waits for the table's lock, not how
// long its commit takes (which a loaded machine stretches): each writer
// sets lock_timeout 3 s, far above the migration's 200 ms and below the
// 4 s a try held the writers before (5 s, cut by Migrate's deadline here),
// and a writer that hits it fails the test.
func TestMigrateBehindALongReaderDoesNotStallWriters(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "migrate_reader_outbox")
	if _, err := pool.Exec(ctx, schema.AvailableAtDownSQL(tbl)); err != nil { // 000009 to do again
		t.Fatal(err)
	}
	// The long reader, under an application_name the error must show.
	cfg, err := pgx.ParseConfig(testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	app := fmt.Sprintf("report-43-%d", time.Now().UnixNano()%1_000_000)
	cfg.RuntimeParams["application_name"] = app
	reader, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = reader.Close(context.Background()) })
	if _, err := reader.Exec(ctx, `BEGIN ISOLATION LEVEL REPEATABLE READ`); err != nil {
		t.Fatal(err)
	}
	if _, err := reader.Exec(ctx, `SELECT count(*) FROM `+tbl.Sanitize()); err != nil {
		t.Fatal(err)
	}
	var readerPID int
	if err := reader.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&readerPID); err != nil {
		t.Fatal(err)
	}

	stop := make(chan struct{})
	var (
		wg        sync.WaitGroup
		worst     atomic.Int64
		n         atomic.Int64
		lockWaits atomic.Int64
	)
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			write(t, pool, tbl, stop, &worst, &n, &lockWaits)
		}()
	}
	time.Sleep(500 * time.Millisecond)
	baseline := time.Duration(worst.Swap(0)) // the writers' worst commit with no migration
	// Three processes migrate at once (each one at its start), one of them
	// the call below.
	mctx, cancel := context.WithTimeout(ctx, 4*time.Second)
	var others sync.WaitGroup
	for range 2 {
		others.Add(1)
		go func() {
			defer others.Done()
			_ = schema.Migrate(mctx, pool, tbl)
		}()
	}
	start := time.Now()
	err = schema.Migrate(mctx, pool, tbl)
	took := time.Since(start)
	others.Wait()
	cancel()
	time.Sleep(300 * time.Millisecond)
	close(stop)
	wg.Wait()
	stall := time.Duration(worst.Load())
	t.Logf("Migrate gave up after %s behind the reader: %d writer commits in all, worst writer stall %s (%s before the migration began); error: %v",
		took.Round(time.Millisecond), n.Load(), stall.Round(time.Millisecond), baseline.Round(time.Millisecond), err)
	if err == nil {
		t.Fatal("Migrate succeeded while a REPEATABLE READ reader held the table")
	}
	if msg := err.Error(); !strings.Contains(msg, app) || !strings.Contains(msg, fmt.Sprint(readerPID)) {
		t.Errorf("the error does not name the session that holds the table (pid %d, application_name %s): %v", readerPID, app, err)
	}
	// 200 ms per try; the margin is for a busy machine (each try blocked
	// writers for 5 s before).
	if w := lockWaits.Load(); w > 0 {
		t.Errorf("%d times a writer waited over %s for the table's lock behind the waiting migration, want at most about 200 ms", w, writerLockTimeout)
	}
	// Once the reader ends, Migrate goes through.
	if _, err := reader.Exec(ctx, `COMMIT`); err != nil {
		t.Fatal(err)
	}
	if err := schema.Migrate(ctx, pool, tbl); err != nil {
		t.Fatalf("Migrate after the reader ended: %v", err)
	}
}

// writerLockTimeout bounds each writer's wait for a lock in write.
const writerLockTimeout = 3 * time.Second

// write enqueues one event per transaction until stop, recording the
// slowest commit (begin to commit) in worst, and in lockWaits the
// transactions that waited writerLockTimeout for a lock (and gave up).
func write(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, stop <-chan struct{}, worst, n, lockWaits *atomic.Int64) {
	ctx := context.Background()
	for {
		select {
		case <-stop:
			return
		default:
		}
		start := time.Now()
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `SELECT set_config('lock_timeout', $1, true)`, fmt.Sprintf("%dms", writerLockTimeout.Milliseconds())); err != nil {
				return err
			}
			_, err := publisher.Enqueue(ctx, tx, tbl, publisher.Message{TenantID: uuid.New(), Topic: "org.migrate.v1", EventID: uuid.New(), Payload: json.RawMessage(`{}`)})
			return err
		})
		if pgErr := (*pgconn.PgError)(nil); errors.As(err, &pgErr) && pgErr.Code == "55P03" { // lock_not_available
			lockWaits.Add(1)
			continue
		}
		if err != nil {
			t.Error(err)
			return
		}
		d := int64(time.Since(start))
		for {
			w := worst.Load()
			if d <= w || worst.CompareAndSwap(w, d) {
				break
			}
		}
		n.Add(1)
		time.Sleep(5 * time.Millisecond)
	}
}
