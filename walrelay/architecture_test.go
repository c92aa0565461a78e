package walrelay

import (
	"fmt"
	"testing"
	"time"

	"github.com/outboxkit/watermill-outbox/internal/doccheck"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/termcheck"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// TestArchitectureStatesTheConstants: docs/ARCHITECTURE.md gives the WAL
// relay's defaults and bounds as the code has them.
func TestArchitectureStatesTheConstants(t *testing.T) {
	t.Parallel()
	d := doccheck.Duration
	doccheck.Expect(t, doccheck.Architecture(t, ".."),
		fmt.Sprintf("`ElectionInterval` (`subscriber.ElectionIntervalDefault`, %s)", d(subscriber.ElectionIntervalDefault)),
		fmt.Sprintf("`MaxInFlight` unsettled rows (`MaxInFlightDefault`, %s)", doccheck.Count(MaxInFlightDefault)),
		fmt.Sprintf("Every `StatusInterval` (`StatusIntervalDefault`, %s)", d(StatusIntervalDefault)),
		fmt.Sprintf("(at most %d kept)", maxCandidates),
		fmt.Sprintf("up to %d ready messages of the reader, or %d settled deliveries (`loopBatch`)", loopBatch, loopBatch),
		fmt.Sprintf("`StatusInterval/%d` (`recordSpacing`)", recordSpacing),
		fmt.Sprintf("ends after %s idle (`waiterIdle`)", d(waiterIdle)),
		fmt.Sprintf("`sqlq.WALStaleAfter` (%s)", sqlq.WALStaleAfter),
		fmt.Sprintf("`backoffReadAhead` (%d) x `MaxInFlight`", backoffReadAhead),
	)
}

// TestWALRelayUsesTheTermCore: the WAL relay imports the term core (internal/term),
// begins its terms there, hands every message to the consumer through
// term.Term.Hand, and keeps no stale-copy records of its own (no field or
// variable named stale, no context.AfterFunc): it fails if the relay stops
// using the core.
func TestWALRelayUsesTheTermCore(t *testing.T) {
	t.Parallel()
	termcheck.Expect(t, ".", "walrelay.go", "session.go", "rows.go", "dispatch.go", "holds.go")
}

// TestWALTermOverrun: a message that a session's end left in a handler holds
// its key back for CloseTimeout after the session ended at most
// (docs/WAL.md, "Sessions are terms"): the ledger's overrun.
func TestWALTermOverrun(t *testing.T) {
	t.Parallel()
	s := &Subscriber{cfg: Config{CloseTimeout: 7 * time.Second}}
	if got := s.newTerms().Overrun(); got != 7*time.Second {
		t.Errorf("WAL relay's term overrun %s, want CloseTimeout 7s", got)
	}
}
