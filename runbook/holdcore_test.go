package runbook

import (
	"testing"

	"github.com/outboxkit/watermill-outbox/internal/keyed"
)

// TestHoldStateWordsAreTheCore: the runbook's hold states are the relays'
// (internal/keyed): the same values, in the same order, with the same words.
func TestHoldStateWordsAreTheCore(t *testing.T) {
	t.Parallel()
	pairs := []struct {
		r HoldState
		k keyed.HoldState
	}{
		{HoldRetrying, keyed.Retrying}, {HoldDead, keyed.Dead}, {HoldSkipRequested, keyed.SkipRequested},
		{HoldReplay, keyed.Replayed}, {HoldDraining, keyed.Draining}, {HoldResolved, keyed.Resolved},
	}
	if len(pairs) != len(holdStates) {
		t.Fatalf("%d runbook hold states, %d paired with the core's", len(holdStates), len(pairs))
	}
	for _, p := range pairs {
		if int(p.r) != int(p.k) || p.r.String() != p.k.String() {
			t.Errorf("runbook %d %q, core %d %q", int(p.r), p.r, int(p.k), p.k)
		}
	}
}
