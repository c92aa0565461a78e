package runbook_test

import (
	"context"
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
)

var (
	tenantA = uuid.MustParse("0d9b6a7e-1c1e-4b8e-9a0e-3f1f7b6f2a10")
	tenantB = uuid.MustParse("7c0f7d4e-5b0a-4c55-8a3e-2b1d9f0e6c21")
)

// enqueue commits one event per topic, in order, for tenant, and returns
// their event_ids. With then, it runs in the same transaction after the
// enqueue (to make rows dead before any relay can see them).
func enqueue(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, tenant uuid.UUID, topics []string, then func(tx pgx.Tx, ids []uuid.UUID) error) []uuid.UUID {
	t.Helper()
	ctx := context.Background()
	msgs := make([]publisher.Message, len(topics))
	ids := make([]uuid.UUID, len(topics))
	for i, topic := range topics {
		ids[i] = uuid.New()
		msgs[i] = publisher.Message{TenantID: tenant, Topic: topic, EventID: ids[i], Payload: json.RawMessage(`{"n":1}`)}
	}
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := publisher.EnqueueBatch(ctx, tx, tbl, msgs); err != nil {
			return err
		}
		if then != nil {
			return then(tx, ids)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

// repeat returns n copies of topic.
func repeat(topic string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = topic
	}
	return out
}

// replaceTable puts the sanitized table where sql says %s.
func replaceTable(sql string, tbl schema.Table) string {
	return strings.ReplaceAll(sql, "%s", tbl.Sanitize())
}

// exec runs a test fixture statement; %s in sql is replaced by the table.
func exec(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, sql string, args ...any) int64 {
	t.Helper()
	tag, err := pool.Exec(context.Background(), replaceTable(sql, tbl), args...)
	if err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return tag.RowsAffected()
}

// markDead makes the rows dead the way the relay leaves them: attempts at the
// threshold, last_error set, lease released, dead_at set, parked.
func markDead(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, lastError string, ids ...uuid.UUID) {
	t.Helper()
	n := exec(t, pool, tbl, `UPDATE %s SET attempts = 25, last_error = $2, locked_at = NULL, dead_at = now(), available_at = 'infinity' WHERE event_id = ANY($1::uuid[])`, uuidStrings(ids), lastError)
	if n != int64(len(ids)) {
		t.Fatalf("marked %d rows dead, want %d", n, len(ids))
	}
}

func uuidStrings(ids []uuid.UUID) []string {
	out := make([]string, len(ids))
	for i, id := range ids {
		out[i] = id.String()
	}
	return out
}

// rowState is the full mutable state of a row, to check that nothing
// changed.
type rowState struct {
	Attempts    int
	AvailableAt time.Time // 'infinity' (parked) reads as the zero time
	LockedAt    *time.Time
	PublishedAt *time.Time
	LastError   *string
	Dead        bool
}

func state(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, id uuid.UUID) rowState {
	t.Helper()
	var s rowState
	err := pool.QueryRow(context.Background(), replaceTable(`SELECT attempts, COALESCE(NULLIF(available_at, 'infinity'), '0001-01-01Z'), locked_at, published_at, last_error, dead_at IS NOT NULL FROM %s WHERE event_id = $1`, tbl), id).
		Scan(&s.Attempts, &s.AvailableAt, &s.LockedAt, &s.PublishedAt, &s.LastError, &s.Dead)
	if err != nil {
		t.Fatalf("state of %s: %v", id, err)
	}
	return s
}

func states(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, ids []uuid.UUID) []rowState {
	t.Helper()
	out := make([]rowState, len(ids))
	for i, id := range ids {
		out[i] = state(t, pool, tbl, id)
	}
	return out
}

func assertUnchanged(t *testing.T, what string, before, after []rowState) {
	t.Helper()
	if !reflect.DeepEqual(before, after) {
		t.Fatalf("%s changed rows:\nbefore %+v\nafter  %+v", what, before, after)
	}
}

// assertReset checks that the row was reset by a replay.
func assertReset(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, id uuid.UUID) {
	t.Helper()
	s := state(t, pool, tbl, id)
	if s.Attempts != 0 || s.LockedAt != nil || s.LastError != nil || s.PublishedAt != nil || s.Dead || time.Since(s.AvailableAt) > time.Minute {
		t.Fatalf("row %s not reset: %+v", id, s)
	}
}

func eventIDs(rows []runbook.Row) []uuid.UUID {
	out := make([]uuid.UUID, len(rows))
	for i, r := range rows {
		out[i] = r.EventID
	}
	return out
}

// TestListStatesAreTheStateReaders: runbook's list states are the words the
// state reader (internal/sqlq) selects rows by.
func TestListStatesAreTheStateReaders(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		got  runbook.ListState
		want sqlq.ListState
	}{{runbook.ListPending, sqlq.ListPending}, {runbook.ListRetrying, sqlq.ListRetrying}, {runbook.ListDead, sqlq.ListDead},
		{runbook.ListDelivered, sqlq.ListDelivered}, {runbook.ListAll, sqlq.ListAll}} {
		if string(c.got) != string(c.want) || !c.got.Valid() {
			t.Errorf("runbook list state %q, state reader's %q", c.got, c.want)
		}
	}
}
