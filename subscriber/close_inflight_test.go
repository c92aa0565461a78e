package subscriber_test

import (
	"context"
	"fmt"
	"runtime/pprof"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// closeInflightRows is more messages in flight than 1,024, the buffer whose
// overflow made a sibling relay (walrelay) hang at Close: its delivery
// goroutines, at the close timeout, each sent a "stopped" verdict into a
// channel buffered to 1,024 while the loop that should read it waited for
// them.
const closeInflightRows = 1500

// TestCloseWithUnackedInFlightDefault: default mode, 1,500 unacked messages
// in flight at Close.
func TestCloseWithUnackedInFlightDefault(t *testing.T) {
	t.Parallel()
	testCloseWithUnackedInFlight(t, false)
}

// TestCloseWithUnackedInFlightOrdered: ordered mode, 1,500 distinct ordering
// keys, so that every row is in flight at once.
func TestCloseWithUnackedInFlightOrdered(t *testing.T) {
	t.Parallel()
	testCloseWithUnackedInFlight(t, true)
}

// testCloseWithUnackedInFlight reads every row without acking any, then
// checks that Close returns soon after CloseTimeout, that the messages'
// contexts were cancelled, and that a fresh subscriber delivers every row
// again at once: the leases were given back at Close, not left to expire
// (LockTTL is an hour).
func testCloseWithUnackedInFlight(t *testing.T, ordered bool) {
	const (
		n            = closeInflightRows
		closeTimeout = 300 * time.Millisecond
	)
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "close_inflight_outbox", schema.WithOrderingKeyColumn())
	var want []string
	if ordered {
		keys := make([]string, n)
		for i := range keys {
			keys[i] = fmt.Sprintf("key-%04d", i)
		}
		for _, e := range enqueueKeyed(t, pool, tbl, keys...) {
			want = append(want, e.event.String())
		}
	} else {
		want = enqueue(t, pool, tbl, "org.close.inflight.v1", n)
	}
	cfg := subscriber.Config{
		Table:            tbl,
		Ordered:          ordered,
		BatchSize:        500,
		MaxInFlight:      n,
		CloseTimeout:     closeTimeout,
		LockTTL:          time.Hour, // a lease not given back at Close would hold its row past the test
		DispatchTimeout:  time.Hour, // no overrun nack while the messages are held
		PollInterval:     50 * time.Millisecond,
		ElectionInterval: 50 * time.Millisecond,
	}
	s, err := subscriber.New(context.Background(), pool, cfg, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	ch, err := s.Subscribe(context.Background(), subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	begin := time.Now()
	held := make([]*message.Message, 0, n) // never acked nor nacked
	readDeadline := time.After(2 * time.Minute)
	for len(held) < n {
		select {
		case msg, ok := <-ch:
			if !ok {
				t.Fatalf("channel closed after %d of %d messages", len(held), n)
			}
			held = append(held, msg)
		case <-readDeadline:
			t.Fatalf("%d of %d messages in flight after 2 minutes", len(held), n)
		}
	}
	t.Logf("%d messages in flight after %s", n, time.Since(begin).Round(time.Millisecond))

	closeBegin := time.Now()
	closed := make(chan error, 1)
	go func() { closed <- s.Close() }()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatalf("Close: %v", err)
		}
	case <-time.After(2 * time.Minute):
		var stacks strings.Builder
		_ = pprof.Lookup("goroutine").WriteTo(&stacks, 1)
		t.Fatalf("Close did not return within 2 minutes with %d unacked messages in flight (CloseTimeout %s); goroutines:\n%s",
			n, closeTimeout, stacks.String())
	}
	took := time.Since(closeBegin)
	t.Logf("Close returned after %s (CloseTimeout %s)", took.Round(time.Millisecond), closeTimeout)
	if took < closeTimeout-50*time.Millisecond {
		t.Errorf("Close returned after %s, before CloseTimeout %s: the messages in flight got no grace", took, closeTimeout)
	}
	if _, ok := <-ch; ok {
		t.Error("a message was delivered after Close")
	}
	for _, msg := range held {
		if msg.Context().Err() == nil {
			t.Fatalf("message %s: context still live after Close", msg.UUID)
		}
	}
	if !ordered {
		var locked int
		if err := pool.QueryRow(context.Background(),
			`SELECT count(*) FROM `+tbl.Sanitize()+` WHERE locked_at IS NOT NULL OR published_at IS NOT NULL`).Scan(&locked); err != nil {
			t.Fatal(err)
		}
		if locked != 0 {
			t.Fatalf("%d rows still leased or published after Close, want every lease given back", locked)
		}
	}

	// Nothing lost: a fresh subscriber delivers every row again, well before
	// LockTTL.
	again := newSub(t, pool, cfg)
	ch2, err := again.Subscribe(context.Background(), subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	redeliverBegin := time.Now()
	got := make(map[string]bool, n)
	redeliverDeadline := time.After(2 * time.Minute)
	for len(got) < n {
		select {
		case msg := <-ch2:
			got[msg.UUID] = true
			msg.Ack()
		case <-redeliverDeadline:
			t.Fatalf("%d of %d rows delivered again within 2 minutes", len(got), n)
		}
	}
	t.Logf("%d rows delivered again after %s", n, time.Since(redeliverBegin).Round(time.Millisecond))
	for _, id := range want {
		if !got[id] {
			t.Fatalf("event %s not delivered again", id)
		}
	}
}
