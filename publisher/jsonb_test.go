package publisher_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
)

// refusedByPostgreSQL are payloads that json.Valid accepts and PostgreSQL's
// jsonb input refuses (issue 46): each aborted the caller's transaction at
// the INSERT before validation knew them.
var refusedByPostgreSQL = map[string]string{
	"invalid UTF-8 in a string":    "\"caf\xe9\"",
	"invalid UTF-8 in a key":       "{\"\xff\":1}",
	"lone high surrogate":          `"\ud800"`,
	"lone low surrogate":           `{"a":"x\udc00y"}`,
	"high surrogate then a letter": `["\ud800\u0041"]`,
	"high surrogate at the end":    `"ab\uDBFF"`,
	"number too large":             `1e131072`,
	"number too large in an array": `[1, -9.5e131072]`,
	"too many digits after point":  `{"n":1.5e-16383}`,
	"zero with a huge scale":       `0e-16384`,
	"exponent past numeric_in":     `0e1073741823`,
	"exponent of 30 digits":        `1e999999999999999999999999999999`,
	"NUL escape":                   `{"a":"x\u0000y"}`,
}

// acceptedByPostgreSQL are the limits just inside what jsonb stores: they
// must pass validation and be stored.
var acceptedByPostgreSQL = []string{
	`"\ud800\udc00"`, `"\uD83D\uDE00 ok"`, `1e131071`, `-1e131071`, `1e-16383`, `0e1073741822`, `0.5e-16382`,
	`{"C:\\u0000":"\\ud800"}`, `"caf` + "\u00e9" + `"`, `123456789012345678901234567890.123456789`,
}

// TestPayloadsPostgreSQLRefuses: a payload PostgreSQL's jsonb refuses is a
// ValidationError on Payload, through Enqueue, EnqueueBatch and the
// tx-bound Watermill publisher, before any SQL: the caller's transaction
// stays usable. The limits just inside the range are stored.
func TestPayloadsPostgreSQLRefuses(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "org_outbox")
	ctx := context.Background()
	for name, payload := range refusedByPostgreSQL {
		t.Run(name, func(t *testing.T) {
			if !json.Valid([]byte(payload)) {
				t.Fatalf("the case is not valid JSON to encoding/json: %q", payload)
			}
			var probe any
			if err := pool.QueryRow(ctx, `SELECT $1::text::jsonb`, payload).Scan(&probe); err == nil {
				t.Fatalf("PostgreSQL stores %q: the case proves nothing", payload)
			}
			inTx(t, pool, func(tx pgx.Tx) {
				m := newMsg("org.organization.created.v1")
				m.Payload = json.RawMessage(payload)
				_, err := publisher.Enqueue(ctx, tx, tbl, m)
				checkPayloadRefused(t, "Enqueue", err, payload)
				_, err = publisher.EnqueueBatch(ctx, tx, tbl, []publisher.Message{newMsg("org.organization.created.v1"), m})
				checkPayloadRefused(t, "EnqueueBatch", err, payload)
				p, err := publisher.NewTxPublisher(tx, publisher.TxPublisherConfig{Table: tbl, DefaultTenantID: tenant})
				if err != nil {
					t.Fatal(err)
				}
				err = p.Publish("org.organization.created.v1", message.NewMessage(uuid.NewString(), []byte(payload)))
				checkPayloadRefused(t, "TxPublisher.Publish", err, payload)
				// The caller's transaction is still usable.
				if _, err := publisher.Enqueue(ctx, tx, tbl, newMsg("org.organization.created.v1")); err != nil {
					t.Fatalf("the transaction is unusable after the refusal: %v", err)
				}
			})
		})
	}
	for _, payload := range acceptedByPostgreSQL {
		inTx(t, pool, func(tx pgx.Tx) {
			m := newMsg("org.organization.created.v1")
			m.Payload = json.RawMessage(payload)
			if _, err := publisher.Enqueue(ctx, tx, tbl, m); err != nil {
				t.Errorf("payload %q refused: %v", payload, err)
			}
		})
	}
}

func checkPayloadRefused(t *testing.T, via string, err error, payload string) {
	t.Helper()
	var ve *publisher.ValidationError
	if !errors.As(err, &ve) || ve.Field != "Payload" || !errors.Is(err, publisher.ErrInvalidMessage) {
		t.Fatalf("%s: got %v, want a ValidationError on Payload", via, err)
	}
	if strings.Contains(err.Error(), payload) {
		t.Fatalf("%s: the error quotes the payload: %v", via, err)
	}
}
