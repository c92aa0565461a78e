package subscriber

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/outboxkit/watermill-outbox/internal/doccheck"
	"github.com/outboxkit/watermill-outbox/internal/termcheck"
)

// TestArchitectureStatesTheConstants: docs/ARCHITECTURE.md gives the
// subscriber's defaults and wake-up timings as the code has them.
func TestArchitectureStatesTheConstants(t *testing.T) {
	t.Parallel()
	d := doccheck.Duration
	var steps []string
	for n := 1; ; n++ {
		r := idleRetry(n)
		steps = append(steps, fmt.Sprint(r.Milliseconds()))
		if r == idleRetryMax {
			break
		}
	}
	b := defaultBackoff
	doccheck.Expect(t, doccheck.Architecture(t, ".."),
		fmt.Sprintf("Defaults: batch %d, poll interval %s, lease (`LockTTL`) %s, %d attempts", ClaimBatchSizeDefault, d(PollIntervalDefault), d(LockTTLDefault), MaxAttemptsDefault),
		fmt.Sprintf("`backoff(n) = min(%s * 2^(n-1), %s) + jitter(0..%s)`", d(b.Base), d(b.Max), d(b.Jitter)),
		fmt.Sprintf("A woken relay waits %s (`wakeCoalesce`", d(wakeCoalesce)),
		fmt.Sprintf("claims again after %s ms, then every %s (`idleRetryMax`), and after %d such retries", strings.Join(steps, ", "), d(idleRetryMax), idleRetryPatience),
		fmt.Sprintf("every %s (`idleRetryLong`)", d(idleRetryLong)),
		fmt.Sprintf("`coveredRecheck` (%s)", d(coveredRecheck)),
		fmt.Sprintf("(`linger`: %s, plus %s per event/s of the recent rate, at most %s)", d(lingerMin), d(lingerPerRate), d(lingerMax)),
		fmt.Sprintf("(`LastErrorMaxBytes`, %d)", LastErrorMaxBytesDefault),
		fmt.Sprintf("a *cut* read in the round trip of one claim every %s", d(boundedCutEvery)),
		fmt.Sprintf("`LEAST(statement_timestamp() - %s, xact_start of every other writer", d(boundedMargin)),
		fmt.Sprintf("trails the newest row by at most about %s of rows", d(boundedCutEvery+boundedMargin)),
	)
}

// TestOrderedRelayUsesTheTermCore: the ordered relay imports the term core (internal/term),
// begins its terms there, hands every message to the consumer through
// term.Term.Hand, and keeps no stale-copy records of its own (no field or
// variable named stale, no context.AfterFunc): it fails if the relay stops
// using the core.
func TestOrderedRelayUsesTheTermCore(t *testing.T) {
	t.Parallel()
	termcheck.Expect(t, ".", "ordered.go", "ordered_keys.go", "ordered_lease.go", "ordered_scan.go")
}

// TestOrderedTermOverrun: a message that an ended term left in a handler
// holds its partition back for DispatchTimeout + LockTTL/2 after the term
// ended at most (docs/ORDERING.md, "Terms"): the ledger's overrun.
func TestOrderedTermOverrun(t *testing.T) {
	t.Parallel()
	s := &Subscriber{cfg: Config{DispatchTimeout: 3 * time.Second, LockTTL: 2 * time.Second}}
	if got := newTermLedger(s).Overrun(); got != 4*time.Second {
		t.Errorf("ordered relay's term overrun %s, want DispatchTimeout + LockTTL/2 = 4s", got)
	}
}
