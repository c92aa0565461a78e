package schema_test

import (
	"context"
	"database/sql"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	_ "github.com/jackc/pgx/v5/stdlib" // database/sql driver "pgx"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
)

// TestAdapterWithStockWatermillSQL runs watermill-sql v3's own NewPublisher and
// NewSubscriber over an outbox table through Adapter: every message arrives
// once, a nacked one again, and the acks leave the rows published.
func TestAdapterWithStockWatermillSQL(t *testing.T) {
	t.Parallel()
	tbl := testdb.Table(t, "org_outbox", schema.WithHeadersColumn())
	db, err := sql.Open("pgx", testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	adapter := schema.Adapter{Table: tbl, Columns: schema.Columns{Headers: true}, BatchSize: 10}

	pub, err := wsql.NewPublisher(db, wsql.PublisherConfig{SchemaAdapter: adapter}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	sub, err := wsql.NewSubscriber(db, wsql.SubscriberConfig{
		SchemaAdapter: adapter, OffsetsAdapter: adapter, PollInterval: 20 * time.Millisecond,
		ResendInterval: 20 * time.Millisecond,
	}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()

	const topic = "org.organization.created.v1"
	tenant := uuid.NewString()
	sent := map[string]bool{}
	var first string
	for i := range 25 {
		m := message.NewMessage(uuid.NewString(), []byte(`{"n":`+strings.Repeat("1", i%3+1)+`}`))
		m.Metadata.Set(schema.MetadataTenantID, tenant)
		m.Metadata.Set("correlation_id", "c")
		sent[m.UUID] = true
		if i == 0 {
			first = m.UUID
		}
		if err := pub.Publish(topic, m); err != nil {
			t.Fatal(err)
		}
	}
	// Another topic in the same table is not delivered to this subscription.
	other := message.NewMessage(uuid.NewString(), []byte(`{}`))
	other.Metadata.Set(schema.MetadataTenantID, tenant)
	if err := pub.Publish("org.organization.deleted.v1", other); err != nil {
		t.Fatal(err)
	}
	bad := message.NewMessage("not-a-uuid", []byte(`{}`))
	bad.Metadata.Set(schema.MetadataTenantID, tenant)
	if err := pub.Publish(topic, bad); err == nil || !strings.Contains(err.Error(), "UUID") {
		t.Fatalf("non-UUID message accepted: %v", err)
	}
	noTenant := message.NewMessage(uuid.NewString(), []byte(`{}`))
	if err := pub.Publish(topic, noTenant); err == nil || !strings.Contains(err.Error(), "tenant_id") {
		t.Fatalf("message without tenant accepted: %v", err)
	}
	notJSON := message.NewMessage(uuid.NewString(), []byte(`x`))
	notJSON.Metadata.Set(schema.MetadataTenantID, tenant)
	if err := pub.Publish(topic, notJSON); err == nil || !strings.Contains(err.Error(), "JSON") {
		t.Fatalf("non-JSON payload accepted: %v", err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	msgs, err := sub.Subscribe(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	nacked := false
	for len(sent) > 0 {
		select {
		case m := <-msgs:
			if !sent[m.UUID] {
				t.Fatalf("unexpected or repeated message %s", m.UUID)
			}
			if m.Metadata.Get(schema.MetadataEventID) != m.UUID || m.Metadata.Get(schema.MetadataTenantID) != tenant ||
				m.Metadata.Get(schema.MetadataTopic) != topic || m.Metadata.Get(schema.MetadataAttempts) != "1" ||
				m.Metadata.Get(schema.MetadataTable) != tbl.String() || m.Metadata.Get("correlation_id") != "c" ||
				m.Metadata.Get(schema.MetadataSequence) == "" {
				t.Fatalf("metadata %v", m.Metadata)
			}
			if m.UUID == first && !nacked {
				nacked = true
				m.Nack() // delivered again, then acked
				continue
			}
			delete(sent, m.UUID)
			m.Ack()
		case <-ctx.Done():
			t.Fatalf("%d messages not received", len(sent))
		}
	}
	pool := testdb.Pool(t)
	deadline := time.Now().Add(2 * time.Minute)
	for {
		var published, locked, pending int
		err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE published_at IS NOT NULL), count(*) FILTER (WHERE locked_at IS NOT NULL),
			count(*) FILTER (WHERE published_at IS NULL) FROM `+tbl.Sanitize()).Scan(&published, &locked, &pending)
		if err != nil {
			t.Fatal(err)
		}
		if published == 25 && locked == 0 && pending == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("published %d locked %d pending %d, want 25/0/1", published, locked, pending)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
