package subscriber_test

import (
	"context"
	"encoding/json"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/metrics"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

const (
	topicA = "test.paused.a.v1"
	topicB = "test.paused.b.v1"
)

// pauseLog records the deliveries of a subscription, acking each.
type pauseLog struct {
	mu    sync.Mutex
	order []string          // event ids, in first-delivery order
	times map[string]int    // deliveries per event id
	at    map[string]string // event id -> topic
}

func consumePaused(t *testing.T, msgs <-chan *message.Message) *pauseLog {
	t.Helper()
	l := &pauseLog{times: map[string]int{}, at: map[string]string{}}
	go func() { // ends when the subscriber closes the channel
		for msg := range msgs {
			l.mu.Lock()
			if l.times[msg.UUID] == 0 {
				l.order = append(l.order, msg.UUID)
			}
			l.times[msg.UUID]++
			l.at[msg.UUID] = msg.Metadata.Get(schema.MetadataTopic)
			l.mu.Unlock()
			msg.Ack()
		}
	}()
	return l
}

// count returns how many distinct events of topic were delivered.
func (l *pauseLog) count(topic string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, tp := range l.at {
		if tp == topic {
			n++
		}
	}
	return n
}

func (l *pauseLog) delivered(id string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.times[id] > 0
}

func (l *pauseLog) duplicates() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, c := range l.times {
		n += c - 1
	}
	return n
}

// enqueueTopics commits one transaction with one event per (key, topic)
// pair, in order; an empty key is an unkeyed row.
func enqueueTopics(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, pairs ...[2]string) []string {
	t.Helper()
	ctx := context.Background()
	ids := make([]string, len(pairs))
	msgs := make([]publisher.Message, len(pairs))
	for i, p := range pairs {
		id := uuid.New()
		ids[i] = id.String()
		msgs[i] = publisher.Message{TenantID: tenant, Topic: p[1], EventID: id, Payload: json.RawMessage(`{}`), OrderingKey: p[0]}
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := publisher.EnqueueBatch(ctx, tx, tbl, msgs)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return ids
}

// TestPausedTopicDefaultRelay: with topic A paused, the default relay
// delivers B's rows and none of A's for more than two poll intervals; A's
// rows stay pending, untouched (attempts 0). Resumed, A's rows are
// delivered at the wake-up that ResumeTopic sends, well before the next
// poll, and a pause is read at its wake-up too; none is lost, none
// delivered twice. The relay's gauge follows.
//
// The wake-ups are shown by a second relay that polls every 10 minutes: a
// delivery (a read) within the 2-minute wait is not the poll's, however
// slow the machine. The first polls every 2 s, for the polls that must
// not deliver A.
func TestPausedTopicDefaultRelay(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "paused_outbox")
	m, err := metrics.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	const poll = 2 * time.Second
	s, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: tbl, PollInterval: poll, Metrics: m}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	sctx, stop := context.WithCancel(ctx)
	msgs, err := s.Subscribe(sctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	log := consumePaused(t, msgs)
	gauge := func(m *metrics.Metrics) float64 {
		return testutil.ToFloat64(m.PausedTopics.WithLabelValues(tbl.Qualified()))
	}

	// A first claim, so the relay is running and idle.
	enqueue(t, pool, tbl, topicB, 1)
	waitFor(t, "the first row of B was not delivered", 2*time.Minute, func() bool { return log.count(topicB) == 1 })

	res, err := runbook.New(pool, tbl).PauseTopic(ctx, topicA, "consumer of A broken", false)
	if err != nil || res.Changed != 1 || !res.Paused {
		t.Fatalf("PauseTopic: %+v, %v", res, err)
	}
	waitFor(t, "the relay did not see the pause", 2*time.Minute, func() bool { return gauge(m) == 1 })

	idsA := enqueue(t, pool, tbl, topicA, 10)
	enqueue(t, pool, tbl, topicB, 10)
	waitFor(t, "B's rows were not delivered while A is paused", 2*time.Minute, func() bool { return log.count(topicB) == 11 })
	time.Sleep(2*poll + poll/4)
	if n := log.count(topicA); n != 0 {
		t.Fatalf("%d rows of paused topic A delivered", n)
	}
	for _, id := range idsA {
		if st := state(t, pool, tbl, id); st.published || st.locked || st.attempts != 0 {
			t.Fatalf("row %s of paused topic A: %+v, want pending and untouched", id, st)
		}
	}
	bl, err := runbook.New(pool, tbl).Topics(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(bl) != 1 || bl[0].Topic != topicA || !bl[0].Paused || bl[0].Pending != 10 {
		t.Fatalf("Topics while A is paused: %+v", bl)
	}

	// The relay that polls every 10 minutes takes over.
	stop()
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	const slowPoll = 10 * time.Minute
	m2, err := metrics.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	s2 := newSub(t, pool, subscriber.Config{Table: tbl, PollInterval: slowPoll, Metrics: m2})
	msgs2, err := s2.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	log2 := consumePaused(t, msgs2)
	enqueue(t, pool, tbl, topicB, 1)
	waitFor(t, "the second relay did not deliver B's row", 2*time.Minute, func() bool { return log2.count(topicB) == 1 })
	if n := log2.count(topicA); n != 0 || gauge(m2) != 1 {
		t.Fatalf("the second relay delivered %d rows of paused topic A, outbox_paused_topics %v", n, gauge(m2))
	}

	start := time.Now()
	if res, err := runbook.New(pool, tbl).ResumeTopic(ctx, topicA, false); err != nil || res.Changed != 1 {
		t.Fatalf("ResumeTopic: %+v, %v", res, err)
	}
	waitFor(t, "A's rows not delivered at the resume's wake-up", 2*time.Minute, func() bool { return log2.count(topicA) == 10 })
	t.Logf("A's 10 rows delivered %s after the resume (PollInterval %s)", time.Since(start).Round(time.Millisecond), slowPoll)
	if gauge(m2) != 0 {
		t.Fatalf("outbox_paused_topics = %v after the resume, want 0", gauge(m2))
	}
	for _, id := range idsA {
		waitFor(t, "row of A not published", 2*time.Minute, func() bool { return state(t, pool, tbl, id).published })
	}
	if d := log.duplicates() + log2.duplicates(); d != 0 {
		t.Fatalf("%d duplicate deliveries", d)
	}
	// A pause is read at its wake-up too.
	if _, err := runbook.New(pool, tbl).PauseTopic(ctx, topicA, "again", false); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the relay did not see the pause at its wake-up", 2*time.Minute, func() bool { return gauge(m2) == 1 })
}

// TestPausedTopicTopicSubscription: a subscription to a paused topic claims
// nothing until the topic is resumed.
func TestPausedTopicTopicSubscription(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "paused_topic_sub")
	if _, err := runbook.New(pool, tbl).PauseTopic(ctx, topicA, "", false); err != nil {
		t.Fatal(err)
	}
	ids := enqueue(t, pool, tbl, topicA, 3)
	s := newSub(t, pool, subscriber.Config{Table: tbl, PollInterval: 100 * time.Millisecond})
	msgs, err := s.Subscribe(ctx, topicA)
	if err != nil {
		t.Fatal(err)
	}
	log := consumePaused(t, msgs)
	time.Sleep(500 * time.Millisecond)
	if n := log.count(topicA); n != 0 {
		t.Fatalf("%d rows of the paused topic delivered to its subscription", n)
	}
	if _, err := runbook.New(pool, tbl).ResumeTopic(ctx, topicA, false); err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		waitFor(t, "row not delivered after the resume", 2*time.Minute, func() bool { return log.delivered(id) })
	}
}

// TestPausedTopicOrderedRelay: key K has rows [A1 (topic A), B2 (topic B)],
// key L rows of topic B, and an unkeyed row of topic A. With A paused, L's
// rows are delivered; K's are not (B2 waits behind A1, though B is not
// paused) and stay in the backlog (the floor stays below them), nor is
// the unkeyed row of A. Resumed, K delivers A1 then B2, and the unkeyed
// row comes.
func TestPausedTopicOrderedRelay(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "paused_ordered", schema.WithAllColumns())
	if _, err := runbook.New(pool, tbl).PauseTopic(ctx, topicA, "incident 42", false); err != nil {
		t.Fatal(err)
	}
	ids := enqueueTopics(t, pool, tbl,
		[2]string{"K", topicA}, [2]string{"K", topicB},
		[2]string{"L", topicB}, [2]string{"L", topicB}, [2]string{"L", topicB},
		[2]string{"", topicA})
	a1, b2, unkeyedA := ids[0], ids[1], ids[5]
	cfg := orderedCfg(tbl)
	s, err := subscriber.New(context.Background(), pool, cfg, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := s.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
	}()
	msgs, err := s.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	log := consumePaused(t, msgs)
	for _, id := range ids[2:5] {
		waitFor(t, "L's rows were not delivered while A is paused", 2*time.Minute, func() bool { return log.delivered(id) })
	}
	time.Sleep(5 * cfg.PollInterval)
	for _, id := range []string{a1, b2, unkeyedA} {
		if log.delivered(id) {
			t.Fatalf("event %s delivered while topic A is paused (A1 %s, B2 %s, unkeyed A %s)", id, a1, b2, unkeyedA)
		}
	}
	backlog, err := runbook.New(pool, tbl).Backlog(ctx, runbook.BacklogOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pending := map[string]bool{}
	for _, r := range backlog {
		pending[r.EventID.String()] = true
	}
	if !pending[a1] || !pending[b2] || !pending[unkeyedA] || len(backlog) != 3 {
		t.Fatalf("backlog while A is paused: %+v; want A1, B2 and the unkeyed A row", backlog)
	}

	if _, err := runbook.New(pool, tbl).ResumeTopic(ctx, topicA, false); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{a1, b2, unkeyedA} {
		waitFor(t, "K's rows or the unkeyed A row not delivered after the resume", 2*time.Minute, func() bool { return log.delivered(id) })
	}
	log.mu.Lock()
	var k []string
	for _, id := range log.order {
		if id == a1 || id == b2 {
			k = append(k, id)
		}
	}
	log.mu.Unlock()
	if len(k) != 2 || k[0] != a1 || k[1] != b2 {
		t.Fatalf("key K delivered %v, want A1 %s then B2 %s", k, a1, b2)
	}
	if d := log.duplicates(); d != 0 {
		t.Fatalf("%d duplicate deliveries", d)
	}
}

// countLogs counts the captured Info messages msg, and whether any message
// or field mentions secret.
func countLogs(l *watermill.CaptureLoggerAdapter, msg, secret string) (n int, leaked bool) {
	for _, ms := range l.Captured() {
		for _, m := range ms {
			if m.Msg == msg && m.Level == watermill.InfoLogLevel {
				n++
			}
			for _, v := range m.Fields {
				if s, ok := v.(string); ok && secret != "" && strings.Contains(s, secret) {
					leaked = true
				}
			}
		}
	}
	return n, leaked
}

// TestPausedTopicsReadAtPollAndLoggedOnce: without notifications the relay
// reads the paused topics at PollInterval; it logs a pause and a resume
// once each at info, however many polls see them, never with the reason.
func TestPausedTopicsReadAtPollAndLoggedOnce(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "paused_poll")
	m, err := metrics.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	logs := watermill.NewCaptureLogger()
	s, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: tbl, PollInterval: 200 * time.Millisecond, DisableNotify: true, Metrics: m}, logs)
	if err != nil {
		t.Fatal(err)
	}
	msgs, err := s.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	consumePaused(t, msgs)
	gauge := func() float64 { return testutil.ToFloat64(m.PausedTopics.WithLabelValues(tbl.Qualified())) }
	const secret = "s3cr3t-in-reason"
	if _, err := runbook.New(pool, tbl).PauseTopic(ctx, topicA, "token "+secret, false); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the relay read the pause at a poll", 2*time.Minute, func() bool { return gauge() == 1 })
	time.Sleep(time.Second) // five more polls
	if _, err := runbook.New(pool, tbl).ResumeTopic(ctx, topicA, false); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the relay read the resume at a poll", 2*time.Minute, func() bool { return gauge() == 0 })
	time.Sleep(500 * time.Millisecond)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	paused, leaked := countLogs(logs, "Topic paused: its rows are not relayed until it is resumed", secret)
	resumed, _ := countLogs(logs, "Topic resumed: relaying its rows again", "")
	if paused != 1 || resumed != 1 || leaked {
		t.Fatalf("logged the pause %d times, the resume %d times (want once each), reason in the logs: %v", paused, resumed, leaked)
	}
}

// TestPausedTopicsTableMissing: a table made before migration 000007 (no
// paused topics' table) is relayed as if nothing were paused, and the relay
// says so once.
func TestPausedTopicsTableMissing(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "paused_missing")
	if _, err := pool.Exec(ctx, testdb.MigrationSQL(t, tbl, "000007", "down")); err != nil {
		t.Fatal(err)
	}
	logs := watermill.NewCaptureLogger()
	s, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: tbl, PollInterval: 100 * time.Millisecond}, logs)
	if err != nil {
		t.Fatal(err)
	}
	msgs, err := s.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	log := consumePaused(t, msgs)
	ids := enqueue(t, pool, tbl, topicA, 3)
	for _, id := range ids {
		waitFor(t, "row delivered without the paused topics' table", 2*time.Minute, func() bool { return log.delivered(id) })
	}
	time.Sleep(300 * time.Millisecond)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if n, _ := countLogs(logs, "No table of paused topics (migration 000007): nothing is paused", ""); n != 1 {
		t.Fatalf("logged the missing table %d times, want once", n)
	}
}

// TestPausedTopicInFlightFinishes: a row of a topic delivered before the
// pause is still acked (published) after it.
func TestPausedTopicInFlightFinishes(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "paused_inflight")
	m, err := metrics.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	s := newSub(t, pool, subscriber.Config{Table: tbl, PollInterval: 100 * time.Millisecond, Metrics: m})
	msgs, err := s.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	id := enqueue(t, pool, tbl, topicA, 1)[0]
	var msg *message.Message
	select {
	case msg = <-msgs:
	case <-time.After(2 * time.Minute):
		t.Fatal("the row was not delivered")
	}
	if _, err := runbook.New(pool, tbl).PauseTopic(ctx, topicA, "", false); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the relay read the pause", 2*time.Minute, func() bool {
		return testutil.ToFloat64(m.PausedTopics.WithLabelValues(tbl.Qualified())) == 1
	})
	msg.Ack()
	waitFor(t, "the in-flight row published after the pause", 2*time.Minute, func() bool { return state(t, pool, tbl, id).published })
	go func() { // ends when the subscriber closes the channel
		for m := range msgs {
			m.Ack()
		}
	}()
}

// TestPausedTopicHeldRowWaits: in ordered mode a row that failed (its key's
// hold, retrying) is not delivered again while its topic is paused, nor is
// the key's next row; resumed, the held row is delivered, then the next.
func TestPausedTopicHeldRowWaits(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "paused_held", schema.WithAllColumns())
	ids := enqueueTopics(t, pool, tbl, [2]string{"K", topicA}, [2]string{"K", topicB})
	a1, b2 := ids[0], ids[1]
	m, err := metrics.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	cfg := orderedCfg(tbl)
	cfg.Metrics = m
	cfg.Backoff = func(int) time.Duration { return 500 * time.Millisecond }
	s, err := subscriber.New(context.Background(), pool, cfg, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := s.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
	}()
	msgs, err := s.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var got []string // event id and attempt of each delivery
	go func() {
		for msg := range msgs {
			mu.Lock()
			got = append(got, msg.UUID+"/"+msg.Metadata.Get(schema.MetadataAttempts))
			first := len(got) == 1
			mu.Unlock()
			if first {
				// Pause A and, once the relay has read the pause, fail A1:
				// its retry is due in 500 ms.
				if _, err := runbook.New(pool, tbl).PauseTopic(ctx, topicA, "", false); err != nil {
					t.Error(err)
				}
				for deadline := time.Now().Add(2 * time.Minute); testutil.ToFloat64(m.PausedTopics.WithLabelValues(tbl.Qualified())) != 1; time.Sleep(10 * time.Millisecond) {
					if time.Now().After(deadline) {
						t.Error("the relay did not read the pause within 2 minutes")
						break
					}
				}
				msg.Nack()
				continue
			}
			msg.Ack()
		}
	}()
	deliveries := func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), got...)
	}
	waitFor(t, "A1 delivered once", 2*time.Minute, func() bool { return len(deliveries()) >= 1 })
	time.Sleep(2 * time.Second) // four times the retry's backoff
	if d := deliveries(); len(d) != 1 || !strings.HasPrefix(d[0], a1+"/") {
		t.Fatalf("deliveries while A is paused: %v; want A1's first only", d)
	}
	if _, err := runbook.New(pool, tbl).ResumeTopic(ctx, topicA, false); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "A1 retried and B2 delivered after the resume", 2*time.Minute, func() bool { return len(deliveries()) >= 3 })
	d := deliveries()
	if !strings.HasPrefix(d[1], a1+"/") || !strings.HasPrefix(d[2], b2+"/") {
		t.Fatalf("deliveries after the resume: %v; want A1 again, then B2", d)
	}
}
