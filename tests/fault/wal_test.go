//go:build fault

package fault

import (
	"context"
	"encoding/json"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/pgtest"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/router/amqpbackend"
	"github.com/outboxkit/watermill-outbox/schema"
)

// TestFaultWALKills runs two `outbox relay` processes with
// OUTBOX_RELAY_SOURCE=wal on one table of a private wal_level=logical
// PostgreSQL (set up with `outbox migrate --wal`) while a producer commits
// keyed events, SIGKILLs relays at random and starts replacements; at the
// broker (RabbitMQ) nothing committed is missing and every key's first
// occurrences are in commit order; duplicates are counted.
//
//	go test -tags fault ./tests/fault -run TestFaultWALKills
func TestFaultWALKills(t *testing.T) {
	events := envInt("FAULT_EVENTS", 3000)
	kills := envInt("FAULT_KILLS", 4)
	ctx := context.Background()

	bin := filepath.Join(t.TempDir(), "outbox")
	run(t, "go", "build", "-o", bin, "../../cmd/outbox")
	pg := pgtest.Start(t, pgtest.Options{Settings: map[string]string{"wal_level": "logical", "max_replication_slots": "10", "max_wal_senders": "10"}})
	pool, err := pgxpool.New(ctx, pg.URL("", ""))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	tbl := schema.MustParseTable("public.fault_wal")
	migrate := exec.Command(bin, "migrate", "--table", tbl.String(), "--ordered", "--wal")
	migrate.Env = append(os.Environ(), "OUTBOX_DATABASE_URL="+pg.URL("", ""))
	out, err := migrate.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "set up the WAL relay of "+tbl.String()) {
		t.Fatalf("outbox migrate --wal: %v\n%s", err, out)
	}
	topic := "fault" + strings.ReplaceAll(uuid.NewString()[:8], "-", "") + ".wal.happened.v1"
	h := &harness{t: t, bin: bin, logDir: t.TempDir(), env: append(os.Environ(),
		"OUTBOX_DATABASE_URL="+pg.URL("", ""),
		"OUTBOX_RELAY_TABLES="+tbl.String(),
		"OUTBOX_RELAY_SOURCE=wal",
		"OUTBOX_BACKEND=amqp",
		"OUTBOX_AMQP_URL="+amqpURL,
		"OUTBOX_RELAY_DISPATCH_TIMEOUT=5s",
		"OUTBOX_CLEANER_ENABLED=false",
	)}
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
	h.start(false)
	h.start(false)
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
