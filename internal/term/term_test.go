package term_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.uber.org/goleak"

	"github.com/outboxkit/watermill-outbox/internal/term"
)

// TestMain fails the package when a goroutine outlives the tests: every
// follower of a stale copy ends by Close at the latest (nothing waits forever).
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func msg() *message.Message { return message.NewMessage("id", nil) }

// ends records the stale copies' ends that OnStaleEnd reports.
type ends struct {
	mu  sync.Mutex
	got []string
	ch  chan string
}

func newEnds() *ends { return &ends{ch: make(chan string, 100)} }

func (e *ends) record(key string, why term.Reason) {
	s := key + ":" + why.String()
	e.mu.Lock()
	e.got = append(e.got, s)
	e.mu.Unlock()
	e.ch <- s
}

func (e *ends) wait(t *testing.T, want string) {
	t.Helper()
	select {
	case got := <-e.ch:
		if got != want {
			t.Fatalf("stale copy ended as %q, want %q", got, want)
		}
	case <-time.After(5 * time.Second):
		t.Fatalf("stale copy did not end (want %q)", want)
	}
}

func ledger(t *testing.T, overrun time.Duration) (*term.Ledger, *ends) {
	t.Helper()
	e := newEnds()
	l := term.New(term.Config{Overrun: overrun, OnStaleEnd: e.record})
	t.Cleanup(l.Close)
	return l, e
}

func hand(t *testing.T, tm *term.Term, key string, m *message.Message) *term.Copy {
	t.Helper()
	c, err := tm.Hand(context.Background(), key, m)
	if err != nil {
		t.Fatalf("hand %s: %v", key, err)
	}
	return c
}

func freed(t *testing.T, l *term.Ledger) {
	t.Helper()
	select {
	case <-l.Freed():
	case <-time.After(5 * time.Second):
		t.Fatal("Freed not signalled")
	}
}

func done(ctx context.Context) bool { return ctx.Err() != nil }

// TestEndCancelsEveryCopy (a term's end cancels its messages): End cancels the term's context and the
// context of every message still out under it before it returns; a message
// whose copy ended has its context cancelled too; Hand under an ended term
// fails.
func TestEndCancelsEveryCopy(t *testing.T) {
	t.Parallel()
	l, _ := ledger(t, time.Hour)
	type ctxKey struct{}
	parent := context.WithValue(context.Background(), ctxKey{}, "v")
	tm := l.Begin(parent, 1, 7)
	if tm.Epoch() != 7 || tm.Scope() != 1 || !tm.Live() {
		t.Fatalf("term epoch %d scope %d live %v, want 7, 1, live", tm.Epoch(), tm.Scope(), tm.Live())
	}
	if tm.Context().Value(ctxKey{}) != "v" {
		t.Error("the term's context lost its parent's values")
	}
	a, b, settled := msg(), msg(), msg()
	hand(t, tm, "a", a)
	hand(t, tm, "b", b)
	cs := hand(t, tm, "s", settled)
	if a.Context().Value(ctxKey{}) != nil {
		t.Error("a message's context carries the term's parent values, want the Hand parent's only")
	}
	pm := msg()
	if _, err := tm.Hand(parent, "p", pm); err != nil {
		t.Fatal(err)
	}
	if pm.Context().Value(ctxKey{}) != "v" {
		t.Error("a message's context lost the Hand parent's values")
	}
	if !cs.End(term.Acked) {
		t.Error("End of a copy under a live term reported not live")
	}
	if !done(settled.Context()) {
		t.Error("the context of a message whose copy ended is live")
	}
	if done(a.Context()) || done(b.Context()) || done(tm.Context()) {
		t.Fatal("contexts cancelled before the term ended")
	}
	tm.End()
	for name, ctx := range map[string]context.Context{"a": a.Context(), "b": b.Context(), "term": tm.Context()} {
		if !done(ctx) {
			t.Errorf("context of %s not cancelled when End returned", name)
		}
	}
	if tm.Live() {
		t.Error("term live after End")
	}
	tm.End() // idempotent
	if _, err := tm.Hand(context.Background(), "c", msg()); !errors.Is(err, term.ErrEnded) {
		t.Errorf("Hand under an ended term: %v, want ErrEnded", err)
	}
}

// TestBeginEndsThePreviousTermOfItsScope (a term's end cancels its messages): a new term of a scope ends
// the live one first (its messages' contexts are cancelled, its copies
// stale); other scopes are untouched; the parent's cancellation does not
// end a term.
func TestBeginEndsThePreviousTermOfItsScope(t *testing.T) {
	t.Parallel()
	l, _ := ledger(t, time.Hour)
	parent, cancel := context.WithCancel(context.Background())
	t1 := l.Begin(parent, 0, 1)
	other := l.Begin(context.Background(), 1, 1)
	m := msg()
	hand(t, t1, "k", m)
	cancel()
	if !t1.Live() || done(t1.Context()) {
		t.Fatal("cancelling Begin's parent ended the term")
	}
	t2 := l.Begin(context.Background(), 0, 2)
	if t1.Live() || !done(m.Context()) {
		t.Error("Begin of scope 0 left its previous term live or its message's context live")
	}
	if !l.Stale("k") {
		t.Error("the previous term's copy is not stale")
	}
	if !other.Live() || !t2.Live() {
		t.Error("Begin ended a term of another scope, or its own")
	}
	m.Ack()
	freed(t, l)
}

// TestOneCopyPerKeyAcrossTerms (one copy per key): a key with a copy out cannot be handed
// out again, under its term, another scope's term or a later term of its
// scope, until the copy ends; a stale copy's key is reported by Stale.
func TestOneCopyPerKeyAcrossTerms(t *testing.T) {
	t.Parallel()
	l, e := ledger(t, time.Hour)
	t1 := l.Begin(context.Background(), 0, 1)
	t2 := l.Begin(context.Background(), 1, 1)
	m := msg()
	c := hand(t, t1, "k", m)
	for name, tm := range map[string]*term.Term{"same term": t1, "other scope": t2} {
		if _, err := tm.Hand(context.Background(), "k", msg()); !errors.Is(err, term.ErrKeyOut) {
			t.Errorf("second copy of k under the %s: %v, want ErrKeyOut", name, err)
		}
	}
	if l.Stale("k") {
		t.Error("a live term's copy reported stale")
	}
	if c.Term() != t1 || c.Key() != "k" {
		t.Error("copy's term or key wrong")
	}
	t1.End()
	t3 := l.Begin(context.Background(), 0, 2)
	if !l.Stale("k") || l.StaleCount() != 1 {
		t.Fatalf("after the term ended: Stale(k) %v, StaleCount %d; want true, 1", l.Stale("k"), l.StaleCount())
	}
	if _, err := t3.Hand(context.Background(), "k", msg()); !errors.Is(err, term.ErrKeyOut) {
		t.Errorf("k handed out by the next term while the ended term's copy is out: %v, want ErrKeyOut", err)
	}
	hand(t, t3, "other", msg()) // other keys flow
	m.Ack()
	e.wait(t, "k:ack")
	freed(t, l)
	if l.Stale("k") || l.StaleCount() != 0 {
		t.Error("k still stale after its copy's ack")
	}
	hand(t, t3, "k", msg())
}

// TestVerdictOfAnEndedTermIsNotLive (a verdict of an ended term is not progress): End reports true only for the
// call that ended a copy of a live term; a verdict seen after the term
// ended, or a second End, reports false.
func TestVerdictOfAnEndedTermIsNotLive(t *testing.T) {
	t.Parallel()
	l, e := ledger(t, time.Hour)
	tm := l.Begin(context.Background(), 0, 1)
	live := hand(t, tm, "live", msg())
	if !live.End(term.Acked) {
		t.Error("verdict under a live term: not live")
	}
	if live.End(term.Nacked) {
		t.Error("a second End reported live")
	}
	m := msg()
	late := hand(t, tm, "late", m)
	tm.End()
	m.Nack()
	if late.End(term.Nacked) {
		t.Error("a verdict after the term ended reported live: it could be recorded as progress")
	}
	e.wait(t, "late:nack")
	// Race the term's end with verdicts: each copy ends exactly once,
	// either as a live verdict (End reports true, the term found no copy
	// out) or as a stale copy (End reports false, OnStaleEnd tells).
	re := newEnds()
	re.ch = make(chan string, 1000)
	rl := term.New(term.Config{Overrun: time.Hour, OnStaleEnd: re.record})
	defer rl.Close()
	liveN := 0
	const races = 300
	for i := range races {
		tm := rl.Begin(context.Background(), 0, int64(i+2))
		c := hand(t, tm, fmt.Sprint("r", i), msg())
		var live bool
		var wg sync.WaitGroup
		wg.Add(2)
		go func() { defer wg.Done(); tm.End() }()
		go func() { defer wg.Done(); live = c.End(term.Acked) }()
		wg.Wait()
		if tm.Live() {
			t.Fatal("term not ended")
		}
		if c.End(term.Acked) {
			t.Fatal("a second End reported live")
		}
		if live {
			liveN++
		}
	}
	re.mu.Lock()
	staleN := len(re.got)
	re.mu.Unlock()
	if liveN+staleN != races {
		t.Errorf("%d live verdicts and %d stale ends of %d copies, want each copy ended once", liveN, staleN, races)
	}
	t.Logf("%d live verdicts, %d stale ends", liveN, staleN)
}

// TestStaleCopyEndsByVerdict (nothing waits forever): a stale copy ends at its message's ack
// or nack, seen by the ledger, which signals Freed.
func TestStaleCopyEndsByVerdict(t *testing.T) {
	t.Parallel()
	l, e := ledger(t, time.Hour)
	tm := l.Begin(context.Background(), 3, 1)
	a, n := msg(), msg()
	hand(t, tm, "a", a)
	hand(t, tm, "n", n)
	tm.End()
	if l.Quiesced(3) || tm.Quiesced() {
		t.Fatal("quiesced with two stale copies out")
	}
	a.Ack()
	e.wait(t, "a:ack")
	freed(t, l)
	n.Nack()
	e.wait(t, "n:nack")
	if !l.Quiesced(3) || !tm.Quiesced() || l.StaleCount() != 0 {
		t.Error("not quiesced after every stale copy's verdict")
	}
}

// TestStaleCopyEndsByOverrun (nothing waits forever): a stale copy whose handler never answers
// ends Config.Overrun after its term ended, not earlier.
func TestStaleCopyEndsByOverrun(t *testing.T) {
	t.Parallel()
	const overrun = 150 * time.Millisecond
	l, e := ledger(t, overrun)
	tm := l.Begin(context.Background(), 0, 1)
	hand(t, tm, "k", msg())
	time.Sleep(overrun) // the overrun counts from the term's end, not the hand-out
	start := time.Now()
	tm.End()
	if !l.Stale("k") {
		t.Fatal("copy not stale when its term ended")
	}
	e.wait(t, "k:overrun")
	if d := time.Since(start); d < overrun {
		t.Errorf("stale copy ended %s after its term, want at least the overrun %s", d, overrun)
	}
	if l.Stale("k") || !l.Quiesced(0) {
		t.Error("key still stale after the overrun")
	}
	// A copy the relay gave up on under a live term (its own overrun) ends
	// at once and frees its key.
	tm2 := l.Begin(context.Background(), 0, 2)
	c := hand(t, tm2, "k", msg())
	if !c.End(term.Overran) {
		t.Error("overrun under a live term reported not live")
	}
	hand(t, tm2, "k", msg())
	// Zero overrun: a stale copy holds nothing back.
	z, ze := ledger(t, 0)
	tz := z.Begin(context.Background(), 0, 1)
	hand(t, tz, "z", msg())
	tz.End()
	ze.wait(t, "z:overrun")
}

// TestWithdrawnCopyFreesItsKey: a copy the relay did not hand over after
// all (its term ended before the send) ends at once, also when stale.
func TestWithdrawnCopyFreesItsKey(t *testing.T) {
	t.Parallel()
	l, e := ledger(t, time.Hour)
	tm := l.Begin(context.Background(), 0, 1)
	c := hand(t, tm, "k", msg())
	tm.End()
	if c.End(term.Withdrawn) {
		t.Error("withdrawal under an ended term reported live")
	}
	e.wait(t, "k:withdrawn")
	if l.Stale("k") || !tm.Quiesced() {
		t.Error("withdrawn copy still holds its key")
	}
}

// TestQuiescence (quiescence): a live term has not quiesced; an ended one has once
// every copy handed out under it ended; scopes are counted apart.
func TestQuiescence(t *testing.T) {
	t.Parallel()
	l, _ := ledger(t, time.Hour)
	tm := l.Begin(context.Background(), 5, 1)
	if tm.Quiesced() {
		t.Error("a live term has quiesced")
	}
	m := msg()
	c := hand(t, tm, "k", m)
	other := l.Begin(context.Background(), 6, 1)
	om := msg()
	hand(t, other, "o", om)
	tm.End()
	other.End()
	if tm.Quiesced() || l.Quiesced(5) || l.Quiesced(6) {
		t.Error("quiesced with copies out")
	}
	if !l.Quiesced(7) {
		t.Error("a scope without terms has not quiesced")
	}
	c.End(term.Acked)
	if !tm.Quiesced() || !l.Quiesced(5) {
		t.Error("scope 5 not quiesced after its last copy ended")
	}
	if l.Quiesced(6) {
		t.Error("scope 6 quiesced with its copy out")
	}
	om.Ack()
	freed(t, l)
	waitFor(t, func() bool { return l.Quiesced(6) })
	empty := l.Begin(context.Background(), 8, 1)
	empty.End()
	if !empty.Quiesced() {
		t.Error("a term ended without copies has not quiesced")
	}
}

// TestEnterHoldsQuiescence (a verdict of an ended term is not progress, quiescence): work entered under a live term keeps
// the ended term and its scope from quiescing until it leaves; Enter under
// an ended term fails; leave is idempotent.
func TestEnterHoldsQuiescence(t *testing.T) {
	t.Parallel()
	l, _ := ledger(t, time.Hour)
	tm := l.Begin(context.Background(), 2, 1)
	leave, ok := tm.Enter()
	if !ok {
		t.Fatal("Enter under a live term failed")
	}
	tm.End()
	if tm.Quiesced() || l.Quiesced(2) {
		t.Error("quiesced while work entered under the term is under way")
	}
	if _, ok := tm.Enter(); ok {
		t.Error("Enter under an ended term succeeded: the write would run after the term ended")
	}
	leave()
	if !tm.Quiesced() || !l.Quiesced(2) {
		t.Error("not quiesced after the work left")
	}
	leave() // idempotent
	if !l.Quiesced(2) {
		t.Error("a second leave changed the count")
	}
	// Work and a stale copy together: both must end.
	t2 := l.Begin(context.Background(), 2, 2)
	m := msg()
	hand(t, t2, "k", m)
	leave2, ok := t2.Enter()
	if !ok {
		t.Fatal("Enter failed")
	}
	t2.End()
	m.Ack()
	freed(t, l)
	if l.Quiesced(2) {
		t.Error("quiesced with work under way after the copy ended")
	}
	leave2()
	if !l.Quiesced(2) {
		t.Error("not quiesced after copy and work ended")
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("condition not met")
		}
	}
}

// TestCloseEndsEverything (nothing waits forever): Close ends live terms (their messages'
// contexts cancelled) and stale copies whose handlers never answer, frees
// every key, returns only after the followers ended (goleak in TestMain),
// and is idempotent; afterwards every term begins ended.
func TestCloseEndsEverything(t *testing.T) {
	t.Parallel()
	e := newEnds()
	l := term.New(term.Config{Overrun: time.Hour, OnStaleEnd: e.record})
	t1 := l.Begin(context.Background(), 0, 1)
	t2 := l.Begin(context.Background(), 1, 1)
	ms, ml := msg(), msg()
	hand(t, t1, "stale", ms)
	t1.End()
	hand(t, t2, "live", ml)
	closed := make(chan struct{})
	go func() {
		l.Close()
		close(closed)
	}()
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("Close blocked on copies whose handlers never answer")
	}
	if !done(ml.Context()) || t2.Live() {
		t.Error("Close left a live term or its message's context")
	}
	if l.Stale("stale") || l.Stale("live") || l.StaleCount() != 0 || !l.Quiesced(0) || !l.Quiesced(1) {
		t.Error("a copy is still out after Close")
	}
	e.mu.Lock()
	got := len(e.got)
	e.mu.Unlock()
	if got != 2 {
		t.Errorf("%d stale copies ended at Close, want 2: %v", got, e.got)
	}
	l.Close()
	t3 := l.Begin(context.Background(), 0, 2)
	if t3.Live() || !done(t3.Context()) {
		t.Error("a term begun after Close is live")
	}
	if _, err := t3.Hand(context.Background(), "k", msg()); !errors.Is(err, term.ErrEnded) {
		t.Errorf("Hand after Close: %v, want ErrEnded", err)
	}
	// A second Close from another goroutine while the first one runs waits.
	l2 := term.New(term.Config{Overrun: time.Hour})
	tm := l2.Begin(context.Background(), 0, 1)
	hand(t, tm, "k", msg())
	var wg sync.WaitGroup
	for range 3 {
		wg.Add(1)
		go func() { defer wg.Done(); l2.Close() }()
	}
	wg.Wait()
	if l2.StaleCount() != 0 {
		t.Error("copies out after concurrent Closes")
	}
}

// TestConcurrentHandsKeepOneCopyPerKey (one copy per key, under -race): relays hand keys
// out under terms of several scopes that end at random while handlers hold
// messages for random times and answer; no key is ever in two handlers at
// once, and after Close nothing is out.
func TestConcurrentHandsKeepOneCopyPerKey(t *testing.T) {
	t.Parallel()
	l := term.New(term.Config{Overrun: time.Hour}) // handlers always answer here
	const (
		scopes  = 4
		keys    = 16
		workers = 8
		rounds  = 300
	)
	var (
		mu      sync.Mutex
		inHand  = map[string]int{}
		overlap []string
		handed  int
	)
	var terms [scopes]*term.Term
	var termsMu sync.Mutex
	for s := range terms {
		terms[s] = l.Begin(context.Background(), s, 1)
	}
	var handlers sync.WaitGroup
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), 1))
			for range rounds {
				time.Sleep(time.Duration(r.IntN(100)) * time.Microsecond)
				key := fmt.Sprint("k", r.IntN(keys))
				s := r.IntN(scopes)
				termsMu.Lock()
				tm := terms[s]
				if r.IntN(20) == 0 {
					tm = l.Begin(context.Background(), s, tm.Epoch()+1)
					terms[s] = tm
				}
				termsMu.Unlock()
				m := msg()
				c, err := tm.Hand(context.Background(), key, m)
				if err != nil {
					continue
				}
				mu.Lock()
				if inHand[key] > 0 {
					overlap = append(overlap, key)
				}
				inHand[key]++
				handed++
				mu.Unlock()
				hold := time.Duration(50+r.IntN(400)) * time.Microsecond
				handlers.Add(1)
				go func() {
					defer handlers.Done()
					time.Sleep(hold)
					mu.Lock()
					inHand[key]--
					mu.Unlock()
					m.Ack()
					c.End(term.Acked) // the relay's waiter; a stale copy is ended by the ledger too
				}()
			}
		}()
	}
	wg.Wait()
	handlers.Wait()
	l.Close()
	if len(overlap) > 0 {
		t.Errorf("%d times a key was in two handlers at once, first %v", len(overlap), overlap[:min(10, len(overlap))])
	}
	t.Logf("%d hand-outs of %d tries", handed, workers*rounds)
	if handed < workers*rounds/10 {
		t.Errorf("only %d hand-outs of %d tries: the test does not exercise the ledger", handed, workers*rounds)
	}
	if l.StaleCount() != 0 {
		t.Error("stale copies after Close")
	}
}

// BenchmarkHandEnd is the core's cost per delivery on a relay's hot path:
// one Hand and one End of a live copy.
func BenchmarkHandEnd(b *testing.B) {
	l := term.New(term.Config{Overrun: time.Hour})
	defer l.Close()
	tm := l.Begin(context.Background(), 0, 1)
	m := msg()
	parent := context.WithoutCancel(context.Background())
	b.ReportAllocs()
	for b.Loop() {
		c, err := tm.Hand(parent, "k", m)
		if err != nil {
			b.Fatal(err)
		}
		c.End(term.Acked)
	}
}

// TestLiveCopyOverdue: a copy out under a live term is overdue
// Config.Overdue after Delivered (not before, and never before Delivered:
// the time its message waits to be taken does not count); the
// relay then ends it (Overran), which cancels its message's context and
// frees its key. Without Config.Overdue a copy is never overdue.
func TestLiveCopyOverdue(t *testing.T) {
	t.Parallel()
	const overdue = 100 * time.Millisecond
	l := term.New(term.Config{Overrun: time.Hour, Overdue: overdue})
	t.Cleanup(l.Close)
	tm := l.Begin(context.Background(), 0, 1)
	m := msg()
	c := hand(t, tm, "k", m)
	if c.Overdue() != nil {
		t.Fatal("a copy not delivered yet can be overdue")
	}
	start := time.Now()
	c.Delivered()
	select {
	case <-c.Overdue():
	case <-time.After(time.Minute):
		t.Fatal("a live copy was not overdue after a minute")
	}
	if d := time.Since(start); d < overdue {
		t.Errorf("copy overdue %s after Hand, want at least %s", d, overdue)
	}
	if m.Context().Err() != nil {
		t.Error("an overdue copy's context ended before its relay ended it")
	}
	if !c.End(term.Overran) {
		t.Error("ending an overdue copy of a live term reported not live")
	}
	if m.Context().Err() == nil {
		t.Error("the overdue copy's context did not end with it")
	}
	hand(t, tm, "k", msg()) // the key is free again

	never, _ := ledger(t, time.Hour)
	c2 := hand(t, never.Begin(context.Background(), 0, 1), "n", msg())
	c2.Delivered()
	if c2.Overdue() != nil {
		t.Error("a copy of a ledger without Overdue can be overdue")
	}
}

// TestOverrunCopyLingersUntilItsVerdict: a copy ended by an overrun, under
// a live term (the relay gave up on it) or after its term ended
// (Config.Overrun), frees its key at once but lingers (Lingering) until its
// message's verdict, which signals Freed; a copy acked before its overrun
// does not linger, and Close ends what lingers.
func TestOverrunCopyLingersUntilItsVerdict(t *testing.T) {
	t.Parallel()
	l, e := ledger(t, 50*time.Millisecond)
	tm := l.Begin(context.Background(), 0, 1)
	live := msg()
	hand(t, tm, "live", live).End(term.Overran)
	hand(t, tm, "live", msg()) // the key is free again
	if n := l.Lingering(); n != 1 {
		t.Fatalf("Lingering after a live copy's overrun = %d, want 1", n)
	}
	live.Ack()
	freed(t, l)
	if n := l.Lingering(); n != 0 {
		t.Fatalf("Lingering after the overrun copy's ack = %d, want 0", n)
	}
	acked := msg()
	c := hand(t, tm, "acked", acked)
	acked.Ack()
	c.End(term.Overran)
	if n := l.Lingering(); n != 0 {
		t.Fatalf("Lingering after the overrun of a copy acked before = %d, want 0", n)
	}
	tm2 := l.Begin(context.Background(), 1, 1)
	stale := msg()
	hand(t, tm2, "stale", stale)
	tm2.End()
	if n := l.Lingering(); n != 1 {
		t.Fatalf("Lingering of a stale copy = %d, want 1", n)
	}
	e.wait(t, "stale:overrun")
	freed(t, l) // the stale copy's end
	if l.Stale("stale") || l.Lingering() != 1 {
		t.Fatalf("after the stale copy's overrun: Stale %v, Lingering %d; want false, 1", l.Stale("stale"), l.Lingering())
	}
	stale.Nack()
	freed(t, l)
	if n := l.Lingering(); n != 0 {
		t.Fatalf("Lingering after the stale copy's nack = %d, want 0", n)
	}
	hand(t, tm, "closed", msg()).End(term.Overran)
	l.Close()
	if n := l.Lingering(); n != 0 {
		t.Fatalf("Lingering after Close = %d, want 0", n)
	}
}
