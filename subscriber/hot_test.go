package subscriber_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/metrics"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

const hotTopic = "org.hot.created.v1"

func hotMessage(topic, key string) publisher.Message {
	return publisher.Message{TenantID: tenant, Topic: topic, EventID: uuid.New(), OrderingKey: key, Payload: json.RawMessage(`{"n":1}`)}
}

// hotWrite commits msgs through h in one transaction.
func hotWrite(t *testing.T, h *subscriber.HotPath, pool *pgxpool.Pool, msgs ...publisher.Message) {
	t.Helper()
	err := h.BeginFunc(context.Background(), pool, func(tx *subscriber.HotTx) error {
		_, err := tx.EnqueueBatch(context.Background(), msgs)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}

// receive reads messages from ch until every id of want arrived once, acking
// each; it fails on a message not in want.
func receive(t *testing.T, ch <-chan *message.Message, want ...publisher.Message) map[string]*message.Message {
	t.Helper()
	left := map[string]bool{}
	for _, m := range want {
		left[m.EventID.String()] = true
	}
	got := map[string]*message.Message{}
	deadline := time.After(2 * time.Minute)
	for len(left) > 0 {
		select {
		case m := <-ch:
			if !left[m.UUID] {
				t.Fatalf("unexpected message %s (delivered twice, or not written)", m.UUID)
			}
			delete(left, m.UUID)
			got[m.UUID] = m
			m.Ack()
		case <-deadline:
			t.Fatalf("%d of %d events not delivered", len(left), len(want))
		}
	}
	return got
}

// hotFixture is a relay on a table of its own, its hot path, and its
// subscription to every topic.
type hotFixture struct {
	pool *pgxpool.Pool
	tbl  schema.Table
	m    *metrics.Metrics
	s    *subscriber.Subscriber
	h    *subscriber.HotPath
	ch   <-chan *message.Message
}

// startHotRelay creates table name (with opts), starts a relay of cfg on it
// with metrics and the hot path of hc, subscribes it, and waits for its
// leadership: a standby hands nothing to the hot path.
func startHotRelay(t *testing.T, name string, cfg subscriber.Config, hc subscriber.HotConfig, opts ...schema.MigrateOption) hotFixture {
	t.Helper()
	f := hotFixture{pool: testdb.Pool(t), tbl: testdb.Table(t, name, opts...)}
	_, f.m = newMetrics(t)
	cfg.Table, cfg.Metrics = f.tbl, f.m
	f.s = newSub(t, f.pool, cfg)
	var err error
	if f.h, err = subscriber.NewHotPath(f.s, hc); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	if f.ch, err = f.s.Subscribe(ctx, subscriber.AllTopics); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the relay's leadership", time.Minute, f.s.IsLeader)
	return f
}

// TestHotPathDeliversWithoutAClaim: events committed through the hot path
// reach the subscription of the same process without a claim (the relay's
// poll and wake-ups are out of the way: PollInterval 1h, no NOTIFY), with
// the metadata a claimed row gets, are marked published by their ack, and
// count as delivered hot; a rolled-back transaction hands nothing over and
// leaves nothing.
func TestHotPathDeliversWithoutAClaim(t *testing.T) {
	t.Parallel()
	f := startHotRelay(t, "hot_outbox", subscriber.Config{PollInterval: time.Hour, DisableNotify: true}, subscriber.HotConfig{})
	pool, tbl, m, h, ch, ctx := f.pool, f.tbl, f.m, f.h, f.ch, context.Background()
	rolledBack := hotMessage(hotTopic, "")
	errNo := errors.New("the business write failed")
	err := h.BeginFunc(ctx, pool, func(tx *subscriber.HotTx) error {
		if _, err := tx.Enqueue(ctx, rolledBack); err != nil {
			return err
		}
		return errNo
	})
	if !errors.Is(err, errNo) {
		t.Fatalf("BeginFunc returned %v, want the callback's error", err)
	}
	msgs := []publisher.Message{hotMessage(hotTopic, ""), hotMessage(hotTopic, ""), hotMessage(hotTopic, "")}
	hotWrite(t, h, pool, msgs...)
	got := receive(t, ch, msgs...)
	for id, msg := range got {
		if msg.Metadata.Get(schema.MetadataEventID) != id || msg.Metadata.Get(schema.MetadataAttempts) != "1" || msg.Metadata.Get(schema.MetadataTopic) != hotTopic ||
			msg.Metadata.Get(schema.MetadataSequence) == "" {
			t.Errorf("hot message %s has metadata %v, want the claim's (event_id, attempts 1, topic, sequence)", id, msg.Metadata)
		}
	}
	waitFor(t, "the acks", 2*time.Minute, func() bool {
		for _, msg := range msgs {
			if !state(t, pool, tbl, msg.EventID.String()).published {
				return false
			}
		}
		return true
	})
	if n := testutil.ToFloat64(m.Delivered.WithLabelValues(tbl.Qualified(), metrics.PathHot)); n != 3 {
		t.Errorf("outbox_delivered_total{path=hot} = %v, want 3", n)
	}
	if n := testutil.ToFloat64(m.Delivered.WithLabelValues(tbl.Qualified(), metrics.PathCold)); n != 0 {
		t.Errorf("outbox_delivered_total{path=cold} = %v, want 0", n)
	}
	if n := testutil.CollectAndCount(m.HotLatency); n != 1 {
		t.Errorf("outbox_hot_commit_to_ack_seconds has %d series, want 1", n)
	}
	var rows int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+tbl.Sanitize()+` WHERE event_id = $1`, rolledBack.EventID).Scan(&rows); err != nil || rows != 0 {
		t.Fatalf("the rolled-back event left %d rows (%v)", rows, err)
	}
	select {
	case msg := <-ch:
		t.Fatalf("unexpected message %s after the rolled-back transaction", msg.UUID)
	case <-time.After(300 * time.Millisecond):
	}
}

// TestHotPathCrashBetweenCommitAndDelivery: a process killed between its
// commit and the hand-over leaves its events leased to the hot path (from
// their INSERT); a relay claims them once the lease expires and nothing is
// lost.
func TestHotPathCrashBetweenCommitAndDelivery(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "hotcrash_outbox")
	crashed := newSub(t, pool, subscriber.Config{Table: tbl, LockTTL: 2 * time.Second, PollInterval: 100 * time.Millisecond})
	h, err := subscriber.NewHotPath(crashed, subscriber.HotConfig{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if _, err := crashed.Subscribe(ctx, subscriber.AllTopics); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the relay's leadership", time.Minute, crashed.IsLeader) // a standby hands nothing to the hot path
	subscriber.CrashAfterCommit(h)
	msgs := []publisher.Message{hotMessage(hotTopic, ""), hotMessage(hotTopic, "")}
	hotWrite(t, h, pool, msgs...)
	for _, msg := range msgs {
		if st := state(t, pool, tbl, msg.EventID.String()); !st.locked || st.attempts != 1 || st.published {
			t.Fatalf("event %s after the commit: %+v, want leased on attempt 1 from its INSERT", msg.EventID, st)
		}
	}
	if err := crashed.Close(); err != nil {
		t.Fatal(err)
	}
	next := newSub(t, pool, subscriber.Config{Table: tbl, LockTTL: 2 * time.Second, PollInterval: 100 * time.Millisecond})
	ch, err := next.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	got := receive(t, ch, msgs...)
	for id, msg := range got {
		if a := msg.Metadata.Get(schema.MetadataAttempts); a != "2" {
			t.Errorf("event %s redelivered on attempt %s, want 2 (the hot path's lease was attempt 1)", id, a)
		}
	}
}

// TestHotPathFallsBack: events the hot path cannot take are left to the
// cold path at once (not leased): beyond the queue limit, of a paused
// topic, keyed events of an ordered table; each is counted, and every event
// is delivered once.
func TestHotPathFallsBack(t *testing.T) {
	t.Parallel()
	t.Run("queue full", func(t *testing.T) {
		t.Parallel()
		f := startHotRelay(t, "hotfull_outbox", subscriber.Config{MaxInFlight: 1, BatchSize: 1, PollInterval: 100 * time.Millisecond}, subscriber.HotConfig{QueueLimit: 1})
		pool, tbl, m, h, ch := f.pool, f.tbl, f.m, f.h, f.ch
		msgs := []publisher.Message{hotMessage(hotTopic, ""), hotMessage(hotTopic, ""), hotMessage(hotTopic, "")}
		hotWrite(t, h, pool, msgs...)
		receive(t, ch, msgs...)
		if got := testutil.ToFloat64(m.HotFallback.WithLabelValues(tbl.Qualified(), "queue_full")); got != 2 {
			t.Errorf("outbox_hot_fallback_total{reason=queue_full} = %v, want 2 (QueueLimit 1, 3 events)", got)
		}
	})
	t.Run("paused topic", func(t *testing.T) {
		t.Parallel()
		f := startHotRelay(t, "hotpause_outbox", subscriber.Config{PollInterval: 100 * time.Millisecond}, subscriber.HotConfig{})
		pool, tbl, m, h, ch, ctx := f.pool, f.tbl, f.m, f.h, f.ch, context.Background()
		rb := runbook.New(pool, tbl)
		if _, err := rb.PauseTopic(ctx, hotTopic, "test", false); err != nil {
			t.Fatal(err)
		}
		// The relay reads the pause at its next read of the paused topics.
		waitFor(t, "the relay to read the pause", time.Minute, func() bool {
			return testutil.ToFloat64(m.PausedTopics.WithLabelValues(tbl.Qualified())) == 1
		})
		paused := hotMessage(hotTopic, "")
		hotWrite(t, h, pool, paused)
		if st := state(t, pool, tbl, paused.EventID.String()); st.locked || st.attempts != 0 {
			t.Fatalf("an event of a paused topic was leased to the hot path: %+v", st)
		}
		select {
		case msg := <-ch:
			t.Fatalf("message %s of a paused topic delivered", msg.UUID)
		case <-time.After(500 * time.Millisecond):
		}
		if _, err := rb.ResumeTopic(ctx, hotTopic, false); err != nil {
			t.Fatal(err)
		}
		receive(t, ch, paused)
		if got := testutil.ToFloat64(m.HotFallback.WithLabelValues(tbl.Qualified(), "paused")); got != 1 {
			t.Errorf("outbox_hot_fallback_total{reason=paused} = %v, want 1", got)
		}
	})
	t.Run("keyed in ordered mode", func(t *testing.T) {
		t.Parallel()
		f := startHotRelay(t, "hotkeyed_outbox", subscriber.Config{Ordered: true, PollInterval: 100 * time.Millisecond}, subscriber.HotConfig{}, schema.WithAllColumns())
		pool, tbl, m, h, ch := f.pool, f.tbl, f.m, f.h, f.ch
		keyed, unkeyed := hotMessage(hotTopic, "k"), hotMessage(hotTopic, "")
		hotWrite(t, h, pool, keyed, unkeyed)
		receive(t, ch, keyed, unkeyed)
		if got := testutil.ToFloat64(m.HotFallback.WithLabelValues(tbl.Qualified(), "keyed")); got != 1 {
			t.Errorf("outbox_hot_fallback_total{reason=keyed} = %v, want 1", got)
		}
		waitFor(t, "the unkeyed event's ack", 2*time.Minute, func() bool {
			return testutil.ToFloat64(m.Delivered.WithLabelValues(tbl.Qualified(), metrics.PathHot)) == 1
		})
	})
}

// TestHotPathRefusesANestedTransaction: BeginFunc on a pgx.Tx would hand
// the events over at the release of a savepoint, before their commit.
func TestHotPathRefusesANestedTransaction(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "hotnested_outbox")
	s := newSub(t, pool, subscriber.Config{Table: tbl})
	h, err := subscriber.NewHotPath(s, subscriber.HotConfig{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	called := false
	err = h.BeginFunc(ctx, tx, func(*subscriber.HotTx) error { called = true; return nil })
	if err == nil || called {
		t.Fatalf("BeginFunc on a pgx.Tx: err %v, callback called %t; want a refusal before the callback", err, called)
	}
	if _, err := subscriber.NewHotPath(s, subscriber.HotConfig{QueueLimit: 5000}); err == nil {
		t.Fatal("NewHotPath accepted QueueLimit 5000, above the 4096 bound")
	}
}
