package inbox_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/outboxkit/watermill-outbox/inbox"
	"github.com/outboxkit/watermill-outbox/internal/doccheck"
)

// TestRetryBeforeTheInbox proves the middleware order docs/CONSUMERS.md
// gives: a router-wide middleware.Retry added before the inbox middleware
// runs each attempt in a transaction of its own, so a failed attempt's
// writes roll back and the retry's commit once per event. It also shows
// what the document warns of: a Retry added after the inbox middleware
// (router-wide, after the handler's AddMiddleware) runs inside the inbox
// transaction, and the failed attempt's writes commit with the retry's.
func TestRetryBeforeTheInbox(t *testing.T) {
	t.Parallel()
	doc := doccheck.Doc(t, "..", "CONSUMERS.md")
	doccheck.ExpectIn(t, "CONSUMERS.md", doc,
		doccheck.Normalize("r.AddMiddleware(subscriber.CaptureError, retry.Middleware, middleware.Recoverer) // router-wide, outermost first, before the inbox"),
		doccheck.Normalize("Add `middleware.Retry` before (outside) the inbox middleware"),
	)
	const events = 5
	for _, tc := range []struct {
		name         string
		retryOutside bool
		want         int
	}{
		{"documented order: Retry before the inbox", true, events},
		{"Retry after the inbox", false, 2 * events},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := setup(t)
			ib := e.newInbox(t, inbox.Config{})
			logger := watermill.NopLogger{}
			pubsub := newGoChannel(logger)
			defer pubsub.Close()
			r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
			if err != nil {
				t.Fatal(err)
			}
			retry := middleware.Retry{MaxRetries: 3, InitialInterval: time.Millisecond}
			if tc.retryOutside {
				r.AddMiddleware(retry.Middleware, middleware.Recoverer)
			} else {
				r.AddMiddleware(middleware.Recoverer)
			}
			var mu sync.Mutex
			attempts := map[string]int{}
			write := e.effect("billing", 0, nil)
			r.AddConsumerHandler("billing", "orders", pubsub, func(msg *message.Message) error {
				mu.Lock()
				attempts[msg.UUID]++
				n := attempts[msg.UUID]
				mu.Unlock()
				if _, err := write(msg); err != nil {
					return err
				}
				if n == 1 {
					return errors.New("the first attempt fails after its write")
				}
				return nil
			}).AddMiddleware(ib.Middleware)
			if !tc.retryOutside {
				r.AddMiddleware(retry.Middleware) // after the handler's: inside the inbox
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- r.Run(ctx) }()
			<-r.Running()
			for range events {
				if err := pubsub.Publish("orders", newMsg()); err != nil {
					t.Fatal(err)
				}
			}
			deadline := time.Now().Add(2 * time.Minute)
			for e.records(t, "billing") < events && time.Now().Before(deadline) {
				time.Sleep(20 * time.Millisecond)
			}
			if err := r.Close(); err != nil {
				t.Fatal(err)
			}
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			if got := e.records(t, "billing"); got != events {
				t.Fatalf("inbox records = %d, want %d", got, events)
			}
			mu.Lock()
			defer mu.Unlock()
			for id, n := range attempts {
				if n != 2 {
					t.Errorf("event %s: %d attempts, want 2 (a failure, then Retry's success)", id, n)
				}
			}
			if got := e.effectsOf(t, "billing"); got != tc.want {
				t.Errorf("effects = %d, want %d", got, tc.want)
			}
		})
	}
}
