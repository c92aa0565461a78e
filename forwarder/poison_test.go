package forwarder_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/outboxkit/watermill-outbox/forwarder"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/router"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

const poisonMaxAttempts = 3

// poisonRig is a user's router with router-wide middleware, the forwarder
// added with AddTo, an in-process destination and a poison topic counted on
// a GoChannel.
type poisonRig struct {
	tbl     schema.Table
	fwd     *forwarder.Forwarder
	dest    *router.InProcess
	copies  atomic.Int64
	reasons chan string
	metas   chan message.Metadata // each poison copy's metadata
}

// downPublisher is a broker that is down: every publish fails, transiently.
type downPublisher struct{ message.Publisher }

func (downPublisher) Publish(string, ...*message.Message) error {
	return errors.New("broker unavailable")
}

func newPoisonRig(t *testing.T, name string, routerWide func(poison message.Publisher) []message.HandlerMiddleware, consumer message.NoPublishHandlerFunc, down bool) *poisonRig {
	t.Helper()
	return newPoisonRigAttempts(t, name, routerWide, consumer, down, poisonMaxAttempts)
}

func newPoisonRigAttempts(t *testing.T, name string, routerWide func(poison message.Publisher) []message.HandlerMiddleware, consumer message.NoPublishHandlerFunc, down bool, maxAttempts int) *poisonRig {
	t.Helper()
	rig := &poisonRig{tbl: testdb.Table(t, name, schema.WithAllColumns()), dest: router.NewInProcess(), reasons: make(chan string, 100), metas: make(chan message.Metadata, 100)}
	t.Cleanup(func() { _ = rig.dest.Close() })
	// Publish returns once the copy is counted, so a count read after the
	// row settled is final.
	poison := gochannel.NewGoChannel(gochannel.Config{Persistent: true, BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = poison.Close() })
	copies, err := poison.Subscribe(context.Background(), "poison")
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for m := range copies {
			rig.copies.Add(1)
			reason := m.Metadata.Get(middleware.ReasonForPoisonedKey) + m.Metadata.Get(router.MetadataPoisonReason)
			select {
			case rig.reasons <- reason:
			default:
			}
			select {
			case rig.metas <- m.Metadata:
			default:
			}
			m.Ack()
		}
	}()
	sub, err := subscriber.New(context.Background(), testdb.Pool(t), subscriber.Config{Table: rig.tbl, PollInterval: 50 * time.Millisecond, MaxAttempts: maxAttempts,
		Backoff: func(int) time.Duration { return 10 * time.Millisecond }}, watermill.NopLogger{})

	if err != nil {
		t.Fatal(err)
	}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(routerWide(poison)...)
	if consumer != nil {
		r.AddConsumerHandler("consumer", topic, rig.dest, consumer)
	}
	// The router-wide stack is the user's; the forwarder adds none of its own.
	var dest message.Publisher = rig.dest
	if down {
		dest = downPublisher{rig.dest}
	}
	rig.fwd, err = forwarder.New(sub, dest, forwarder.Config{Middleware: []message.HandlerMiddleware{}}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	rig.fwd.AddTo(r)
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	t.Cleanup(func() {
		if err := r.Close(); err != nil {
			t.Errorf("close router: %v", err)
		}
		if err := <-done; err != nil {
			t.Errorf("router run: %v", err)
		}
	})
	<-r.Running()
	return rig
}

// settle waits until the row is dead or published and returns its state
// and last_error, then lets late poison copies arrive.
func (rig *poisonRig) settle(t *testing.T, eventID string) (published, dead bool, attempts int, lastError string) {
	t.Helper()
	waitRow(t, rig.tbl, eventID, func(published, dead bool, _ int) bool { return published || dead })
	var le *string
	if err := testdb.Pool(t).QueryRow(context.Background(), `SELECT published_at IS NOT NULL, dead_at IS NOT NULL, attempts, last_error FROM `+rig.tbl.Sanitize()+` WHERE event_id = $1`, eventID).
		Scan(&published, &dead, &attempts, &le); err != nil {
		t.Fatal(err)
	}
	if le != nil {
		lastError = *le
	}
	time.Sleep(300 * time.Millisecond)
	return published, dead, attempts, lastError
}

func poisonQueue(t *testing.T, filter func(error) bool) func(message.Publisher) []message.HandlerMiddleware {
	return func(pub message.Publisher) []message.HandlerMiddleware {
		pq, err := middleware.PoisonQueue(pub, "poison")
		if filter != nil {
			pq, err = middleware.PoisonQueueWithFilter(pub, "poison", filter)
		}
		if err != nil {
			t.Fatal(err)
		}
		return []message.HandlerMiddleware{pq}
	}
}

// TestPoisonQueueRouterWideNeverMarksPublished: with Watermill's own
// PoisonQueue router-wide, a failed publish swallows the forwarder's error
// and the router acks; the row must not be marked published. Such an ack
// is refused and counted, and the row goes dead at once with the publish
// error as last_error: the router's dead-letter path took it, one copy.
// With forwarder.PoisonFilter the first failures of a broker that is down
// pass through as errors, the outbox retries them, and the last attempt is
// copied once.
func TestPoisonQueueRouterWideNeverMarksPublished(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name         string
		down         bool // else: no subscriber on the destination topic
		filter       func(error) bool
		wantAttempts int
		wantError    string
		wantRefused  int64
		wantCopies   int64
	}{
		{"NoSubscriber/PoisonQueue", false, nil, 1, router.ErrNoSubscribers.Error(), 1, 1},
		{"NoSubscriber/PoisonQueueWithFilter", false, forwarder.PoisonFilter, 1, router.ErrNoSubscribers.Error(), 1, 1},
		// The poison queue copies the first failure and acks: the router's
		// dead-letter path took the event, so its row goes dead at once.
		{"BrokerDown/PoisonQueue", true, nil, 1, "broker unavailable", 1, 1},
		// The filtered queue passes the first errors on (plain nacks): only
		// the last attempt's ack is refused.
		{"BrokerDown/PoisonQueueWithFilter", true, forwarder.PoisonFilter, poisonMaxAttempts, "broker unavailable", 1, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			rig := newPoisonRig(t, "fwd_pq_outbox", poisonQueue(t, tc.filter), nil, tc.down)
			id := enqueueIn(t, rig.tbl, producerSpan(t), `{"n":1}`)
			published, dead, attempts, lastError := rig.settle(t, id.String())
			if published || !dead || attempts != tc.wantAttempts {
				t.Fatalf("published %v dead %v attempts %d, want dead after %d attempts and never published", published, dead, attempts, tc.wantAttempts)
			}
			if !strings.Contains(lastError, tc.wantError) || !strings.Contains(lastError, forwarder.ErrNotPublished.Error()) {
				t.Errorf("last_error %q, want %q and %q", lastError, tc.wantError, forwarder.ErrNotPublished)
			}
			if got := rig.fwd.RefusedAcks(); got != tc.wantRefused {
				t.Errorf("RefusedAcks %d, want %d", got, tc.wantRefused)
			}
			if got := rig.copies.Load(); got != tc.wantCopies {
				t.Errorf("%d poison copies, want %d", got, tc.wantCopies)
			}
		})
	}
}

// TestPoisonQueueRouterWideStillPublishes: the same router with a
// subscriber on the destination topic relays and marks the row published,
// refusing nothing and copying nothing.
func TestPoisonQueueRouterWideStillPublishes(t *testing.T) {
	t.Parallel()
	var handled atomic.Int64
	rig := newPoisonRig(t, "fwd_pq_ok_outbox", poisonQueue(t, nil), func(*message.Message) error {
		handled.Add(1)
		return nil
	}, false)
	id := enqueueIn(t, rig.tbl, producerSpan(t), `{"n":1}`)
	published, dead, attempts, _ := rig.settle(t, id.String())
	if !published || dead || attempts != 1 || handled.Load() != 1 {
		t.Fatalf("published %v dead %v attempts %d handled %d, want published at the first attempt", published, dead, attempts, handled.Load())
	}
	if rig.fwd.RefusedAcks() != 0 || rig.copies.Load() != 0 {
		t.Fatalf("refused %d acks, %d poison copies; want none", rig.fwd.RefusedAcks(), rig.copies.Load())
	}
}

// TestMiddlewareSkippingTheHandler: a router-wide middleware that acks
// without calling the handler publishes nothing, so the row is never marked
// published; it goes dead at once with ErrNotPublished as last_error.
func TestMiddlewareSkippingTheHandler(t *testing.T) {
	t.Parallel()
	skip := func(message.Publisher) []message.HandlerMiddleware {
		return []message.HandlerMiddleware{func(message.HandlerFunc) message.HandlerFunc {
			return func(*message.Message) ([]*message.Message, error) { return nil, nil }
		}}
	}
	rig := newPoisonRig(t, "fwd_skip_outbox", skip, func(*message.Message) error { return nil }, false)
	id := enqueueIn(t, rig.tbl, producerSpan(t), `{"n":1}`)
	published, dead, attempts, lastError := rig.settle(t, id.String())
	if want := subscriber.Permanent(forwarder.ErrNotPublished).Error(); published || !dead || attempts != 1 || lastError != want {
		t.Fatalf("published %v dead %v attempts %d last_error %q, want dead at the first attempt with %q", published, dead, attempts, lastError, want)
	}
	if got := rig.fwd.RefusedAcks(); got != 1 {
		t.Fatalf("RefusedAcks %d, want 1", got)
	}
}

// TestOutboxPoisonCopyOnceRouterWide: router.Middlewares with a poison
// publisher router-wide (as examples/existing_router could configure it),
// an in-process consumer that rejects an event as permanent: the consumer's
// handler and the forwarder's both see the failure, and the dead event is
// copied to the poison topic once, with the consumer's reason.
func TestOutboxPoisonCopyOnceRouterWide(t *testing.T) {
	t.Parallel()
	stack := func(poison message.Publisher) []message.HandlerMiddleware {
		return router.MustMiddlewares(router.MiddlewareConfig{PoisonPublisher: poison, PoisonTopic: "poison", MaxAttempts: poisonMaxAttempts})
	}
	rig := newPoisonRig(t, "fwd_copy_once_outbox", stack, func(*message.Message) error {
		return subscriber.Permanent(errors.New("malformed organization_id"))
	}, false)
	id := enqueueIn(t, rig.tbl, producerSpan(t), `{"n":1}`)
	published, dead, attempts, _ := rig.settle(t, id.String())
	if published || !dead || attempts != 1 {
		t.Fatalf("published %v dead %v attempts %d, want dead at the first attempt", published, dead, attempts)
	}
	if got := rig.copies.Load(); got != 1 {
		t.Fatalf("%d poison copies of one dead event, want 1", got)
	}
	if reason := <-rig.reasons; !strings.Contains(reason, "malformed organization_id") {
		t.Fatalf("poison reason %q, want the consumer's", reason)
	}
}

// fraudCheck is a user's router middleware that refuses flagged orders
// before the forwarder's handler runs.
func fraudCheck(permanent bool) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			if strings.Contains(string(msg.Payload), "flagged") {
				err := errors.New("fraud check: order flagged")
				if permanent {
					err = subscriber.Permanent(err)
				}
				return nil, err
			}
			return h(msg)
		}
	}
}

// TestPoisonQueueOneCopyWhateverMiddlewareFailed: the router, a
// middleware that refuses flagged orders inside a router-wide poison queue,
// MaxAttempts 5. With forwarder.PoisonQueue the dead event is copied once
// (at once for a Permanent refusal), its last_error is the refusal, no ack
// is refused, and the copy names the outbox subscriber, not the
// forwarder's wrapper; an order that is not flagged is relayed. With
// Watermill's PoisonQueueWithFilter and forwarder.PoisonFilter (which sees
// the error, not the message) the refusal is copied at its first attempt
// and acked, so the row goes dead at once: one copy too, and last_error
// names the refusal.
func TestPoisonQueueOneCopyWhateverMiddlewareFailed(t *testing.T) {
	t.Parallel()
	const maxAttempts = 5
	outboxPQ := func(permanent bool) func(message.Publisher) []message.HandlerMiddleware {
		return func(pub message.Publisher) []message.HandlerMiddleware {
			pq, err := forwarder.PoisonQueue(pub, "poison")
			if err != nil {
				t.Fatal(err)
			}
			return []message.HandlerMiddleware{subscriber.CaptureError, pq, fraudCheck(permanent)}
		}
	}
	watermillPQ := func(pub message.Publisher) []message.HandlerMiddleware {
		return append(poisonQueue(t, forwarder.PoisonFilter)(pub), fraudCheck(false))
	}
	for _, tc := range []struct {
		name         string
		stack        func(message.Publisher) []message.HandlerMiddleware
		wantAttempts int
		wantCopies   int64
		wantRefused  int64
	}{
		{"PoisonQueue", outboxPQ(false), maxAttempts, 1, 0},
		{"PoisonQueue/Permanent", outboxPQ(true), 1, 1, 0},
		{"PoisonQueueWithFilter", watermillPQ, 1, 1, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			rig := newPoisonRigAttempts(t, "fwd_pq_mw_outbox", tc.stack, func(*message.Message) error { return nil }, false, maxAttempts)
			flagged := enqueueIn(t, rig.tbl, producerSpan(t), `{"order":"flagged"}`)
			fine := enqueueIn(t, rig.tbl, producerSpan(t), `{"order":"fine"}`)
			published, dead, attempts, lastError := rig.settle(t, flagged.String())
			if published || !dead || attempts != tc.wantAttempts {
				t.Fatalf("flagged order: published %v dead %v attempts %d, want dead after %d attempts", published, dead, attempts, tc.wantAttempts)
			}
			if !strings.Contains(lastError, "fraud check: order flagged") {
				t.Errorf("last_error %q, want the refusal", lastError)
			}
			waitRow(t, rig.tbl, fine.String(), func(published, _ bool, _ int) bool { return published })
			if got := rig.copies.Load(); got != tc.wantCopies {
				t.Errorf("%d poison copies, want %d", got, tc.wantCopies)
			}
			if got := rig.fwd.RefusedAcks(); got != tc.wantRefused {
				t.Errorf("RefusedAcks %d, want %d", got, tc.wantRefused)
			}
			md := <-rig.metas
			if got := md.Get(middleware.ReasonForPoisonedKey); !strings.Contains(got, "fraud check: order flagged") {
				t.Errorf("poison copy reason %q, want the refusal", got)
			}
			if got := md.Get(middleware.PoisonedSubscriberKey); got != "subscriber.Subscriber" {
				t.Errorf("poison copy %s = %q, want subscriber.Subscriber", middleware.PoisonedSubscriberKey, got)
			}
			if got := md.Get("event_id"); got != flagged.String() {
				t.Errorf("poison copy event_id %q, want %s", got, flagged)
			}
		})
	}
}

// TestStockRetryAndPoisonQueueOneCopyPerDeadEvent: a router with Watermill's
// stock router-wide middleware.Retry inside middleware.PoisonQueue (or
// PoisonQueueWithFilter), as Watermill's documentation sets them up, over a
// real default relay and PostgreSQL. Each event whose publish keeps failing
// (a broker that is down) or that a middleware refuses is retried by the
// router's Retry, copied once by the poison queue and acked: its row goes
// dead at once with the failure as last_error (without the payload), is
// never marked published, and is copied exactly once. Before, the forwarder
// nacked the ack and the relay delivered the row again, one copy per
// attempt: MaxAttempts copies per dead event.
func TestStockRetryAndPoisonQueueOneCopyPerDeadEvent(t *testing.T) {
	t.Parallel()
	const maxAttempts = 4
	// handled counts the calls of the handler chain inside Retry.
	stock := func(filter func(error) bool, refuse bool, handled *atomic.Int64) func(message.Publisher) []message.HandlerMiddleware {
		return func(pub message.Publisher) []message.HandlerMiddleware {
			pq, err := middleware.PoisonQueue(pub, "poison")
			if filter != nil {
				pq, err = middleware.PoisonQueueWithFilter(pub, "poison", filter)
			}
			if err != nil {
				t.Fatal(err)
			}
			count := func(h message.HandlerFunc) message.HandlerFunc {
				return func(msg *message.Message) ([]*message.Message, error) {
					handled.Add(1)
					return h(msg)
				}
			}
			stack := []message.HandlerMiddleware{pq, middleware.Retry{MaxRetries: 2, InitialInterval: time.Millisecond}.Middleware, count}
			if refuse {
				stack = append(stack, fraudCheck(false))
			}
			return stack
		}
	}
	always := func(error) bool { return true }
	for _, tc := range []struct {
		name      string
		stack     func(*atomic.Int64) func(message.Publisher) []message.HandlerMiddleware
		down      bool
		payload   string
		wantError string
	}{
		{"Retry+PoisonQueue/BrokerDown", func(h *atomic.Int64) func(message.Publisher) []message.HandlerMiddleware { return stock(nil, false, h) }, true, `{"order":"a-payload-never-in-last-error"}`, "broker unavailable"},
		{"Retry+PoisonQueueWithFilter/BrokerDown", func(h *atomic.Int64) func(message.Publisher) []message.HandlerMiddleware {
			return stock(always, false, h)
		}, true, `{"order":"a-payload-never-in-last-error"}`, "broker unavailable"},
		{"Retry+PoisonQueue/MiddlewareRefuses", func(h *atomic.Int64) func(message.Publisher) []message.HandlerMiddleware { return stock(nil, true, h) }, false, `{"order":"flagged"}`, "fraud check: order flagged"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var handled atomic.Int64
			rig := newPoisonRigAttempts(t, "fwd_stock_pq_outbox", tc.stack(&handled), func(*message.Message) error { return nil }, tc.down, maxAttempts)
			const events = 3
			ids := map[string]bool{}
			for range events {
				ids[enqueueIn(t, rig.tbl, producerSpan(t), tc.payload).String()] = true
			}
			for id := range ids {
				waitRow(t, rig.tbl, id, func(published, dead bool, _ int) bool { return published || dead })
			}
			rows, err := testdb.Pool(t).Query(context.Background(), `SELECT event_id::text, published_at IS NOT NULL, dead_at IS NOT NULL, attempts, coalesce(last_error, '') FROM `+rig.tbl.Sanitize())
			if err != nil {
				t.Fatal(err)
			}
			for rows.Next() {
				var (
					id              string
					published, dead bool
					attempts        int
					lastError       string
				)
				if err := rows.Scan(&id, &published, &dead, &attempts, &lastError); err != nil {
					t.Fatal(err)
				}
				if published || !dead || attempts != 1 {
					t.Errorf("event %s: published %v dead %v attempts %d, want dead at the first attempt, never published", id, published, dead, attempts)
				}
				if !strings.Contains(lastError, tc.wantError) || !strings.Contains(lastError, forwarder.ErrNotPublished.Error()) || strings.Contains(lastError, "a-payload-never") {
					t.Errorf("event %s: last_error %q, want %q and %q, no payload", id, lastError, tc.wantError, forwarder.ErrNotPublished)
				}
			}
			if err := rows.Err(); err != nil {
				t.Fatal(err)
			}
			// The poison copies, counted before their publish returned.
			perEvent := map[string]int{}
			for n := rig.copies.Load(); n > 0; n-- {
				md := <-rig.metas
				perEvent[md.Get(schema.MetadataEventID)]++
			}
			for id := range ids {
				if perEvent[id] != 1 {
					t.Errorf("event %s: %d poison copies, want 1", id, perEvent[id])
				}
			}
			if got := rig.copies.Load(); got != events {
				t.Errorf("%d poison copies of %d dead events, want %d", got, events, events)
			}
			if got := rig.fwd.RefusedAcks(); got != events {
				t.Errorf("RefusedAcks %d, want %d", got, events)
			}
			// The router's Retry ran each delivery 1 + MaxRetries times.
			if got := handled.Load(); got != 3*events {
				t.Errorf("handler chain ran %d times, want %d (3 per event)", got, 3*events)
			}
		})
	}
}
