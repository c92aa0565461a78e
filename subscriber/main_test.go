package subscriber_test

import (
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
)

// TestMain fails the package when a goroutine outlives the tests: every
// subscriber, notifier and pool must have been closed.
func TestMain(m *testing.M) {
	if table := os.Getenv(crashRelayEnv); table != "" {
		os.Exit(crashRelay(table)) // a relay process for TestCrashedRelayRecovery, killed by it
	}
	code := m.Run()
	testdb.ClosePool()
	if code == 0 {
		// Watermill's universal suite merges 50 subscribers through its
		// test-only multiplier, whose unbuffered channel nobody reads once
		// the test has the messages it counts: a redelivery (at least once)
		// after that leaves the multiplier's forwarding goroutines blocked
		// for good. They are the harness's, not ours. Sarama's metrics
		// registry (the conformance suite's Kafka case) starts one
		// process-wide meter goroutine that no Close ends.
		if err := goleak.Find(
			goleak.IgnoreTopFunction("github.com/ThreeDotsLabs/watermill/internal/subscriber.(*multiplier).Subscribe.func2"),
			goleak.IgnoreAnyFunction("github.com/ThreeDotsLabs/watermill/internal/subscriber.(*multiplier).Subscribe.func3"),
			goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
		); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}
