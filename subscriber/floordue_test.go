package subscriber

import (
	"context"
	"testing"
	"time"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
)

// TestFloorDue: a moved floor is written at the tick unless the xmin horizon
// is pinned; under a pinned horizon a floor that keeps moving waits
// floorEvery (LockTTL/10) after the last write, a floor that stopped moving
// is written at the next tick, and the lease is renewed every LockTTL/3
// whatever the floor does.
func TestFloorDue(t *testing.T) {
	t.Parallel()
	times := timesOf(Config{LockTTL: time.Minute, ElectionInterval: time.Minute}) // floorEvery 6 s, renewal 20 s
	now := time.Now()
	for _, c := range []struct {
		name                   string
		floor, persisted, tick int64
		open                   bool
		pinned                 bool
		since                  time.Duration // since the last write
		want                   bool
	}{
		{"moved, horizon free", 10, 5, 8, true, false, time.Second, true},
		{"moved, pinned, still moving", 10, 5, 8, true, true, time.Second, false},
		{"moved, pinned, still moving, floorEvery passed", 10, 5, 8, true, true, 6 * time.Second, true},
		{"moved, pinned, stopped moving, nothing open", 10, 5, 10, false, true, time.Second, true},
		{"moved, pinned, unmoved since the tick but rows open", 10, 5, 10, true, true, time.Second, false},
		{"not moved since the write", 10, 10, 10, false, false, time.Second, false},
		{"not moved, lease due", 10, 10, 10, false, true, 20 * time.Second, true},
	} {
		p := &partState{floor: c.floor, persisted: c.persisted, ticked: c.tick, open: map[int64]struct{}{}, renewed: now.Add(-c.since)}
		if c.open {
			p.open[c.floor+1] = struct{}{}
		}
		if got := p.floorDue(c.pinned, now, times); got != c.want {
			t.Errorf("%s: floorDue = %v, want %v", c.name, got, c.want)
		}
		if p.ticked != c.floor {
			t.Errorf("%s: the tick did not record the floor (%d, want %d)", c.name, p.ticked, c.floor)
		}
	}
}

// TestHorizonWatchSeesAPin: while a transaction holds a transaction id, the
// ordered relay reads the xmin horizon as pinned once pinnedAfter has passed
// (whatever else runs on the server: another pin only makes it pinned
// sooner).
func TestHorizonWatchSeesAPin(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	pin, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = pin.Rollback(ctx) }()
	if _, err := pin.Exec(ctx, `SELECT txid_current()`); err != nil {
		t.Fatal(err)
	}
	var w horizonWatch
	const after = 200 * time.Millisecond
	for start := time.Now(); !w.pinned(ctx, pool, after); time.Sleep(50 * time.Millisecond) {
		if time.Since(start) > time.Minute {
			t.Fatal("a transaction has held an xid open for a minute and the horizon does not read as pinned")
		}
	}
}
