package walrelay

import "testing"

func TestSnapshotSees(t *testing.T) {
	snap, err := parseSnapshot("100:110:103,107")
	if err != nil {
		t.Fatal(err)
	}
	for xid, want := range map[uint32]bool{99: true, 100: true, 103: false, 105: true, 107: false, 109: true, 110: false, 111: false} {
		if got := snap.sees(xid); got != want {
			t.Errorf("sees(%d) = %v, want %v", xid, got, want)
		}
	}
	// Across an epoch: xid8 2^32+5 is 32-bit 5; 2^32-3 is the epoch before.
	const epoch = uint64(1) << 32
	wrap := snapshot{xmin: epoch + 2, xmax: epoch + 10, xip: map[uint64]bool{epoch + 5: true}}
	for xid, want := range map[uint32]bool{^uint32(0) - 2: true, 1: true, 5: false, 6: true, 10: false} {
		if got := wrap.sees(xid); got != want {
			t.Errorf("across the epoch: sees(%d) = %v, want %v", xid, got, want)
		}
	}
	if !precedes(^uint32(0), epoch+1) || precedes(3, epoch+1) || precedes(1, epoch+1) {
		t.Error("precedes: wrong across the epoch")
	}
	for _, bad := range []string{"", "1:2", "x:2:", "1:y:", "1:2:z"} {
		if _, err := parseSnapshot(bad); err == nil {
			t.Errorf("parseSnapshot(%q): no error", bad)
		}
	}
}

func TestVisibleDelay(t *testing.T) {
	if visibleDelay(0) != visibleRetry || visibleDelay(1) != 2*visibleRetry || visibleDelay(100) != visibleRetryMax {
		t.Errorf("delays: %v %v %v", visibleDelay(0), visibleDelay(1), visibleDelay(100))
	}
}
