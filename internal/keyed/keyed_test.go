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

// TestEngineOneSlotPerKeyOldestFirst: a key takes at most one slot; a key
// whose head is due later is not started and asks for a wake-up at that
// time; keys beyond the limit wait and come back oldest first as slots
// are given back.
func TestEngineOneSlotPerKeyOldestFirst(t *testing.T) {
	t.Parallel()
	slots := NewSlots(2, nil)
	e := NewEngine(slots)
	now := time.Now()
	var a, b, c, d Key
	if got := e.Start("a", &a, now); got != Started || !a.Out() {
		t.Fatalf("Start(a) = %v (out %v), want Started", got, a.Out())
	}
	if got := e.Start("a", &a, now); got != Busy || slots.InUse() != 1 {
		t.Fatalf("Start(a) again = %v with %d slots in use, want Busy and 1", got, slots.InUse())
	}
	d.RetryAt = now.Add(time.Minute)
	if got := e.Start("d", &d, now); got != Later || !e.Due().Equal(d.RetryAt) || d.Out() {
		t.Fatalf("Start(d) due in a minute = %v, Due %v, want Later and its RetryAt", got, e.Due())
	}
	if !e.At(now.Add(time.Second)) || e.At(now.Add(time.Hour)) || !e.Due().Equal(now.Add(time.Second)) {
		t.Fatalf("At keeps the earliest wake-up: Due %v", e.Due())
	}
	e.Woke()
	if !e.Due().IsZero() {
		t.Fatalf("Due after Woke = %v, want zero", e.Due())
	}
	if got := e.Start("b", &b, now); got != Started {
		t.Fatalf("Start(b) = %v, want Started", got)
	}
	if got := e.Start("c", &c, now); got != Waiting || c.Out() {
		t.Fatalf("Start(c) with no free slot = %v, want Waiting", got)
	}
	if got := e.Start("d", &d, now.Add(2*time.Minute)); got != Waiting {
		t.Fatalf("Start(d) once due, no free slot = %v, want Waiting", got)
	}
	if _, ok := e.Ready(); ok {
		t.Fatal("Ready with no free slot handed a key back")
	}
	e.Finish(&a)
	e.Finish(&a) // a second Finish gives nothing back
	if slots.InUse() != 1 {
		t.Fatalf("slots in use after Finish(a) twice = %d, want 1", slots.InUse())
	}
	if key, ok := e.Ready(); !ok || key != "c" {
		t.Fatalf("Ready = %q %v, want c (it waited first)", key, ok)
	}
	if got := e.Start("c", &c, now); got != Started {
		t.Fatalf("Start(c) after Ready = %v, want Started", got)
	}
	if _, ok := e.Ready(); ok {
		t.Fatal("Ready handed d back with no free slot")
	}
	e.Finish(&b)
	if key, ok := e.Ready(); !ok || key != "d" {
		t.Fatalf("Ready = %q %v, want d", key, ok)
	}
	if _, ok := e.Ready(); ok {
		t.Fatal("Ready handed a key back twice")
	}
}

// TestHoldNext: a requested skip moves on whatever its time; a retrying or
// replayed hold is delivered once due and waits before; a dead, draining
// or resolved hold waits.
func TestHoldNext(t *testing.T) {
	t.Parallel()
	now := time.Now()
	later := now.Add(time.Minute)
	for _, c := range []struct {
		state HoldState
		due   time.Time
		want  Step
	}{
		{SkipRequested, later, MoveOn},
		{Retrying, now, Deliver},
		{Retrying, later, Wait},
		{Replayed, now, Deliver},
		{Replayed, later, Wait},
		{Dead, now, Wait},
		{Draining, now, Wait},
		{Resolved, now, Wait},
	} {
		h := Hold{State: c.state, DueAt: c.due}
		if got := h.Next(now); got != c.want {
			t.Errorf("%s hold due %s: Next = %d, want %d", c.state, c.due.Sub(now), got, c.want)
		}
		// Waits: a retrying or replayed hold whose time has not come.
		if waits := (c.state == Retrying || c.state == Replayed) && c.due.After(now); h.Waits(now) != waits {
			t.Errorf("%s hold due %s: Waits = %v, want %v", c.state, c.due.Sub(now), h.Waits(now), waits)
		}
	}
}

// TestAlarmRingsAtTheEarliestTime: an alarm rings first at the earliest
// time asked for (an earlier one moves the ring); a stopped alarm rings no
// more and Stop is idempotent.
func TestAlarmRingsAtTheEarliestTime(t *testing.T) {
	a := NewAlarm()
	start := time.Now()
	a.At(start.Add(time.Hour))
	a.At(start.Add(20 * time.Millisecond)) // earlier: moves the ring
	a.At(start.Add(30 * time.Minute))      // later: rings in its turn
	select {
	case <-a.C():
		if d := time.Since(start); d < 20*time.Millisecond {
			t.Fatalf("rang %s after start, before the 20ms asked for", d)
		}
	case <-time.After(time.Minute):
		t.Fatal("the alarm did not ring at the earliest time asked for")
	}
	// Rung: a new time is asked afresh, however late.
	a.At(time.Now().Add(10 * time.Millisecond))
	select {
	case <-a.C():
	case <-time.After(time.Minute):
		t.Fatal("the alarm did not ring again after a new At")
	}
	a.At(time.Now().Add(10 * time.Millisecond))
	a.Stop()
	a.Stop()
	a.At(time.Now())
	select {
	case <-a.C():
		t.Fatal("a stopped alarm rang")
	case <-time.After(200 * time.Millisecond):
	}
}

// TestAlarmRingsAtEveryTime: a time asked for while an earlier one is
// pending rings in its turn after the earlier one (issue 56 item 3: the
// alarm kept only the earliest, so a loop woken for one nacked row slept
// past the others), never before it comes.
func TestAlarmRingsAtEveryTime(t *testing.T) {
	a := NewAlarm()
	defer a.Stop()
	start := time.Now()
	a.At(start.Add(20 * time.Millisecond))
	a.At(start.Add(300 * time.Millisecond))
	a.At(start.Add(300 * time.Millisecond)) // asked twice: rings once
	for i, want := range []time.Duration{20 * time.Millisecond, 300 * time.Millisecond} {
		select {
		case <-a.C():
			if d := time.Since(start); d < want {
				t.Fatalf("ring %d came %s after start, before the %s asked for", i+1, d, want)
			}
		case <-time.After(time.Minute):
			t.Fatalf("ring %d (at %s) did not come", i+1, want)
		}
	}
	select {
	case <-a.C():
		t.Fatal("a time asked for twice rang twice")
	case <-time.After(200 * time.Millisecond):
	}
}
