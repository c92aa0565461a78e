package amqpbackend

import (
	"fmt"
	"testing"

	"github.com/outboxkit/watermill-outbox/internal/doccheck"
)

// TestArchitectureStatesTheConstants: docs/ARCHITECTURE.md gives the batch
// publisher's bounds as the code has them.
func TestArchitectureStatesTheConstants(t *testing.T) {
	t.Parallel()
	doccheck.Expect(t, doccheck.Architecture(t, "../.."),
		fmt.Sprintf("awaits its confirms together, at most %s, keeping at most %d idle channels", doccheck.Duration(confirmTimeout), idleChannelsMax),
	)
}
