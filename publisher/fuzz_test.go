package publisher_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
)

// FuzzPayloadValidation asserts, against the real PostgreSQL, that payload
// validation and jsonb agree: a payload Enqueue accepts is stored and the
// transaction goes on; a JSON payload it refuses as a ValidationError on
// Payload (within the size limit) is one PostgreSQL's jsonb refuses too,
// and the transaction stays usable; the error never quotes the payload.
// Its seed corpus (the cases of issue 46 among them) runs in go test.
func FuzzPayloadValidation(f *testing.F) {
	for _, p := range refusedByPostgreSQL {
		f.Add([]byte(p))
	}
	for _, p := range acceptedByPostgreSQL {
		f.Add([]byte(p))
	}
	for _, p := range []string{`{}`, `[]`, `{"id":1,"name":"acme"}`, `"\u00e9\n\t\\"`, `-0.0e-0`, `[1e400, 1E-400]`, `{"a":{"b":[null,true,false]}}`} {
		f.Add([]byte(p))
	}
	pool := testdb.Pool(f)
	tbl := testdb.Table(f, "fuzz_outbox")
	ctx := context.Background()
	f.Fuzz(func(t *testing.T, payload []byte) {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(ctx) }()
		m := newMsg("org.organization.created.v1")
		m.Payload = json.RawMessage(payload)
		_, err = publisher.Enqueue(ctx, tx, tbl, m)
		var ve *publisher.ValidationError
		switch {
		case err == nil:
		case errors.As(err, &ve):
			if len(payload) >= 4 && strings.Contains(err.Error(), string(payload)) {
				t.Fatalf("the error quotes the payload: %v", err)
			}
			if ve.Field == "Payload" && json.Valid(payload) && len(payload) <= publisher.DefaultMaxPayloadBytes && storable(ctx, tx, payload) {
				t.Fatalf("refused a payload PostgreSQL stores: %v", err)
			}
		default:
			t.Fatalf("an error that is not a ValidationError (the statement reached SQL): %v", err)
		}
		// Whatever happened, the transaction is usable.
		if _, err := publisher.Enqueue(ctx, tx, tbl, newMsg("org.organization.created.v1")); err != nil {
			t.Fatalf("the transaction is unusable: %v", err)
		}
	})
}

// storable asks PostgreSQL whether it stores p as jsonb, in a savepoint so
// that a refusal leaves tx usable.
func storable(ctx context.Context, tx pgx.Tx, p []byte) bool {
	sp, err := tx.Begin(ctx)
	if err != nil {
		return false
	}
	defer func() { _ = sp.Rollback(ctx) }()
	var n int
	return sp.QueryRow(ctx, `SELECT length($1::text::jsonb::text)`, string(p)).Scan(&n) == nil
}
