package forwarder_test

import (
	"context"
	"encoding/json"
	"errors"
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

	"github.com/outboxkit/watermill-outbox/forwarder"
	"github.com/outboxkit/watermill-outbox/internal/kafkatest"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/router/kafkabackend"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// recordingBatchPublisher is a BatchPublisher that takes 2 ms per call,
// like a broker round trip, keeps what it published, fails the messages
// that fail says to fail (per message), and records the size of every call.
type recordingBatchPublisher struct {
	fail func(m *message.Message) bool

	mu        sync.Mutex
	published map[string]int // event_id -> times published
	calls     []int          // messages per call
}

func (p *recordingBatchPublisher) Publish(topic string, msgs ...*message.Message) error {
	return errors.Join(p.PublishBatch(topic, msgs)...)
}

func (p *recordingBatchPublisher) PublishBatch(_ string, msgs []*message.Message) []error {
	time.Sleep(2 * time.Millisecond)
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls = append(p.calls, len(msgs))
	var errs []error
	for i, m := range msgs {
		if p.fail != nil && p.fail(m) {
			if errs == nil {
				errs = make([]error, len(msgs))
			}
			errs[i] = errors.New("injected failure of one message")
			continue
		}
		p.published[m.UUID]++
	}
	return errs
}

func (p *recordingBatchPublisher) Close() error { return nil }

// enqueueMany commits n rows of topic in tbl (ordering keys over keys keys
// when keys > 0) and returns their event ids and sequences.
func enqueueMany(t *testing.T, tbl schema.Table, n, keys int, payload func(i int) string) (ids []string, seqOf map[string]int64, keyOf map[string]string) {
	t.Helper()
	ctx := context.Background()
	seqOf, keyOf = map[string]int64{}, map[string]string{}
	msgs := make([]publisher.Message, n)
	for i := range msgs {
		msgs[i] = publisher.Message{TenantID: uuid.New(), Topic: topic, EventID: uuid.New(), Payload: json.RawMessage(payload(i))}
		if keys > 0 {
			msgs[i].OrderingKey = "org-" + strconv.Itoa(i%keys)
		}
	}
	var seqs []int64
	if err := pgx.BeginFunc(ctx, testdb.Pool(t), func(tx pgx.Tx) error {
		var err error
		seqs, err = publisher.EnqueueBatch(ctx, tx, tbl, msgs)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	for i, m := range msgs {
		id := m.EventID.String()
		ids = append(ids, id)
		seqOf[id], keyOf[id] = seqs[i], m.OrderingKey
	}
	return ids, seqOf, keyOf
}

// runForwarder runs f until the test ends.
func runForwarder(t *testing.T, f *forwarder.Forwarder) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- f.Run(context.Background()) }()
	t.Cleanup(func() {
		_ = f.Close()
		if err := <-done; err != nil {
			t.Errorf("run: %v", err)
		}
	})
	<-f.Running()
}

// waitAllPublished waits until every row of tbl is published (acked) and
// returns attempts by event_id.
func waitAllPublished(t *testing.T, tbl schema.Table, n int) map[string]int {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		var published int
		if err := testdb.Pool(t).QueryRow(context.Background(), `SELECT count(*) FROM `+tbl.Sanitize()+` WHERE published_at IS NOT NULL`).Scan(&published); err != nil {
			t.Fatal(err)
		}
		if published == n {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d rows published", published, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
	rows, err := testdb.Pool(t).Query(context.Background(), `SELECT event_id::text, attempts FROM `+tbl.Sanitize())
	if err != nil {
		t.Fatal(err)
	}
	attempts := map[string]int{}
	for rows.Next() {
		var id string
		var a int
		if err := rows.Scan(&id, &a); err != nil {
			t.Fatal(err)
		}
		attempts[id] = a
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return attempts
}

// TestBatchPerMessageResults: with a BatchPublisher the forwarder batches by
// default (calls of many messages), and a message the publisher reports as
// failed is nacked alone: it is retried and published on its second attempt,
// while the other messages of its call are acked on their first. Every row
// is published, none twice.
func TestBatchPerMessageResults(t *testing.T) {
	t.Parallel()
	tbl := testdb.Table(t, "fwd_batch_outbox", schema.WithAllColumns())
	const n = 600
	ids, _, _ := enqueueMany(t, tbl, n, 0, func(i int) string {
		if i%10 == 3 {
			return `{"fail_once":true,"i":` + strconv.Itoa(i) + `}`
		}
		return `{"i":` + strconv.Itoa(i) + `}`
	})
	pub := &recordingBatchPublisher{published: map[string]int{}, fail: func(m *message.Message) bool {
		return strings.Contains(string(m.Payload), "fail_once") && m.Metadata.Get(schema.MetadataAttempts) == "1"
	}}
	sub, err := subscriber.New(context.Background(), testdb.Pool(t), subscriber.Config{Table: tbl, PollInterval: 50 * time.Millisecond,
		Backoff: func(int) time.Duration { return 10 * time.Millisecond }}, watermill.NopLogger{})

	if err != nil {
		t.Fatal(err)
	}
	f, err := forwarder.New(sub, pub, forwarder.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	runForwarder(t, f)
	attempts := waitAllPublished(t, tbl, n)
	for i, id := range ids {
		want := 1
		if i%10 == 3 {
			want = 2
		}
		if attempts[id] != want {
			t.Errorf("row %d: %d attempts, want %d", i, attempts[id], want)
		}
	}
	pub.mu.Lock()
	defer pub.mu.Unlock()
	for _, id := range ids {
		if pub.published[id] != 1 {
			t.Errorf("event %s published %d times, want once", id, pub.published[id])
		}
	}
	largest := 0
	for _, c := range pub.calls {
		largest = max(largest, c)
	}
	if largest < 2 || largest > forwarder.PublishBatchSizeDefault {
		t.Errorf("largest publish call carried %d messages; want batches of 2..%d", largest, forwarder.PublishBatchSizeDefault)
	}
	t.Logf("%d publish calls for %d messages (%d failed once), largest %d", len(pub.calls), n, n/10, largest)
}

// plainFailingPublisher is a plain message.Publisher (no PublishBatch) that
// takes 5 ms per call, like a broker round trip, and fails whole calls: the
// first failCalls calls carrying more than one message.
type plainFailingPublisher struct {
	failCalls int64

	mu        sync.Mutex
	calls     int64
	failedIDs map[string]int // event_id -> times in a failed call
	published map[string]int
	largest   int
}

func (p *plainFailingPublisher) Publish(_ string, msgs ...*message.Message) error {
	time.Sleep(5 * time.Millisecond)
	p.mu.Lock()
	defer p.mu.Unlock()
	p.largest = max(p.largest, len(msgs))
	if len(msgs) > 1 && p.calls < p.failCalls {
		p.calls++
		for _, m := range msgs {
			p.failedIDs[m.UUID]++
		}
		return errors.New("broker refused the call")
	}
	for _, m := range msgs {
		p.published[m.UUID]++
	}
	return nil
}

func (p *plainFailingPublisher) Close() error { return nil }

// TestBatchPlainPublisherFailedCallNacksAll: with a plain publisher and
// BatchSize set, messages go out in Publish(topic, msgs...) calls; a failed
// call nacks every message in it (each such row has one more attempt), and
// nothing is lost: every row ends published.
func TestBatchPlainPublisherFailedCallNacksAll(t *testing.T) {
	t.Parallel()
	tbl := testdb.Table(t, "fwd_batch_plain_outbox", schema.WithAllColumns())
	const n = 400
	ids, _, _ := enqueueMany(t, tbl, n, 0, func(i int) string { return `{"i":` + strconv.Itoa(i) + `}` })
	pub := &plainFailingPublisher{failCalls: 3, failedIDs: map[string]int{}, published: map[string]int{}}
	sub, err := subscriber.New(context.Background(), testdb.Pool(t), subscriber.Config{Table: tbl, PollInterval: 50 * time.Millisecond,
		Backoff: func(int) time.Duration { return 10 * time.Millisecond }}, watermill.NopLogger{})

	if err != nil {
		t.Fatal(err)
	}
	f, err := forwarder.New(sub, pub, forwarder.Config{BatchSize: 50, MaxPublishes: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	runForwarder(t, f)
	attempts := waitAllPublished(t, tbl, n)
	pub.mu.Lock()
	defer pub.mu.Unlock()
	if pub.calls != 3 || len(pub.failedIDs) < 6 {
		t.Fatalf("%d failed calls over %d messages; want 3 failed calls of several messages", pub.calls, len(pub.failedIDs))
	}
	if pub.largest < 2 || pub.largest > 50 {
		t.Errorf("largest call %d, want 2..50", pub.largest)
	}
	for _, id := range ids {
		if want := 1 + pub.failedIDs[id]; attempts[id] != want {
			t.Errorf("event %s: %d attempts, in %d failed calls: want %d", id, attempts[id], pub.failedIDs[id], want)
		}
		if pub.published[id] != 1 {
			t.Errorf("event %s published %d times", id, pub.published[id])
		}
	}
}

// blockingPublisher blocks every call until release is closed.
type blockingPublisher struct {
	release   chan struct{}
	started   chan struct{}
	published atomic.Int64
}

func (p *blockingPublisher) Publish(_ string, msgs ...*message.Message) error {
	select {
	case p.started <- struct{}{}:
	default:
	}
	<-p.release
	p.published.Add(int64(len(msgs)))
	return nil
}

func (p *blockingPublisher) Close() error { return nil }

// TestBatchHandleGivesUpWithItsContext: a message queued behind a publish
// call that does not return is nacked when its context ends (the dispatch
// timeout), and is not published afterwards by a later call.
func TestBatchHandleGivesUpWithItsContext(t *testing.T) {
	t.Parallel()
	tbl := testdb.Table(t, "fwd_batch_ctx_outbox", schema.WithAllColumns())
	sub, err := subscriber.New(context.Background(), testdb.Pool(t), subscriber.Config{Table: tbl}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	pub := &blockingPublisher{release: make(chan struct{}), started: make(chan struct{}, 1)}
	f, err := forwarder.New(sub, pub, forwarder.Config{BatchSize: 10, MaxPublishes: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	newMsg := func(ctx context.Context) *message.Message {
		m := message.NewMessage(uuid.NewString(), []byte(`{}`))
		m.Metadata.Set(schema.MetadataTopic, topic)
		m.SetContext(ctx)
		return m
	}
	first := make(chan error, 1)
	go func() { first <- f.Handle(newMsg(context.Background())) }()
	<-pub.started // the only call slot is taken and blocks
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if err := f.Handle(newMsg(ctx)); err == nil || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("queued message whose context ended: %v, want a deadline error", err)
	}
	close(pub.release)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	// A later message is published alone: the abandoned one left the queue.
	if err := f.Handle(newMsg(context.Background())); err != nil {
		t.Fatal(err)
	}
	if got := pub.published.Load(); got != 2 {
		t.Fatalf("%d messages published, want 2 (the abandoned one must not be)", got)
	}
}

// failingBatchPublisher wraps a BatchPublisher and fails every n-th message
// it is handed, per message.
type failingBatchPublisher struct {
	forwarder.BatchPublisher
	n     int64
	count atomic.Int64
	calls atomic.Int64
	most  atomic.Int64
}

func (p *failingBatchPublisher) PublishBatch(topic string, msgs []*message.Message) []error {
	p.calls.Add(1)
	for {
		m := p.most.Load()
		if int64(len(msgs)) <= m || p.most.CompareAndSwap(m, int64(len(msgs))) {
			break
		}
	}
	var pass []*message.Message
	var idx []int
	errs := make([]error, len(msgs))
	for i, m := range msgs {
		if p.count.Add(1)%p.n == 0 {
			errs[i] = errors.New("injected failure of one message")
			continue
		}
		pass, idx = append(pass, m), append(idx, i)
	}
	for j, err := range p.BatchPublisher.PublishBatch(topic, pass) {
		errs[idx[j]] = err
	}
	return errs
}

// TestBatchOrderedToKafka: two ordered relays forward keyed rows through
// the batching forwarder to Kafka (kfake, 3 partitions), with one message
// in seven failing inside its batch. Every key's records share one
// partition, carry the key as record key, and their first occurrences are
// in sequence order; every event arrives; calls carried several messages.
func TestBatchOrderedToKafka(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "fwd_batch_ordered_outbox", schema.WithAllColumns())
	cluster, err := kafkatest.Start(3, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer cluster.Close()
	kp, err := kafkabackend.NewPublisher(cluster.Brokers(), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer kp.Close()
	bp, ok := kp.(forwarder.BatchPublisher)
	if !ok {
		t.Fatalf("kafkabackend's publisher %T is not a forwarder.BatchPublisher", kp)
	}
	pub := &failingBatchPublisher{BatchPublisher: bp, n: 7}
	const n, keys = 1000, 20
	_, seqOf, keyOf := enqueueMany(t, tbl, n, keys, func(i int) string { return `{"i":` + strconv.Itoa(i) + `}` })
	cfg := subscriber.Config{Table: tbl, Ordered: true, LockTTL: time.Second, ElectionInterval: 100 * time.Millisecond,
		Backoff: func(int) time.Duration { return 10 * time.Millisecond }, MaxAttempts: 1000}
	for range 2 {
		sub, err := subscriber.New(context.Background(), pool, cfg, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		f, err := forwarder.New(sub, pub, forwarder.Config{}, nil)
		if err != nil {
			t.Fatal(err)
		}
		runForwarder(t, f)
	}

	ks, err := cluster.NewSubscriber("batch-ordered", watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer ks.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	ch, err := ks.Subscribe(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	firsts := map[string][]int64{}
	partition := map[string]int32{}
	seen := map[string]bool{}
	for len(seen) < n {
		select {
		case m := <-ch:
			p, _ := kafka.MessagePartitionFromCtx(m.Context())
			key, _ := kafka.MessageKeyFromCtx(m.Context())
			k := keyOf[m.UUID]
			if string(key) != k {
				t.Errorf("event %s: record key %q, want the ordering key %q", m.UUID, key, k)
			}
			if q, ok := partition[k]; ok && q != p {
				t.Errorf("key %s in partitions %d and %d", k, q, p)
			}
			partition[k] = p
			if !seen[m.UUID] {
				seen[m.UUID] = true
				firsts[k] = append(firsts[k], seqOf[m.UUID])
			}
			m.Ack()
		case <-ctx.Done():
			t.Fatalf("%d of %d events reached Kafka", len(seen), n)
		}
	}
	for k, seqs := range firsts {
		for i := 1; i < len(seqs); i++ {
			if seqs[i] <= seqs[i-1] {
				t.Fatalf("key %s: first occurrences at the broker out of order: %v", k, seqs)
			}
		}
	}
	if pub.most.Load() < 2 {
		t.Errorf("no publish call carried more than one message (%d calls)", pub.calls.Load())
	}
	t.Logf("%d events over %d keys; %d publish calls, largest %d; %d messages handed to the publisher", len(seen), len(firsts), pub.calls.Load(), pub.most.Load(), pub.count.Load())
}
