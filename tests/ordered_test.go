package tests

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/internal/kafkatest"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/router/kafkabackend"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// flakyPublisher fails every n-th publish, so that ordered relays hold and
// retry keys while they forward.
type flakyPublisher struct {
	message.Publisher
	n     int64
	count atomic.Int64
}

func (f *flakyPublisher) Publish(topic string, msgs ...*message.Message) error {
	if f.count.Add(1)%f.n == 0 {
		return errors.New("injected publish failure")
	}
	return f.Publisher.Publish(topic, msgs...)
}

// TestOrderedRelayToKafka: two ordered relays forward keyed rows to Kafka
// (kfake, 3 partitions) through a publisher that fails now and then; every
// key's records share one partition, carry the key as record key, and their
// first occurrences are in sequence order; nothing is lost.
func TestOrderedRelayToKafka(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "org_outbox", schema.WithAllColumns())
	cluster, err := kafkatest.Start(3, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer cluster.Close()
	kpub, err := kafkabackend.NewPublisher(cluster.Brokers(), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer kpub.Close()
	pub := &flakyPublisher{Publisher: kpub, n: 7}
	const topic = "org.organization.changed.v1"
	ctx := context.Background()
	seqOf := map[string]int64{}
	keyOf := map[string]string{}
	for i := 0; i < 20; i++ {
		msgs := make([]publisher.Message, 10)
		for j := range msgs {
			msgs[j] = publisher.Message{TenantID: uuid.New(), Topic: topic, EventID: uuid.New(), Payload: json.RawMessage(`{}`),
				OrderingKey: "org-" + strconv.Itoa((i+j)%6)}
		}
		var seqs []int64
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			seqs, err = publisher.EnqueueBatch(ctx, tx, tbl, msgs)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		for j, m := range msgs {
			seqOf[m.EventID.String()] = seqs[j]
			keyOf[m.EventID.String()] = m.OrderingKey
		}
	}
	cfg := subscriber.Config{Ordered: true, LockTTL: time.Second, ElectionInterval: 100 * time.Millisecond,
		Backoff: func(int) time.Duration { return 10 * time.Millisecond }, MaxAttempts: 1000}
	startRelay(t, pool, tbl, pub, cfg)
	startRelay(t, pool, tbl, pub, cfg)

	sub, err := cluster.NewSubscriber("ordered", watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	rctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	ch, err := sub.Subscribe(rctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu        sync.Mutex
		firsts    = map[string][]int64{}
		partition = map[string]int32{}
		seen      = map[string]bool{}
	)
	for len(seen) < len(seqOf) {
		select {
		case m := <-ch:
			p, _ := kafka.MessagePartitionFromCtx(m.Context())
			key, _ := kafka.MessageKeyFromCtx(m.Context())
			k := keyOf[m.UUID]
			mu.Lock()
			if string(key) != k || m.Metadata.Get(schema.MetadataOrderingKey) != k {
				t.Errorf("event %s: record key %q, metadata %q, want the ordering key %q", m.UUID, key, m.Metadata.Get(schema.MetadataOrderingKey), k)
			}
			if q, ok := partition[k]; ok && q != p {
				t.Errorf("key %s in partitions %d and %d", k, q, p)
			}
			partition[k] = p
			if !seen[m.UUID] {
				seen[m.UUID] = true
				firsts[k] = append(firsts[k], seqOf[m.UUID])
			}
			mu.Unlock()
			m.Ack()
		case <-rctx.Done():
			t.Fatalf("%d of %d events reached Kafka", len(seen), len(seqOf))
		}
	}
	for k, seqs := range firsts {
		for i := 1; i < len(seqs); i++ {
			if seqs[i] <= seqs[i-1] {
				t.Fatalf("key %s: first occurrences at the broker out of order: %v", k, seqs)
			}
		}
	}
	t.Logf("%d events over %d keys; %d publishes", len(seen), len(firsts), pub.count.Load())
}

// TestDaemonOrderedNeedsMigration: OUTBOX_RELAY_ORDERED=true on a table
// without the ordering column stops the daemon at start, naming the
// migration to run.
func TestDaemonOrderedNeedsMigration(t *testing.T) {
	t.Parallel()
	tbl := testdb.Table(t, "plain_outbox")
	cmd := exec.Command(outboxBinary(t), "relay")
	cmd.Env = append(os.Environ(), "OUTBOX_DATABASE_URL="+testdb.URL(), "OUTBOX_RELAY_TABLES="+tbl.String(),
		"OUTBOX_BACKEND=amqp", "OUTBOX_AMQP_URL=amqp://guest:guest@127.0.0.1:5672/", "OUTBOX_RELAY_ORDERED=true", "OUTBOX_CLEANER_ENABLED=false")
	done := make(chan struct{})
	var out []byte
	var err error
	go func() { out, err = cmd.CombinedOutput(); close(done) }()
	select {
	case <-done:
	case <-time.After(2 * time.Minute):
		_ = cmd.Process.Kill()
		<-done
		t.Fatalf("the daemon did not stop on an unmigrated ordered table:\n%s", out)
	}
	if err == nil || !strings.Contains(string(out), "outbox migrate --ordered --table="+tbl.String()) {
		t.Fatalf("exit %v; output does not name the migration:\n%s", err, out)
	}
}
