package forwarder_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/google/uuid"

	"github.com/outboxkit/watermill-outbox/forwarder"
	"github.com/outboxkit/watermill-outbox/internal/deadletter"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/router"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// The tests of this file prove forwarder.PoisonQueue's promise (README,
// step 3): every dead outbox event is copied to the poison topic once, the
// ones that die outside the handler included (issue 56 item 4), on each
// path that parks a row dead outside the router. Each waits until every
// copy there will be is counted: a copy is published (and counted, the
// poison GoChannel blocks until then) before the verdict that sends its
// row dead or deletes its death notice, so once the row is dead and the
// table holds no notice, the count is final.

// poisonCounter is a poison topic whose copies are counted by event_id.
type poisonCounter struct {
	pub    *gochannel.GoChannel
	mu     sync.Mutex
	copies map[string][]string // event_id -> the reasons of its copies
}

func newPoisonCounter(t *testing.T) *poisonCounter {
	t.Helper()
	p := &poisonCounter{copies: map[string][]string{},
		pub: gochannel.NewGoChannel(gochannel.Config{Persistent: true, BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})}
	t.Cleanup(func() { _ = p.pub.Close() })
	ch, err := p.pub.Subscribe(context.Background(), "poison")
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for m := range ch {
			p.mu.Lock()
			id := m.Metadata.Get(schema.MetadataEventID)
			p.copies[id] = append(p.copies[id], m.Metadata.Get(middleware.ReasonForPoisonedKey)+m.Metadata.Get(router.MetadataPoisonReason))
			p.mu.Unlock()
			m.Ack()
		}
	}()
	return p
}

func (p *poisonCounter) of(id uuid.UUID) []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.copies[id.String()]...)
}

func (p *poisonCounter) total() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, c := range p.copies {
		n += len(c)
	}
	return n
}

// poisonStack is a router-wide middleware stack: a poison queue that
// copies to p (or none), with fraudCheck inside it.
type poisonStack struct {
	name  string
	stack func(t *testing.T, p *poisonCounter) []message.HandlerMiddleware
}

// outboxPoisonQueue is forwarder.PoisonQueue router-wide, as the README
// adds it.
func outboxPoisonQueue(t *testing.T, p *poisonCounter) []message.HandlerMiddleware {
	pq, err := forwarder.PoisonQueue(p.pub, "poison")
	if err != nil {
		t.Fatal(err)
	}
	return []message.HandlerMiddleware{subscriber.CaptureError, pq, fraudCheck(true)}
}

var poisonStacks = []poisonStack{
	{"forwarder.PoisonQueue", outboxPoisonQueue},
	{"middleware.PoisonQueue", func(t *testing.T, p *poisonCounter) []message.HandlerMiddleware {
		pq, err := middleware.PoisonQueue(p.pub, "poison")
		if err != nil {
			t.Fatal(err)
		}
		return []message.HandlerMiddleware{pq, fraudCheck(true)}
	}},
	{"router.Middlewares", func(_ *testing.T, p *poisonCounter) []message.HandlerMiddleware {
		return append(router.MustMiddlewares(router.MiddlewareConfig{PoisonPublisher: p.pub, PoisonTopic: "poison", MaxAttempts: poisonMaxAttempts}), fraudCheck(true))
	}},
	{"NoPoisonQueue", func(*testing.T, *poisonCounter) []message.HandlerMiddleware {
		return []message.HandlerMiddleware{subscriber.CaptureError, fraudCheck(true)}
	}},
}

// relayTo runs a user's router until the test ends: the default relay on
// tbl (MaxAttempts poisonMaxAttempts, a 50 ms poll; cfg changes the rest)
// forwarded with AddTo to an in-process destination that takes every
// message, with stack router-wide. It returns once the router runs.
func relayTo(t *testing.T, tbl schema.Table, stack []message.HandlerMiddleware, cfg func(*subscriber.Config)) {
	t.Helper()
	c := subscriber.Config{Table: tbl, PollInterval: 50 * time.Millisecond, MaxAttempts: poisonMaxAttempts,
		Backoff: func(int) time.Duration { return 10 * time.Millisecond }}
	if cfg != nil {
		cfg(&c)
	}
	sub, err := subscriber.New(context.Background(), testdb.Pool(t), c, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	dest := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{}) // no subscriber: every publish succeeds
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(stack...)
	f, err := forwarder.New(sub, dest, forwarder.Config{Middleware: []message.HandlerMiddleware{}}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	f.AddTo(r)
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	t.Cleanup(func() {
		if err := r.Close(); err != nil {
			t.Errorf("close router: %v", err)
		}
		if err := <-done; err != nil {
			t.Errorf("router run: %v", err)
		}
		_ = dest.Close()
	})
	<-r.Running()
}

// insertKilled writes a row leased on its last allowed attempt by a relay
// that was killed: leased at lockedAt, never renewed.
func insertKilled(t *testing.T, tbl schema.Table, topic, lockedAt string) uuid.UUID {
	t.Helper()
	id := uuid.New()
	if _, err := testdb.Pool(t).Exec(context.Background(), `INSERT INTO `+tbl.Sanitize()+` (tenant_id, topic, payload, event_id, attempts, locked_at, available_at)
VALUES ($1::uuid, $2, '{"order":"fine"}', $3::uuid, $4::int, `+lockedAt+`, `+lockedAt+`)`, uuid.NewString(), topic, id.String(), poisonMaxAttempts); err != nil {
		t.Fatal(err)
	}
	return id
}

// insertBadHeaders writes a row whose headers column is a JSON array.
func insertBadHeaders(t *testing.T, tbl schema.Table) uuid.UUID {
	t.Helper()
	id := uuid.New()
	if _, err := testdb.Pool(t).Exec(context.Background(), `INSERT INTO `+tbl.Sanitize()+` (tenant_id, topic, payload, event_id, headers)
VALUES ($1::uuid, $2, '{"order":"fine"}', $3::uuid, '["not", "an", "object"]')`, uuid.NewString(), topic, id.String()); err != nil {
		t.Fatal(err)
	}
	return id
}

// notices counts the death notices tbl holds.
func notices(t *testing.T, tbl schema.Table) int {
	t.Helper()
	var n int
	if err := testdb.Pool(t).QueryRow(context.Background(), `SELECT count(*) FROM `+sqlq.DeadNoticesTable(tbl)).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// waitNoNotices waits until tbl holds no death notice: every notice was
// answered by a router (or dropped).
func waitNoNotices(t *testing.T, tbl schema.Table) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for notices(t, tbl) > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d death notices still in %s", notices(t, tbl), sqlq.DeadNoticesTable(tbl))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// deadWith reads a row that must be dead and never published and returns
// its last_error.
func deadWith(t *testing.T, tbl schema.Table, id uuid.UUID) string {
	t.Helper()
	var (
		published, dead bool
		lastError       *string
	)
	if err := testdb.Pool(t).QueryRow(context.Background(), `SELECT published_at IS NOT NULL, dead_at IS NOT NULL, last_error FROM `+tbl.Sanitize()+` WHERE event_id = $1`, id).
		Scan(&published, &dead, &lastError); err != nil {
		t.Fatal(err)
	}
	if published || !dead || lastError == nil {
		t.Fatalf("event %s: published %v dead %v last_error %v, want dead, never published", id, published, dead, lastError)
	}
	return *lastError
}

// replay replays a dead row and waits until it is published.
func replay(t *testing.T, tbl schema.Table, id uuid.UUID) {
	t.Helper()
	if _, err := runbook.New(testdb.Pool(t), tbl).ReplayEvent(context.Background(), id, runbook.ReplayOptions{}); err != nil {
		t.Fatalf("replay %s: %v", id, err)
	}
	waitRow(t, tbl, id.String(), func(published, _ bool, _ int) bool { return published })
}

// TestPoisonQueueCopiesEveryDeadEvent (issue 56 item 4): with a poison
// queue router-wide (forwarder.PoisonQueue, Watermill's
// middleware.PoisonQueue, or router.Middlewares with a poison publisher),
// every dead event is copied once with its cause as the reason, also the
// two that die outside the handler: a row whose headers column is a JSON
// array (handed to the router without its headers, refused) and a row
// whose relay was killed on its last allowed attempt (parked dead by the
// next claim, which records its death notice; the relay hands the notice to
// the router). Each row is dead with its cause as last_error, never marked
// published, and a replay delivers it once its cause is fixed, with no
// second copy. Without a poison queue the same rows go dead, no copy is
// made, and the death notice is answered once (the forwarder refuses it),
// not delivered again. Before, only the refused row was copied
// (TestPoisonQueueCopiesOnlyDeathsInsideIt).
func TestPoisonQueueCopiesEveryDeadEvent(t *testing.T) {
	t.Parallel()
	for _, st := range poisonStacks {
		t.Run(st.name, func(t *testing.T) {
			t.Parallel()
			tbl := testdb.Table(t, "fwd_pq_every_outbox", schema.WithAllColumns())
			p := newPoisonCounter(t)
			flagged := enqueueIn(t, tbl, producerSpan(t), `{"order":"flagged"}`)
			badHeaders := insertBadHeaders(t, tbl)
			// LockTTL 4 s: the bounded claim's sweep, which finds the
			// killed row's expired lease below the bound, runs every second.
			relayTo(t, tbl, st.stack(t, p), func(c *subscriber.Config) { c.LockTTL = 4 * time.Second })
			waitRow(t, tbl, flagged.String(), func(_, dead bool, _ int) bool { return dead })
			waitRow(t, tbl, badHeaders.String(), func(_, dead bool, _ int) bool { return dead })
			// Leased by a relay that was killed, after this relay became
			// the leader: its next claim parks it dead.
			killed := insertKilled(t, tbl, topic, "now() - interval '1 hour'")
			waitRow(t, tbl, killed.String(), func(_, dead bool, _ int) bool { return dead })
			waitNoNotices(t, tbl)
			want := 1
			if st.name == "NoPoisonQueue" {
				want = 0
			}
			for _, c := range []struct {
				name  string
				id    uuid.UUID
				cause string
			}{
				{"the refused row", flagged, "fraud check: order flagged"},
				{"the row with headers that are not a JSON object", badHeaders, "headers column is not a JSON object"},
				{"the row killed on its last attempt", killed, "lease of attempt 3 expired"},
			} {
				if le := deadWith(t, tbl, c.id); !strings.Contains(le, c.cause) {
					t.Errorf("%s: last_error %q, want it to name %q", c.name, le, c.cause)
				}
				reasons := p.of(c.id)
				if len(reasons) != want {
					t.Errorf("%s: %d poison copies, want %d: %q", c.name, len(reasons), want, reasons)
				}
				if want == 1 && len(reasons) == 1 && !strings.Contains(reasons[0], c.cause) {
					t.Errorf("%s: the poison copy's reason is %q, want it to name %q", c.name, reasons[0], c.cause)
				}
			}
			// Fixed, each is delivered again and published; no copy more.
			if _, err := testdb.Pool(t).Exec(context.Background(), `UPDATE `+tbl.Sanitize()+` SET headers = '{"fixed":"yes"}' WHERE event_id = $1`, badHeaders); err != nil {
				t.Fatal(err)
			}
			if _, err := testdb.Pool(t).Exec(context.Background(), `UPDATE `+tbl.Sanitize()+` SET payload = '{"order":"fine"}' WHERE event_id = $1`, flagged); err != nil {
				t.Fatal(err)
			}
			for _, id := range []uuid.UUID{flagged, badHeaders, killed} {
				replay(t, tbl, id)
			}
			if got := p.total(); got != 3*want {
				t.Errorf("%d poison copies in all after the replays, want %d", got, 3*want)
			}
		})
	}
}

// TestPoisonQueueCopiesDeathOnTakeOver: a single-active relay that is
// elected takes back the leases the previous leader left; one on its last
// allowed attempt is parked dead with its death notice in the same
// statement, and the new leader hands the notice to the router: one copy,
// with the take-back as the reason.
func TestPoisonQueueCopiesDeathOnTakeOver(t *testing.T) {
	t.Parallel()
	tbl := testdb.Table(t, "fwd_pq_takeback_outbox", schema.WithAllColumns())
	p := newPoisonCounter(t)
	killed := insertKilled(t, tbl, topic, "now()") // its holder died a moment ago
	relayTo(t, tbl, outboxPoisonQueue(t, p), nil)
	waitRow(t, tbl, killed.String(), func(_, dead bool, _ int) bool { return dead })
	waitNoNotices(t, tbl)
	if le := deadWith(t, tbl, killed); !strings.Contains(le, "taken back") {
		t.Errorf("last_error %q, want the take-back", le)
	}
	if reasons := p.of(killed); len(reasons) != 1 || !strings.Contains(reasons[0], "lease of attempt 3 taken back") {
		t.Errorf("poison copies %q, want one naming the take-back", reasons)
	}
}

// TestPoisonQueueCopiesDeathOnRelease: a relay that stops while a handler
// holds a row's last allowed attempt without answering parks the row dead
// when it gives the lease back, with its death notice; the next relay
// hands the notice to its router: one copy.
func TestPoisonQueueCopiesDeathOnRelease(t *testing.T) {
	t.Parallel()
	tbl := testdb.Table(t, "fwd_pq_release_outbox", schema.WithAllColumns())
	id := enqueueIn(t, tbl, producerSpan(t), `{"order":"fine"}`)
	s, err := subscriber.New(context.Background(), testdb.Pool(t), subscriber.Config{Table: tbl, MaxAttempts: 1, PollInterval: 20 * time.Millisecond,
		CloseTimeout: 100 * time.Millisecond}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ch, err := s.Subscribe(context.Background(), subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-ch: // never answered
	case <-time.After(2 * time.Minute):
		t.Fatal("not delivered")
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if n := notices(t, tbl); n != 1 {
		t.Fatalf("%d death notices after the release, want 1", n)
	}
	p := newPoisonCounter(t)
	relayTo(t, tbl, outboxPoisonQueue(t, p), nil)
	waitNoNotices(t, tbl)
	if le := deadWith(t, tbl, id); !strings.Contains(le, "got no verdict before the relay stopped") {
		t.Errorf("last_error %q, want the release", le)
	}
	if reasons := p.of(id); len(reasons) != 1 || !strings.Contains(reasons[0], "got no verdict before the relay stopped") {
		t.Errorf("poison copies %q, want one naming the release", reasons)
	}
}

// TestDeathNoticesCopiedOnceAcrossRelays: three relays share a table
// (DisableSingleActive), each with its own router and forwarder.PoisonQueue
// to one poison topic, and 30 rows die of their killed relay: each dead
// event is copied exactly once (a notice is leased to one relay at a time).
func TestDeathNoticesCopiedOnceAcrossRelays(t *testing.T) {
	t.Parallel()
	tbl := testdb.Table(t, "fwd_pq_relays_outbox", schema.WithAllColumns())
	p := newPoisonCounter(t)
	const rows = 30
	ids := make([]uuid.UUID, rows)
	for i := range ids {
		ids[i] = insertKilled(t, tbl, topic, "now() - interval '1 hour'")
	}
	for range 3 {
		relayTo(t, tbl, outboxPoisonQueue(t, p), func(c *subscriber.Config) { c.DisableSingleActive = true; c.BatchSize = 4 })
	}
	for _, id := range ids {
		waitRow(t, tbl, id.String(), func(_, dead bool, _ int) bool { return dead })
	}
	waitNoNotices(t, tbl)
	for _, id := range ids {
		if n := len(p.of(id)); n != 1 {
			t.Errorf("event %s: %d poison copies, want 1", id, n)
		}
	}
	if got := p.total(); got != rows {
		t.Errorf("%d poison copies of %d dead events, want %d", got, rows, rows)
	}
}

// TestDeathNoticeDeliveredAgainWhenUnanswered: a death notice whose
// delivery gets no answer (the relay that handed it out stopped while its
// router held it, as a killed relay would) is counted and handed out again
// once its lease runs out: the next relay's router copies it, once. A
// notice already handed out sqlq.NoticeTries times without an answer is
// dropped, not delivered again (a notice that kills its relay does not
// make it loop): its row stays dead, without a copy.
func TestDeathNoticeDeliveredAgainWhenUnanswered(t *testing.T) {
	t.Parallel()
	tbl := testdb.Table(t, "fwd_pq_unanswered_outbox", schema.WithAllColumns())
	pool := testdb.Pool(t)
	ctx := context.Background()
	killed := insertKilled(t, tbl, topic, "now() - interval '1 hour'")
	cfg := subscriber.Config{Table: tbl, MaxAttempts: poisonMaxAttempts, PollInterval: 20 * time.Millisecond, LockTTL: time.Second,
		CloseTimeout: 100 * time.Millisecond, DisableSingleActive: true}
	s, err := subscriber.New(ctx, pool, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	// A consumer that asks for dead letters, as the forwarder does, and
	// never answers.
	ch, err := s.Subscribe(deadletter.Want(ctx), subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case m := <-ch:
		if m.UUID != killed.String() || deadletter.Cause(m.Context()) == nil {
			t.Fatalf("handed %s (cause %v), want the death notice of %s", m.UUID, deadletter.Cause(m.Context()), killed)
		}
	case <-time.After(2 * time.Minute):
		t.Fatal("the death notice was not handed out")
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	var tries int
	if err := pool.QueryRow(ctx, `SELECT tries FROM `+sqlq.DeadNoticesTable(tbl)).Scan(&tries); err != nil || tries != 1 {
		t.Fatalf("the unanswered notice: tries %d (%v), want 1", tries, err)
	}
	// A second dead row whose notice was already handed out NoticeTries
	// times, each without an answer.
	spent := insertKilled(t, tbl, topic, "now() - interval '1 hour'")
	if _, err := pool.Exec(ctx, `UPDATE `+tbl.Sanitize()+` SET dead_at = now(), available_at = 'infinity', locked_at = NULL, last_error = 'lease expired; dead' WHERE event_id = $1`, spent); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO `+sqlq.DeadNoticesTable(tbl)+` (id, dead_at, due_at, tries) SELECT id, dead_at, now(), $2 FROM `+tbl.Sanitize()+` WHERE event_id = $1`,
		spent, sqlq.NoticeTries); err != nil {
		t.Fatal(err)
	}
	p := newPoisonCounter(t)
	relayTo(t, tbl, outboxPoisonQueue(t, p), func(c *subscriber.Config) { c.LockTTL = time.Second; c.DisableSingleActive = true })
	waitNoNotices(t, tbl)
	if reasons := p.of(killed); len(reasons) != 1 || !strings.Contains(reasons[0], "lease of attempt 3 expired") {
		t.Errorf("the notice handed out again: poison copies %q, want one", reasons)
	}
	if reasons := p.of(spent); len(reasons) != 0 {
		t.Errorf("the spent notice: poison copies %q, want none", reasons)
	}
	deadWith(t, tbl, killed)
	deadWith(t, tbl, spent)
}

// TestDeathNoticesFollowTheSubscribedTopic: a forwarder subscribed to one
// topic hands its router the death notices of that topic's rows only;
// another topic's notice waits for a forwarder of its own.
func TestDeathNoticesFollowTheSubscribedTopic(t *testing.T) {
	t.Parallel()
	tbl := testdb.Table(t, "fwd_pq_topic_outbox", schema.WithAllColumns())
	p := newPoisonCounter(t)
	const other = "org.organization.deleted.v1"
	mine := insertKilled(t, tbl, topic, "now() - interval '1 hour'")
	theirs := insertKilled(t, tbl, other, "now() - interval '1 hour'")
	sub, err := subscriber.New(context.Background(), testdb.Pool(t), subscriber.Config{Table: tbl, PollInterval: 50 * time.Millisecond,
		MaxAttempts: poisonMaxAttempts, DisableSingleActive: true}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	pq, err := forwarder.PoisonQueue(p.pub, "poison")
	if err != nil {
		t.Fatal(err)
	}
	dest := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	f, err := forwarder.New(sub, dest, forwarder.Config{SubscribeTopic: topic, Middleware: []message.HandlerMiddleware{pq}}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- f.Run(context.Background()) }()
	t.Cleanup(func() {
		_ = f.Close()
		if err := <-done; err != nil {
			t.Errorf("run: %v", err)
		}
		_ = dest.Close()
	})
	// The other topic's row is parked by the forwarder's relay only when
	// a claim reaches it: a relay of every topic parks both.
	waitRow(t, tbl, mine.String(), func(_, dead bool, _ int) bool { return dead })
	deadline := time.Now().Add(2 * time.Minute)
	for len(p.of(mine)) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the subscribed topic's death notice was not copied")
		}
		time.Sleep(20 * time.Millisecond)
	}
	relayTo(t, tbl, []message.HandlerMiddleware{}, func(c *subscriber.Config) { c.DisableSingleActive = true })
	waitRow(t, tbl, theirs.String(), func(_, dead bool, _ int) bool { return dead })
	waitNoNotices(t, tbl)
	if got := len(p.of(theirs)); got != 0 {
		t.Errorf("the other topic's notice reached the topic's poison queue %d times, want 0", got)
	}
	if got := len(p.of(mine)); got != 1 {
		t.Errorf("the subscribed topic's notice: %d copies, want 1", got)
	}
}

// TestDeathNoticesNeedTheirTable: a table migrated before migration 000015
// (no <table>_dead_notices) is still relayed: a row killed on its last
// allowed attempt is parked dead as before, without a copy, and the rows
// after it are published.
func TestDeathNoticesNeedTheirTable(t *testing.T) {
	t.Parallel()
	tbl := testdb.Table(t, "fwd_pq_nonotices_outbox", schema.WithAllColumns())
	if _, err := testdb.Pool(t).Exec(context.Background(), `DROP TABLE `+sqlq.DeadNoticesTable(tbl)); err != nil {
		t.Fatal(err)
	}
	p := newPoisonCounter(t)
	killed := insertKilled(t, tbl, topic, "now() - interval '1 hour'")
	relayTo(t, tbl, outboxPoisonQueue(t, p), func(c *subscriber.Config) { c.DisableSingleActive = true })
	waitRow(t, tbl, killed.String(), func(_, dead bool, _ int) bool { return dead })
	fine := enqueueIn(t, tbl, producerSpan(t), `{"order":"fine"}`)
	waitRow(t, tbl, fine.String(), func(published, _ bool, _ int) bool { return published })
	if got := p.total(); got != 0 {
		t.Errorf("%d poison copies without the notices' table, want 0", got)
	}
	if le := deadWith(t, tbl, killed); !strings.Contains(le, "expired") {
		t.Errorf("last_error %q, want the expired lease", le)
	}
}
