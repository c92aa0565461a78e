package walrelay_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/walrelay"
)

// TestSwitchRefusedWhileWALRelayStandsBy: a WAL relay subscribed but not
// streaming (a standby whose slot's reader just closed, waiting for its
// next election) keeps every switch of mode out: the switch refuses with
// schema.ErrRelayModeMix and changes nothing. Before the presence lock, the
// switch saw an inactive slot and was accepted beside the standby
// (TestSwitchHistory found it).
func TestSwitchRefusedWhileWALRelayStandsBy(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	ctx := context.Background()
	active := relay(t, pool, tbl, nil)
	newRecorder().consume(t, active, nil)
	waitFor(t, 15*time.Second, "the first relay holds the slot", active.Active)
	standby := relay(t, pool, tbl, func(c *walrelay.Config) { c.ElectionInterval = 10 * time.Minute })
	newRecorder().consume(t, standby, nil)
	if err := active.Close(); err != nil {
		t.Fatal(err)
	}
	// The slot is inactive now, and the standby looks again in 10 minutes.
	err := schema.Migrate(ctx, pool, tbl, schema.WithAllColumns(), schema.WithMode(schema.ModeOrdered))
	if !errors.Is(err, schema.ErrRelayModeMix) {
		t.Fatalf("switch to ordered mode beside a subscribed WAL relay: %v, want schema.ErrRelayModeMix", err)
	}
	if rec, ok, err := schema.RecordedMode(ctx, pool, tbl); err != nil || !ok || rec.Mode != schema.ModeWAL {
		t.Fatalf("after the refused switch the recorded mode is %q (%t, %v), want wal", rec.Mode, ok, err)
	}
	if err := standby.Close(); err != nil {
		t.Fatal(err)
	}
	if err := schema.Migrate(ctx, pool, tbl, schema.WithAllColumns(), schema.WithMode(schema.ModeOrdered)); err != nil {
		t.Fatalf("switch once no WAL relay is subscribed: %v", err)
	}
}

// TestWALRelayStandsByOnATableSwitchedAway: a WAL relay made before the
// table was switched to another mode, subscribed after it, streams
// nothing: it recreates no slot (the switch dropped it) and delivers no
// row, so it never relays beside the new mode's relays.
func TestWALRelayStandsByOnATableSwitchedAway(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	ctx := context.Background()
	late := relay(t, pool, tbl, nil) // New records wal: nothing is subscribed yet
	if err := schema.Migrate(ctx, pool, tbl, schema.WithMode(schema.ModeDefault)); err != nil {
		t.Fatalf("switch to the default mode: %v", err)
	}
	rec := newRecorder()
	rec.consume(t, late, nil)
	ids := enqueue(t, pool, tbl, "k", "")
	time.Sleep(1500 * time.Millisecond) // 15 of its elections: a session would have streamed by now
	for _, id := range ids {
		if rec.has(id) {
			t.Fatalf("the WAL relay delivered %s on a table switched to the default mode", id)
		}
	}
	var slots int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1`, walrelay.DefaultNames(tbl).Slot).Scan(&slots); err != nil {
		t.Fatal(err)
	}
	if slots != 0 {
		t.Fatalf("the WAL relay recreated its slot on a table switched away from it")
	}
	if late.Active() {
		t.Fatal("the WAL relay reports itself active on a table switched away from it")
	}
	// Standing by, it holds no presence lock: the table's next switch
	// does not wait for it (as a default or ordered relay gives its mode
	// lock back on a table switched away).
	if err := schema.SwitchMode(ctx, pool, tbl, schema.ModeOrdered, "test"); err != nil {
		t.Fatalf("switch default -> ordered beside a WAL relay standing by on a table switched away: %v, want it accepted", err)
	}
	// Switched back to the WAL relay, it takes its lock again and streams:
	// it recreates the slot and delivers the rows nobody delivered.
	if err := schema.SwitchMode(ctx, pool, tbl, schema.ModeWAL, "test"); err != nil {
		t.Fatalf("switch ordered -> wal: %v", err)
	}
	waitFor(t, 30*time.Second, "the WAL relay streams again once its table is switched back", late.Active)
	rec.waitAcked(t, ids, 30*time.Second)
	err := schema.SwitchMode(ctx, pool, tbl, schema.ModeDefault, "test")
	if !errors.Is(err, schema.ErrRelayModeMix) {
		t.Fatalf("switch wal -> default beside the streaming WAL relay: %v, want schema.ErrRelayModeMix", err)
	}
}
