package walrelay

import (
	"fmt"
	"testing"

	"github.com/outboxkit/watermill-outbox/internal/doccheck"
	"github.com/outboxkit/watermill-outbox/schema"
)

// TestArchitectureStatesTheConstants: docs/ARCHITECTURE.md gives the WAL
// relay's defaults and bounds as the code has them.
func TestArchitectureStatesTheConstants(t *testing.T) {
	t.Parallel()
	d := doccheck.Duration
	doccheck.Expect(t, doccheck.Architecture(t, ".."),
		fmt.Sprintf("`ElectionInterval` (`ElectionIntervalDefault`, %s)", d(ElectionIntervalDefault)),
		fmt.Sprintf("`MaxInFlight` unsettled rows (`MaxInFlightDefault`, %s)", doccheck.Count(MaxInFlightDefault)),
		fmt.Sprintf("Every `StatusInterval` (`StatusIntervalDefault`, %s)", d(StatusIntervalDefault)),
		fmt.Sprintf("(at most %d kept)", maxCandidates),
		fmt.Sprintf("up to %d ready messages of the reader, or %d settled deliveries (`loopBatch`)", loopBatch, loopBatch),
		fmt.Sprintf("`StatusInterval/%d` (`recordSpacing`)", recordSpacing),
		fmt.Sprintf("ends after %s idle (`waiterIdle`)", d(waiterIdle)),
		fmt.Sprintf("`schema.WALStaleAfter` (%s)", schema.WALStaleAfter),
		fmt.Sprintf("`backoffReadAhead` (%d) x `MaxInFlight`", backoffReadAhead),
	)
}
