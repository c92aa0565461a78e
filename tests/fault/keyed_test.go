//go:build fault

package fault

import (
	"context"
	"encoding/json"
	"math/rand/v2"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/router/amqpbackend"
	"github.com/outboxkit/watermill-outbox/schema"
)

// keyedKills starts relays `outbox relay` processes of h, commits events
// keyed events of topic into tbl (one producer, 40 keys, so a key's
// sequence order is its commit order), SIGKILLs a random relay kills times
// and starts a replacement; then it checks at the broker (RabbitMQ, one
// queue) that nothing committed is missing and that every key's first
// occurrences are in commit order, and logs the duplicates.
func keyedKills(t *testing.T, h *harness, pool *pgxpool.Pool, tbl schema.Table, topic string, events, kills, relays int) {
	t.Helper()
	ctx := context.Background()
	sub, err := amqp.NewSubscriber(amqpbackend.WatermillConfig(amqpbackend.Config{URL: amqpURL}), watermill.NopLogger{})
	if err != nil {
		t.Fatalf("RabbitMQ is required (run `make up`): %v", err)
	}
	subCtx, stopSub := context.WithCancel(ctx)
	defer stopSub()
	msgs, err := sub.Subscribe(subCtx, topic)
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu     sync.Mutex
		seen   = map[string]bool{}
		firsts = map[string][]int64{}
		dups   int
	)
	consumerDone := make(chan struct{})
	go func() {
		defer close(consumerDone)
		for m := range msgs {
			seq, _ := strconv.ParseInt(m.Metadata.Get(schema.MetadataSequence), 10, 64)
			k := m.Metadata.Get(schema.MetadataOrderingKey)
			mu.Lock()
			if seen[m.UUID] {
				dups++
			} else {
				seen[m.UUID] = true
				firsts[k] = append(firsts[k], seq)
			}
			mu.Unlock()
			m.Ack()
		}
	}()

	var (
		committed sync.Map
		n         int
		prodDone  = make(chan struct{})
	)
	go func() {
		defer close(prodDone)
		for i := 0; n < events; i++ {
			batch := make([]publisher.Message, 10)
			for j := range batch {
				batch[j] = publisher.Message{TenantID: uuid.New(), Topic: topic, EventID: uuid.New(), Payload: json.RawMessage(`{}`),
					OrderingKey: "key-" + strconv.Itoa((i*3+j)%40)}
			}
			if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				_, err := publisher.EnqueueBatch(ctx, tx, tbl, batch)
				return err
			}); err != nil {
				t.Errorf("enqueue: %v", err)
				return
			}
			for _, m := range batch {
				committed.Store(m.EventID.String(), true)
			}
			n += len(batch)
			time.Sleep(15 * time.Millisecond)
		}
	}()
	for range relays {
		h.start(false)
	}
	for range kills {
		time.Sleep(time.Duration(500+rand.IntN(1500)) * time.Millisecond)
		h.killRandom(false)
	}
	<-prodDone
	deadline := time.Now().Add(2 * time.Minute)
	for {
		missing := 0
		committed.Range(func(k, _ any) bool {
			mu.Lock()
			if !seen[k.(string)] {
				missing++
			}
			mu.Unlock()
			return true
		})
		if missing == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d committed events never reached the broker", missing)
		}
		time.Sleep(200 * time.Millisecond)
	}
	h.stopAll()
	stopSub()
	_ = sub.Close()
	<-consumerDone
	mu.Lock()
	defer mu.Unlock()
	for k, seqs := range firsts {
		for i := 1; i < len(seqs); i++ {
			if seqs[i] <= seqs[i-1] {
				t.Fatalf("key %s: first occurrences at the broker out of commit order at %d: %v", k, i, seqs)
			}
		}
	}
	t.Logf("%d events over %d keys, %d SIGKILLs, %d duplicates at the broker", len(seen), len(firsts), h.kills.Load(), dups)
}
