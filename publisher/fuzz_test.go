package publisher_test

import (
	"bytes"
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
			// The limit bounds what the relay reads (JSONB's text output).
			if n, ok := jsonbTextLength(ctx, tx, payload); ok && n > publisher.DefaultMaxPayloadBytes {
				t.Fatalf("accepted a payload of %d bytes as JSONB text, over the limit", n)
			}
		case errors.As(err, &ve):
			if len(payload) >= 4 && strings.Contains(err.Error(), string(payload)) {
				t.Fatalf("the error quotes the payload: %v", err)
			}
			if n, ok := jsonbTextLength(ctx, tx, payload); ve.Field == "Payload" && json.Valid(payload) && ok && n <= publisher.DefaultMaxPayloadBytes && !bigger(payload) {
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
// jsonbTextLength is the length in bytes of PostgreSQL's text output of p
// as JSONB, and whether PostgreSQL stores p at all.
func jsonbTextLength(ctx context.Context, tx pgx.Tx, p []byte) (int, bool) {
	sp, err := tx.Begin(ctx)
	if err != nil {
		return 0, false
	}
	defer func() { _ = sp.Rollback(ctx) }()
	var n int
	if sp.QueryRow(ctx, `SELECT octet_length($1::text::jsonb::text)`, string(p)).Scan(&n) != nil {
		return 0, false
	}
	return n, true
}

// bigger reports whether the limit's bound of p's JSONB text may exceed the
// text itself: duplicate object keys (JSONB keeps the last) and escapes
// JSONB writes shorter (\u00e9, \/) count in full.
func bigger(p []byte) bool {
	return bytes.Contains(p, []byte(`\`)) || bytes.Count(p, []byte(`:`)) > 1
}
