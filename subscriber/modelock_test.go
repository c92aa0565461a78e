package subscriber_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// TestRelayModeRefusalHoldsWhileBothCouldRun: an idle default-mode relay
// without the single-active lock (nothing leased, no lock of the election)
// keeps ordered relays out, both at New and at Subscribe of an ordered
// Subscriber made before it subscribed; the refusal names the session that
// shows it; the reverse holds too; and once the default relay closed, an
// ordered relay starts.
func TestRelayModeRefusalHoldsWhileBothCouldRun(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	early := orderedSub(t, pool, orderedCfg(tbl)) // made while no relay runs
	def := orderedSub(t, pool, subscriber.Config{Table: tbl, DisableSingleActive: true, LockTTL: time.Second, PollInterval: 100 * time.Millisecond})
	ch, err := def.Subscribe(context.Background(), subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for msg := range ch {
			msg.Ack()
		}
	}()
	_, err = subscriber.New(context.Background(), pool, orderedCfg(tbl), nil)
	if !errors.Is(err, schema.ErrRelayModeMix) {
		t.Fatalf("ordered relay beside an idle default relay: %v, want ErrRelayModeMix", err)
	}
	if !strings.Contains(err.Error(), "default-mode relay is subscribed") && !strings.Contains(err.Error(), "in this process") {
		t.Errorf("refusal does not say what shows the default relay: %v", err)
	}
	if _, err := early.Subscribe(context.Background(), subscriber.AllTopics); !errors.Is(err, schema.ErrRelayModeMix) {
		t.Fatalf("Subscribe of an ordered relay made before the default relay started: %v, want ErrRelayModeMix", err)
	}
	if err := def.Close(); err != nil {
		t.Fatal(err)
	}
	o := subOnceOtherModeGone(t, pool, orderedCfg(tbl))
	rec := newRecorder()
	consume(t, o, rec, nil)
	events := enqueueKeyed(t, pool, tbl, "k", "k", "k")
	rec.waitAcked(t, events, 30*time.Second)
	rec.checkOrder(t)
	if _, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: tbl, DisableSingleActive: true}, nil); !errors.Is(err, schema.ErrRelayModeMix) ||
		!strings.Contains(err.Error(), "an ordered-mode relay is subscribed") {
		t.Fatalf("default relay beside a subscribed ordered relay: %v, want ErrRelayModeMix naming the subscribed ordered relay", err)
	}
}

// TestRelayModeStaleLeaseProvesNothing: a keyed row leased an hour ago by
// a default-mode relay that was killed does not keep ordered relays out
// (and the refusal never names a relay that does not run); the row is
// delivered by the ordered relay.
func TestRelayModeStaleLeaseProvesNothing(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	events := enqueueKeyed(t, pool, tbl, "k", "k")
	if _, err := pool.Exec(context.Background(), `UPDATE `+tbl.Sanitize()+` SET locked_at = now() - interval '1 hour', attempts = 1,
  available_at = now() - interval '1 hour' WHERE event_id = $1`, events[0].event); err != nil {
		t.Fatal(err)
	}
	o, err := subscriber.New(context.Background(), pool, orderedCfg(tbl), nil)
	if err != nil {
		t.Fatalf("ordered relay after a stale lease: %v", err)
	}
	t.Cleanup(func() { _ = o.Close() })
	rec := newRecorder()
	consume(t, o, rec, func(*message.Message) bool { return true })
	rec.waitAcked(t, events, 30*time.Second)
	rec.checkOrder(t)
}

// subOnceOtherModeGone is orderedSub for a relay that replaces one of the
// other mode: the old relay's session may end on the server a moment after
// its Close returned (a connection closed rather than unlocked), so New is
// tried again while it refuses with schema.ErrRelayModeMix, for up to 30 s.
func subOnceOtherModeGone(t *testing.T, pool *pgxpool.Pool, cfg subscriber.Config) *subscriber.Subscriber {
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		s, err := subscriber.New(context.Background(), pool, cfg, nil)
		if err == nil {
			t.Cleanup(func() { _ = s.Close() })
			return s
		}
		if !errors.Is(err, schema.ErrRelayModeMix) || time.Now().After(deadline) {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
