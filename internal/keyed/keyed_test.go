package keyed

import (
	"errors"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestSlotsNeverExceedTheLimit(t *testing.T) {
	t.Parallel()
	var stale int
	var mu sync.Mutex
	s := NewSlots(8, func() int { mu.Lock(); defer mu.Unlock(); return stale })
	mu.Lock()
	stale = 3 // three copies of ended terms are out
	mu.Unlock()
	if got := s.Reserve(10); got != 5 {
		t.Fatalf("Reserve(10) with 3 stale copies of 8 = %d, want 5", got)
	}
	if got := s.Reserve(1); got != 0 {
		t.Fatalf("Reserve(1) when full = %d", got)
	}
	if !s.Full() || s.InUse() != 8 {
		t.Fatalf("Full %v InUse %d", s.Full(), s.InUse())
	}
	s.Unreserve(5)
	select {
	case <-s.Freed():
	default:
		t.Fatal("Unreserve did not signal Freed")
	}
	// Concurrent reservers: the peak never passes the limit.
	mu.Lock()
	stale = 0
	mu.Unlock()
	var (
		wg   sync.WaitGroup
		peak int64
		pmu  sync.Mutex
		held int64
	)
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 2000 {
				n := s.Reserve(3)
				pmu.Lock()
				held += int64(n)
				peak = max(peak, held)
				pmu.Unlock()
				pmu.Lock()
				held -= int64(n)
				pmu.Unlock()
				s.Unreserve(n)
			}
		}()
	}
	wg.Wait()
	if peak > 8 {
		t.Fatalf("peak %d slots out of 8", peak)
	}
	if s.InUse() != 0 {
		t.Fatalf("InUse %d after all gave back", s.InUse())
	}
}

func TestWaitersOldestFirstOnce(t *testing.T) {
	t.Parallel()
	var w Waiters
	for _, k := range []string{"b", "a", "b", "c", "a"} {
		w.Add(k)
	}
	var got []string
	for k, ok := w.Pop(); ok; k, ok = w.Pop() {
		got = append(got, k)
	}
	if strings.Join(got, ",") != "b,a,c" {
		t.Fatalf("served %v, want b,a,c", got)
	}
	w.Add("a")
	if k, _ := w.Pop(); k != "a" {
		t.Fatalf("a key added again after it was served waits again: got %q", k)
	}
}

func TestJudge(t *testing.T) {
	t.Parallel()
	errPerm := errors.New("no route")
	p := Policy{
		MaxAttempts:       3,
		Backoff:           func(n int) time.Duration { return time.Duration(n) * time.Second },
		LastErrorMaxBytes: 200,
		Permanent:         func(err error) bool { return errors.Is(err, errPerm) },
	}
	payload := []byte(`{"card":"4111111111111111"}`)
	cases := []struct {
		name     string
		err      error
		attempts int
		dead     bool
		retry    time.Duration
		summary  string
	}{
		{"first failure retries", errors.New("broker down"), 1, false, time.Second, "broker down"},
		{"the last attempt is dead", errors.New("broker down"), 3, true, 3 * time.Second, "broker down"},
		{"permanent is dead at once", errPerm, 1, true, time.Second, "no route"},
		{"nacked without an error", nil, 2, false, 2 * time.Second, "without an error"},
		{"the payload never reaches the summary", errors.New(`bad {"card":"4111111111111111"}`), 1, false, time.Second, "bad"},
	}
	for _, c := range cases {
		f := p.Judge(c.err, c.attempts, payload)
		if f.Dead != c.dead || f.RetryIn != c.retry || !strings.Contains(f.Summary, c.summary) {
			t.Errorf("%s: %+v", c.name, f)
		}
		if strings.Contains(f.Summary, "4111111111111111") {
			t.Errorf("%s: summary holds the payload: %q", c.name, f.Summary)
		}
	}
}

func TestHoldStates(t *testing.T) {
	t.Parallel()
	// The words and their order are runbook.HoldState's (checked there
	// against these by TestHoldStateWordsAreTheCore's words).
	want := []string{"retrying", "dead", "skip_requested", "replay", "draining", "resolved"}
	for i, s := range []HoldState{Retrying, Dead, SkipRequested, Replayed, Draining, Resolved} {
		if int(s) != i+1 || s.String() != want[i] {
			t.Errorf("state %d is %q, want %d %q", s, s, i+1, want[i])
		}
	}
	cases := []struct {
		dead, skip, replay, resolved bool
		want                         HoldState
	}{
		{false, false, false, false, Retrying},
		{true, false, false, false, Dead},
		{true, true, false, false, SkipRequested},
		{true, true, true, true, Resolved},
		{false, false, true, false, Replayed},
		{true, false, true, false, Dead},
	}
	for _, c := range cases {
		if got := StateOf(c.dead, c.skip, c.replay, c.resolved); got != c.want {
			t.Errorf("StateOf(dead %v, skip %v, replay %v, resolved %v) = %s, want %s", c.dead, c.skip, c.replay, c.resolved, got, c.want)
		}
	}
	now := time.Now()
	h := Hold{State: Retrying, DueAt: now.Add(time.Second)}
	if h.Due(now) || !h.Due(now.Add(time.Second)) || !h.Open() {
		t.Fatal("a retrying hold is due at its DueAt and open")
	}
	h.State = Dead
	if h.Due(now.Add(time.Hour)) {
		t.Fatal("a dead hold is never due")
	}
	h.State = Resolved
	if h.Open() {
		t.Fatal("a resolved hold is not open")
	}
}
