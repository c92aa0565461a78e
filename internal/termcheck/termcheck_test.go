package termcheck_test

import (
	"strings"
	"testing"

	"github.com/outboxkit/watermill-outbox/internal/termcheck"
)

const good = `package relay

import (
	"context"

	"github.com/outboxkit/watermill-outbox/internal/term"
)

type relay struct {
	terms *term.Ledger
	out   chan int
}

func (r *relay) deliver(ctx context.Context, t *term.Term) {
	t2 := r.terms.Begin(ctx, 0, 1)
	_, _ = t2.Hand(ctx, "k", nil)
	r.out <- 1
}
`

// TestViolations: the checker passes a relay that keeps to the core and
// names each way of leaving it.
func TestViolations(t *testing.T) {
	t.Parallel()
	v, err := termcheck.Violations(map[string][]byte{"good.go": []byte(good)})
	if err != nil {
		t.Fatal(err)
	}
	if len(v) != 0 {
		t.Fatalf("a relay on the core: %v, want no violation", v)
	}
	for name, c := range map[string]struct{ src, want string }{
		"no import": {strings.Replace(good, `"github.com/outboxkit/watermill-outbox/internal/term"`, `term "example.com/other"`, 1), "does not import"},
		"no begin":  {strings.Replace(good, "r.terms.Begin(ctx, 0, 1)", "t", 1), "begins no term"},
		"no hand":   {strings.Replace(good, `_, _ = t2.Hand(ctx, "k", nil)`, "_ = t2", 1), "sends to the consumer without term.Term.Hand"},
		"own stale": {strings.Replace(good, "out   chan int", "out   chan int\n\tstaleKeys map[string]int", 1), "field staleKeys"},
		"stale var": {good + "\nvar staleN int\n", "variable staleN"},
		"afterfunc": {strings.Replace(good, "r.out <- 1", "context.AfterFunc(ctx, func() {})\n\tr.out <- 1", 1), "context.AfterFunc"},
	} {
		v, err := termcheck.Violations(map[string][]byte{"bad.go": []byte(c.src)})
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if !strings.Contains(strings.Join(v, "\n"), c.want) {
			t.Errorf("%s: violations %v, want one saying %q", name, v, c.want)
		}
	}
}
