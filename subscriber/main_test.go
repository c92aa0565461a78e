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
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}
