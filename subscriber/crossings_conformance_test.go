package subscriber_test

import (
	"testing"

	"github.com/outboxkit/watermill-outbox/internal/relaytest"
)

// crossingKnownBroken names the crossings (internal/relaytest/crossings.go)
// that fail for a relay today, by relay and case, with why.
var crossingKnownBroken = map[[2]string]string{}

// TestCrossing runs the crossing cases of the conformance suite against the
// default relay and ordered mode.
func TestCrossing(t *testing.T) {
	t.Parallel()
	for _, ordered := range []bool{false, true} {
		r := conformanceRelay(ordered)
		t.Run(r.Name, func(t *testing.T) {
			t.Parallel()
			for _, c := range relaytest.Crossings {
				t.Run(c.Name, func(t *testing.T) {
					t.Parallel()
					if why, ok := crossingKnownBroken[[2]string{r.Name, c.Name}]; ok {
						t.Skip("known broken: " + why)
					}
					c.Fn(t, r)
				})
			}
		})
	}
}
