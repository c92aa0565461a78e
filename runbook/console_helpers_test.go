package runbook_test

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/console"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
)

// consoleToken is a token of the minimum length for the tests' consoles.
const consoleToken = "0123456789abcdef0123456789abcdef"

// consoleGet answers one authenticated GET of a console over tbl.
func consoleGet(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, path string) *httptest.ResponseRecorder {
	t.Helper()
	h, err := console.New(pool, console.Config{Tables: []schema.Table{tbl}, Token: consoleToken})
	if err != nil {
		t.Fatal(err)
	}
	req := httptest.NewRequest(http.MethodGet, path, nil)
	req.Header.Set("Authorization", "Bearer "+consoleToken)
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	if rec.Code != http.StatusOK {
		t.Fatalf("console GET %s: %d", path, rec.Code)
	}
	return rec
}

// ConsoleCounts is what the console's /api/counts says of tbl.
func ConsoleCounts(t *testing.T, pool *pgxpool.Pool, tbl schema.Table) runbook.TableStats {
	t.Helper()
	var counts map[string]struct {
		Stats runbook.TableStats `json:"stats"`
	}
	if err := json.NewDecoder(consoleGet(t, pool, tbl, "/api/counts").Body).Decode(&counts); err != nil {
		t.Fatal(err)
	}
	c, ok := counts[tbl.String()]
	if !ok {
		t.Fatalf("console /api/counts has no %s", tbl)
	}
	return c.Stats
}

// ConsoleEventPage is the console's page of one event of tbl.
func ConsoleEventPage(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, id uuid.UUID) string {
	t.Helper()
	b, err := io.ReadAll(consoleGet(t, pool, tbl, "/t/"+tbl.String()+"/event/"+id.String()).Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
