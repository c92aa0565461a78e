package tests

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/internal/kafkatest"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/router/kafkabackend"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// TestEveryAcceptedPayloadReachesKafka: the default enqueue limit bounds
// what the broker receives. Payloads at and around it, with headers, a
// trace context, the longest ordering key and a long topic, are either
// refused at enqueue or relayed to Kafka (kfake, its default
// message.max.bytes) by the daemon's backend and received; none is accepted
// and then dies at the publish. The largest payload the limit allows (a
// JSON string, which JSONB keeps byte for byte) is accepted.
func TestEveryAcceptedPayloadReachesKafka(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "org_outbox", schema.WithAllColumns())
	cluster, err := kafkatest.Start(1, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer cluster.Close()
	pub, err := kafkabackend.NewPublisher(cluster.Brokers(), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	topic := strings.Repeat("a", publisher.MaxTopicBytes-4) + ".v1"
	headers := map[string]string{"correlation_id": uuid.NewString(), strings.Repeat("h", publisher.MaxHeaderNameBytes): strings.Repeat("v", 2000)}
	headerBytes := 0
	for k, v := range headers {
		headerBytes += len(k) + len(v) + publisher.HeaderFramingBytes
	}
	str := func(n int) json.RawMessage { return json.RawMessage(`"` + strings.Repeat("x", n-2) + `"`) }
	repeat := func(open, item, close string, n int) json.RawMessage {
		items := (n - len(open) - len(close) + 1) / (len(item) + 1)
		return json.RawMessage(open + strings.Repeat(item+",", items-1) + item + close)
	}
	largest := publisher.DefaultMaxPayloadBytes - headerBytes
	payloads := map[string]json.RawMessage{
		"the largest string":                    str(largest),
		"a string of 1 MiB less 1 KiB":          str(1<<20 - 1024),
		"an array re-spaced by JSONB":           repeat("[", "0", "]", largest),
		"an object re-spaced by JSONB":          repeat("{", `"k":0`, "}", largest*9/10),
		"numbers JSONB writes out in full":      repeat("[", "1e900", "]", largest/100),
		"a string under the limit by 100 bytes": str(largest - 100),
		"an array of strings under the limit":   repeat("[", `"abc"`, "]", largest-4096),
		"escapes JSONB shortens, at the limit":  json.RawMessage(`"` + strings.Repeat(`\u00e9`, (largest-2)/6) + `"`),
	}
	accepted := map[string]string{} // event_id -> case
	for name, p := range payloads {
		ctx, _ := traced(t)
		m := publisher.Message{TenantID: uuid.New(), Topic: topic, EventID: uuid.New(), Payload: p, Headers: headers,
			OrderingKey: strings.Repeat("k", schema.MaxOrderingKeyBytes)}
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := publisher.Enqueue(ctx, tx, tbl, m)
			return err
		})
		switch {
		case err == nil:
			accepted[m.EventID.String()] = name
		case errors.Is(err, publisher.ErrInvalidMessage):
			t.Logf("%s (%d bytes): refused at enqueue: %v", name, len(p), err)
		default:
			t.Fatalf("%s: %v", name, err)
		}
	}
	for _, must := range []string{"the largest string", "a string under the limit by 100 bytes"} {
		found := false
		for _, name := range accepted {
			found = found || name == must
		}
		if !found {
			t.Errorf("%s was refused at enqueue, although within the limit", must)
		}
	}
	startRelay(t, pool, tbl, pub, subscriber.Config{Backoff: func(int) time.Duration { return time.Hour }})
	deadline := time.Now().Add(2 * time.Minute)
	for {
		rows, err := pool.Query(context.Background(), `SELECT event_id::text, published_at IS NOT NULL, COALESCE(last_error, '') FROM `+tbl.Sanitize())
		if err != nil {
			t.Fatal(err)
		}
		published := 0
		for rows.Next() {
			var id, lastError string
			var done bool
			if err := rows.Scan(&id, &done, &lastError); err != nil {
				t.Fatal(err)
			}
			if lastError != "" {
				t.Errorf("%s was accepted at enqueue, then failed at the Kafka publish: %s", accepted[id], lastError)
			}
			if done {
				published++
			}
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		if t.Failed() {
			t.FailNow()
		}
		if published == len(accepted) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d accepted events published", published, len(accepted))
		}
		time.Sleep(50 * time.Millisecond)
	}
	sub, err := cluster.NewSubscriber("size", watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	msgs, err := sub.Subscribe(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	for len(accepted) > 0 {
		select {
		case m := <-msgs:
			if _, ok := accepted[m.UUID]; !ok {
				t.Fatalf("unexpected or repeated message %s", m.UUID)
			}
			delete(accepted, m.UUID)
			m.Ack()
		case <-ctx.Done():
			t.Fatalf("%d published events not received from Kafka", len(accepted))
		}
	}
}
