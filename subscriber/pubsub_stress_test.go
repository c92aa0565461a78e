//go:build stress

package subscriber_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
)

// TestPubSubStress runs Watermill's universal suite repeatedly
// (STRESS_TEST_COUNT times, default 10): `make test_stress`.
func TestPubSubStress(t *testing.T) {
	t.Parallel()
	tests.TestPubSubStressTest(t, suiteFeatures, suiteConstructor(t), nil)
}
