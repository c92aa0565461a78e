package walrelay_test

import (
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
)

// TestMain fails the package when a goroutine outlives the tests. Sarama's
// metrics registry (the conformance suite's Kafka case) starts one
// process-wide meter goroutine that no Close ends; it is the only
// exception.
func TestMain(m *testing.M) {
	code := m.Run()
	testdb.ClosePool()
	if code == 0 {
		if err := goleak.Find(goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick")); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}
