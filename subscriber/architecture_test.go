package subscriber

import (
	"fmt"
	"strings"
	"testing"

	"github.com/outboxkit/watermill-outbox/internal/doccheck"
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
		fmt.Sprintf("Defaults: batch %d, poll interval %s, lease (`LockTTL`) %s, %d attempts", BatchSizeDefault, d(PollIntervalDefault), d(LockTTLDefault), MaxAttemptsDefault),
		fmt.Sprintf("`backoff(n) = min(%s * 2^(n-1), %s) + jitter(0..%s)`", d(b.Base), d(b.Max), d(b.Jitter)),
		fmt.Sprintf("A woken relay waits %s (`wakeCoalesce`", d(wakeCoalesce)),
		fmt.Sprintf("claims again after %s ms, then every %s (`idleRetryMax`), and after %d such retries", strings.Join(steps, ", "), d(idleRetryMax), idleRetryPatience),
		fmt.Sprintf("every %s (`idleRetryLong`)", d(idleRetryLong)),
		fmt.Sprintf("`coveredRecheck` (%s)", d(coveredRecheck)),
		fmt.Sprintf("(`linger`: %s, plus %s per event/s of the recent rate, at most %s)", d(lingerMin), d(lingerPerRate), d(lingerMax)),
		fmt.Sprintf("(`LastErrorMaxBytes`, %d)", LastErrorMaxBytesDefault),
	)
}
