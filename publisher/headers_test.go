package publisher_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
)

// TestHeaderNamesABrokerCarriesWhole: a header name that Watermill reserves
// (_watermill_message_uuid, which the Kafka marshaler refuses at publish,
// and every other _watermill_ key) or longer than 255 bytes (AMQP's short
// string, which RabbitMQ would receive cut) is refused at enqueue, before
// any SQL, with a ValidationError on Headers that names the key; the
// transaction stays usable, and a 255-byte name is stored whole. A
// TxPublisher refuses the same metadata.
func TestHeaderNamesABrokerCarriesWhole(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "hdr_names_outbox", schema.WithHeadersColumn())
	ctx := context.Background()
	long := strings.Repeat("h", publisher.MaxHeaderNameBytes+1)
	cases := []struct{ key, want string }{
		{"_watermill_message_uuid", `"_watermill_message_uuid" is reserved by Watermill`},
		{"_watermill_delayed_until", `"_watermill_delayed_until" is reserved by Watermill`},
		{"_watermill_amqp_redelivered", `"_watermill_amqp_redelivered" is reserved by Watermill`},
		{long, "256 bytes; a header name may have at most 255 bytes"},
		{strings.Repeat("é", 128), "256 bytes; a header name may have at most 255 bytes"},
	}
	for _, c := range cases {
		inTx(t, pool, func(tx pgx.Tx) {
			m := newMsg("org.organization.created.v1")
			m.Headers = map[string]string{"correlation_id": "abc", c.key: "v"}
			_, err := publisher.Enqueue(ctx, tx, tbl, m)
			var ve *publisher.ValidationError
			if !errors.As(err, &ve) || ve.Field != "Headers" || !strings.Contains(err.Error(), c.want) {
				t.Errorf("header %.40q: %v, want a ValidationError on Headers saying %q", c.key, err, c.want)
			}
			_, err = publisher.EnqueueBatch(ctx, tx, tbl, []publisher.Message{newMsg("org.organization.created.v1"), m})
			if !errors.As(err, &ve) || ve.Field != "Headers" || ve.Index != 1 {
				t.Errorf("batch with header %.40q: %v, want a ValidationError on Headers of message #1", c.key, err)
			}
			if _, err := publisher.Enqueue(ctx, tx, tbl, newMsg("org.organization.created.v1")); err != nil {
				t.Fatalf("the transaction is unusable after the refusal: %v", err)
			}
		})
	}
	edge := strings.Repeat("k", publisher.MaxHeaderNameBytes)
	ok := newMsg("org.organization.created.v1")
	ok.Headers = map[string]string{edge: "v", "watermill_like": "v"}
	inTx(t, pool, func(tx pgx.Tx) {
		if _, err := publisher.Enqueue(ctx, tx, tbl, ok); err != nil {
			t.Fatalf("a 255-byte header name: %v", err)
		}
	})
	var stored string
	if err := pool.QueryRow(ctx, `SELECT headers->>$2 FROM `+tbl.Sanitize()+` WHERE event_id = $1`, ok.EventID, edge).Scan(&stored); err != nil || stored != "v" {
		t.Fatalf("the 255-byte header name is not stored whole: %q, %v", stored, err)
	}
	inTx(t, pool, func(tx pgx.Tx) {
		p, err := publisher.NewTxPublisher(tx, publisher.TxPublisherConfig{Table: tbl, DefaultTenantID: tenant})
		if err != nil {
			t.Fatal(err)
		}
		msg := message.NewMessage(uuid.NewString(), []byte(`{}`))
		msg.Metadata.Set("_watermill_message_uuid", msg.UUID)
		if err := p.Publish("org.organization.created.v1", msg); !errors.Is(err, publisher.ErrInvalidMessage) || !strings.Contains(err.Error(), "reserved by Watermill") {
			t.Errorf("TxPublisher with _watermill_message_uuid metadata: %v", err)
		}
	})
}
