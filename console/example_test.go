package console_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/console"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
)

// The console is an http.Handler: mount it on a mux of your own (with
// http.StripPrefix under a path) or serve it with `outbox console`. With a
// Token set, every page needs it; here one request reads the live counts,
// first without the token, then with it as a bearer token.
func ExampleNew() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("OUTBOX_DATABASE_URL")) // e.g. postgres://postgres@127.0.0.1:5432/test
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	// A throw-away schema for the example; a service uses its own tables.
	var b [6]byte
	_, _ = rand.Read(b[:])
	ns := "example_" + hex.EncodeToString(b[:])
	table := schema.MustParseTable(ns + ".org_outbox")
	if err := schema.Migrate(ctx, pool, table, schema.WithCreateSchema()); err != nil {
		panic(err)
	}
	defer pool.Exec(ctx, `DROP SCHEMA `+ns+` CASCADE`) //nolint:errcheck // best-effort cleanup of the example
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := publisher.Enqueue(ctx, tx, table, publisher.Message{TenantID: uuid.New(),
			Topic: "org.organization.created.v1", EventID: uuid.New(), Payload: []byte(`{}`)})
		return err
	}); err != nil {
		panic(err)
	}

	token := "0123456789abcdef0123456789abcdef" // at least console.MinTokenBytes; use `openssl rand -hex 32`
	h, err := console.New(pool, console.Config{Tables: []schema.Table{table}, Token: token})
	if err != nil {
		panic(err)
	}

	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/api/counts", nil))
	fmt.Println("without the token:", rec.Code)

	req := httptest.NewRequest(http.MethodGet, "/api/counts", nil)
	req.Header.Set("Authorization", "Bearer "+token)
	rec = httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	var counts map[string]struct {
		Stats struct {
			Mode    string `json:"mode"`
			Pending int64  `json:"pending"`
			Dead    int64  `json:"dead"`
		} `json:"stats"`
	}
	if err := json.NewDecoder(rec.Body).Decode(&counts); err != nil {
		panic(err)
	}
	st := counts[table.String()].Stats
	fmt.Printf("with the token: %d, mode %s, pending %d, dead %d\n", rec.Code, st.Mode, st.Pending, st.Dead)
	// Output:
	// without the token: 401
	// with the token: 200, mode default, pending 1, dead 0
}
