package walrelay_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxkit/watermill-outbox/walrelay"
)

// TestWALDispatchTimeout: a handler that waits for its message's context
// sees it end at DispatchTimeout (deadline exceeded, not the session's
// end), nacks, and the row is delivered again and acked. Before, the WAL
// relay had no DispatchTimeout: the context ended only with the session,
// and such a handler kept its key for good. A negative DispatchTimeout is
// refused.
func TestWALDispatchTimeout(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	if _, err := walrelay.New(context.Background(), pool, walrelay.Config{Table: tbl, DispatchTimeout: -time.Second}, watermill.NopLogger{}); err == nil || !strings.Contains(err.Error(), "DispatchTimeout") {
		t.Fatalf("a negative DispatchTimeout: %v, want a config error naming it", err)
	}
	const timeout = 300 * time.Millisecond
	var (
		mu      sync.Mutex
		first   = true
		waited  time.Duration
		ctxErr  error
		handled = make(chan struct{})
	)
	rec := newRecorder()
	rec.consume(t, relay(t, pool, tbl, func(c *walrelay.Config) { c.DispatchTimeout = timeout }), func(msg *message.Message) error {
		mu.Lock()
		again := !first
		first = false
		mu.Unlock()
		if again {
			return nil
		}
		start := time.Now()
		select {
		case <-msg.Context().Done():
		case <-time.After(30 * time.Second):
		}
		mu.Lock()
		waited, ctxErr = time.Since(start), msg.Context().Err()
		mu.Unlock()
		close(handled)
		return errors.New("handler timed out")
	})
	ids := enqueue(t, pool, tbl, "k")
	select {
	case <-handled:
	case <-time.After(40 * time.Second):
		t.Fatal("the handler did not return")
	}
	rec.waitAcked(t, ids, 30*time.Second)
	mu.Lock()
	defer mu.Unlock()
	if !errors.Is(ctxErr, context.DeadlineExceeded) || waited >= 30*time.Second {
		t.Fatalf("the message's context ended with %v after %s; want its DispatchTimeout (%s) deadline", ctxErr, waited, timeout)
	}
}
