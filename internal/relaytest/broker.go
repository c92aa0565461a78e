package relaytest

import (
	"context"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"

	"github.com/outboxkit/watermill-outbox/forwarder"
	"github.com/outboxkit/watermill-outbox/internal/kafkatest"
	"github.com/outboxkit/watermill-outbox/router/kafkabackend"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
)

// TestKafkaKeyIsOrderingKey checks the forwarder's key rule whichever relay
// delivers: 60 keyed rows over 3 ordering keys, relayed by the relay under
// test through a forwarder with the zero Config to the Kafka backend
// (kfake, 3 partitions), reach Kafka with their ordering key as record key,
// and each key's records share one partition. A default relay claims keyed
// rows too, so its claim reads ordering_key like the keyed relays' reads.
// forwarder.Config.PartitionKey, README "Kafka".
func TestKafkaKeyIsOrderingKey(t *testing.T, r Relay) {
	e := setup(t, r, true, schema.WithAllColumns())
	keys := make([]string, 60)
	for i := range keys {
		keys[i] = fmt.Sprintf("key-%d", i%3)
	}
	evs := e.enqueue(topicA, keys...)
	keyOf := map[string]string{}
	for _, ev := range evs {
		keyOf[ev.ID.String()] = ev.Key
	}

	cluster, err := kafkatest.Start(3, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cluster.Close)
	kp, err := kafkabackend.NewPublisher(cluster.Brokers(), watermill.NopLogger{})
	if err != nil {
		t.Fatalf("the Kafka publisher: %v", err)
	}
	sub, err := r.New(context.Background(), e.pool, e.tbl, Options{}.withDefaults())
	if err != nil {
		t.Fatalf("the %s relay: %v", r.Name, err)
	}
	f, err := forwarder.New(sub, kp, forwarder.Config{}, nil)
	if err != nil {
		t.Fatalf("the forwarder: %v", err)
	}
	done := make(chan error, 1)
	go func() { done <- f.Run(context.Background()) }()
	t.Cleanup(func() {
		_ = f.Close()
		if err := <-done; err != nil {
			t.Errorf("the forwarder's Run: %v", err)
		}
		_ = sub.Close()
		_ = kp.Close()
	})

	ks, err := cluster.NewSubscriber("relaytest-keys", watermill.NopLogger{})
	if err != nil {
		t.Fatalf("the Kafka subscriber: %v", err)
	}
	defer ks.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 3*within)
	defer cancel()
	ch, err := ks.Subscribe(ctx, topicA)
	if err != nil {
		t.Fatalf("subscribe to Kafka: %v", err)
	}
	partition := map[string]int32{}
	seen := map[string]bool{}
	bad := 0
	for len(seen) < len(evs) {
		select {
		case m := <-ch:
			p, _ := kafka.MessagePartitionFromCtx(m.Context())
			key, _ := kafka.MessageKeyFromCtx(m.Context())
			k, ok := keyOf[m.UUID]
			switch {
			case !ok:
				t.Errorf("Kafka carries event %s, which the case did not enqueue", m.UUID)
			case string(key) != k:
				if bad++; bad <= 3 {
					t.Errorf("the %s relay: event %s reached Kafka keyed %q, want its ordering key %q", r.Name, m.UUID, key, k)
				}
			}
			if q, ok := partition[k]; ok && q != p {
				if bad++; bad <= 3 {
					t.Errorf("the %s relay: key %s in partitions %d and %d", r.Name, k, q, p)
				}
			}
			partition[k] = p
			seen[m.UUID] = true
			m.Ack()
		case <-ctx.Done():
			t.Fatalf("%d of %d events reached Kafka; %s", len(seen), len(evs), e.rowStates(evs[:1]))
		}
	}
	if bad > 3 {
		t.Errorf("... %d wrong keys or partitions in all", bad)
	}
}

// TestSkippedNeverDelivered checks that a skip is final for a default relay
// too: a row an ordered relay skipped (skipped_at) and left unpublished,
// as it leaves every keyed row, is never delivered by a default relay that
// takes the table over, while the rows after it are. A relay's own
// skips (every mode) are TestSkippedIsAState's. docs/ARCHITECTURE.md
// "skipped".
func TestSkippedNeverDelivered(t *testing.T, r Relay) {
	if r.Mode != ModeDefault {
		t.Skipf("the %s relay is keyed: TestSkippedIsAState checks that it never delivers a row skipped on its own table", r.Name)
	}
	e := setup(t, r, true, schema.WithAllColumns())
	ctx := context.Background()
	key := e.enqueue(topicA, "k", "k")
	bad := newFailing(key[0])
	old, err := e.newOrdered(Options{MaxAttempts: 1})
	if err != nil {
		t.Fatalf("the ordered relay: %v", err)
	}
	oldRelay, err := e.consume("old", old, permanentFor(bad))
	if err != nil {
		t.Fatal(err)
	}
	e.waitHold(within, key[0], runbook.HoldDead)
	if _, err := runbook.New(e.pool, e.tbl).SkipEvent(ctx, key[0].ID, false); err != nil {
		t.Fatalf("skip the dead held row %s: %v", key[0], err)
	}
	e.waitAcked(within, key[1])
	skipped := func() (skipped, published bool) {
		t.Helper()
		if err := e.pool.QueryRow(ctx, `SELECT skipped_at IS NOT NULL, published_at IS NOT NULL FROM `+e.tbl.Sanitize()+` WHERE event_id = $1`, key[0].ID).
			Scan(&skipped, &published); err != nil {
			t.Fatalf("read skipped_at of %s: %v", key[0], err)
		}
		return skipped, published
	}
	e.eventually(within, func() bool { s, p := skipped(); return s && !p }, func() string {
		return "the row is not recorded as skipped: " + e.rowStates(key[:1])
	})
	if err := oldRelay.Close(); err != nil {
		t.Fatalf("close the ordered relay: %v", err)
	}
	bad.fix(key[0]) // a delivery of the skipped row would now be acked, and seen
	before := e.rec.delivered(key[0])
	e.startOnceOtherModeGone("new", Options{}, nil, within)
	fresh := e.enqueue(topicA, "k", "", "n")
	e.waitAcked(within, fresh...)
	e.wait(quietSpell)
	if n := e.rec.delivered(key[0]); n != before {
		t.Errorf("the %s relay delivered the skipped row %s (%d deliveries after the skip)", r.Name, key[0], n-before)
	}
	if s, p := skipped(); !s || p {
		t.Errorf("the skipped row %s has skipped_at %t, published_at %t after the %s relay ran, want skipped and not published", key[0], s, p, r.Name)
	}
}
