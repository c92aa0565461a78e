package term

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// ErrEnded is returned by Term.Hand under a term that has ended (or a
// ledger that is closed): nothing is handed out under it any more (a term's end cancels its messages).
var ErrEnded = errors.New("term: the term has ended")

// ErrKeyOut is returned by Term.Hand for a key that has a copy out, under
// this term or another one (one copy per key).
var ErrKeyOut = errors.New("term: a copy of the key is out")

// Reason is why a copy ended.
type Reason uint8

// The reasons a copy ends.
const (
	// Acked: the message was acked.
	Acked Reason = iota + 1
	// Nacked: the message was nacked.
	Nacked
	// Overran: the relay gave up on the handler, or Config.Overrun passed
	// after the copy's term ended.
	Overran
	// Withdrawn: the message was not handed over after all.
	Withdrawn
	// Closed: the ledger was closed.
	Closed
)

func (r Reason) String() string {
	switch r {
	case Acked:
		return "ack"
	case Nacked:
		return "nack"
	case Overran:
		return "overrun"
	case Withdrawn:
		return "withdrawn"
	case Closed:
		return "closed"
	}
	return "unknown"
}

// Config configures a Ledger.
type Config struct {
	// Overrun is how long a copy may stay out after its term ended before
	// the ledger ends it (Overran) and frees its key. Zero or negative: a
	// stale copy ends at once. No default.
	Overrun time.Duration
	// Overdue is how long a copy may stay out under a live term once its
	// message reached the consumer (Copy.Delivered) before it is overdue:
	// Copy.Overdue fires, and the relay gives up on the handler (it ends
	// the copy with Overran and counts a failed attempt). Zero or
	// negative: never overdue. No default.
	Overdue time.Duration
	// OnStaleEnd, when set, is called each time a stale copy ends, with its
	// key and why, on the goroutine that ended it and without the ledger's
	// lock. Defaults to nil.
	OnStaleEnd func(key string, why Reason)
}

// Ledger is one relay's record of the copies it has out, by key and by
// term. Its methods are safe for concurrent use.
type Ledger struct {
	cfg Config

	mu     sync.Mutex
	out    map[string]*Copy           // by key: every copy not ended (one copy per key: one per key)
	live   map[int]*Term              // by scope: the live term
	ended  map[int]map[*Term]struct{} // by scope: the ended terms that have not quiesced
	closed bool

	stale     atomic.Int64  // stale copies out, read without the lock
	abandoned atomic.Int64  // copies ended by an overrun whose message had no verdict yet
	freed     chan struct{} // capacity 1: a stale copy ended, or an abandoned copy's handler returned
	closing   chan struct{} // closed by Close
	wg        sync.WaitGroup
}

// New returns an empty ledger.
func New(cfg Config) *Ledger {
	return &Ledger{cfg: cfg, out: map[string]*Copy{}, live: map[int]*Term{}, ended: map[int]map[*Term]struct{}{},
		freed: make(chan struct{}, 1), closing: make(chan struct{})}
}

// Overrun is Config.Overrun: how long a copy may stay out after its term
// ended.
func (l *Ledger) Overrun() time.Duration { return l.cfg.Overrun }

// Term is one ownership of a scope: a partition lease, a replication
// session. It is live from Ledger.Begin until End (or the next Begin of its
// scope, or Ledger.Close).
type Term struct {
	l      *Ledger
	scope  int
	epoch  int64
	ctx    context.Context //nolint:containedctx // the term's own context, cancelled when it ends
	cancel context.CancelFunc

	// Under l.mu.
	ended  bool
	copies map[*Copy]struct{} // handed out under the term and not ended
	work   int                // Enter calls not left yet
}

// Copy is one message handed out under a term, until its verdict, overrun,
// withdrawal or the ledger's Close.
type Copy struct {
	t      *Term
	key    string
	msg    *message.Message
	cancel context.CancelFunc
	due    atomic.Pointer[time.Timer] // Config.Overdue after Delivered; nil: not delivered, or never overdue

	// Under t.l.mu.
	ended bool
	stale bool          // out when its term ended
	done  chan struct{} // made when the copy becomes stale, closed when it ends: its follower stops
}

// Begin starts a term of scope with the given epoch (the caller's number
// for it: a lease's epoch, a session's count). A live term of the same
// scope ends first. The term's context carries parent's values and is
// cancelled when the term ends, not when parent is. After Close, Begin
// returns a term that has ended.
func (l *Ledger) Begin(parent context.Context, scope int, epoch int64) *Term {
	ctx, cancel := context.WithCancel(context.WithoutCancel(parent))
	t := &Term{l: l, scope: scope, epoch: epoch, ctx: ctx, cancel: cancel, copies: map[*Copy]struct{}{}}
	l.mu.Lock()
	if l.closed {
		t.ended = true
		l.mu.Unlock()
		cancel()
		return t
	}
	prev := l.live[scope]
	var stale []*Copy
	if prev != nil {
		stale = l.endLocked(prev)
	}
	l.live[scope] = t
	l.mu.Unlock()
	if prev != nil {
		l.afterEnd(prev, stale)
	}
	return t
}

// Stale reports whether a copy of key handed out under a term that has
// ended is still out: a new term must not deliver the key yet (one copy per key).
func (l *Ledger) Stale(key string) bool {
	if l.stale.Load() == 0 {
		return false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	c := l.out[key]
	return c != nil && c.stale
}

// StaleCount is the number of stale copies out.
func (l *Ledger) StaleCount() int { return int(l.stale.Load()) }

// Lingering is the number of messages still in handlers that no copy of a
// live term accounts for: the stale copies out, and the copies ended by an
// overrun (Overran: the relay gave up on the handler, or Config.Overrun
// passed after the term ended) whose message has had no verdict yet. The
// relays count them against MaxInFlight (keyed.Slots' extra), so that the
// bound counts every message from its delivery until its handler returns
// (acks or nacks it), whatever the relay gave up on. Freed signals when
// one of them ends.
func (l *Ledger) Lingering() int { return int(l.stale.Load() + l.abandoned.Load()) }

// Quiesced reports whether every ended term of scope has quiesced: no copy
// handed out under one of them is out and no work entered under one of them
// is under way (quiescence).
func (l *Ledger) Quiesced(scope int) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.ended[scope]) == 0
}

// Freed receives a value after a stale copy ended or a lingering message's
// handler returned (Lingering) (capacity 1: ends in a row coalesce). One goroutine of the relay should wait on it.
func (l *Ledger) Freed() <-chan struct{} { return l.freed }

// Close ends every live term and every copy still out (Closed) and returns
// once the goroutines that follow stale copies have ended. It is idempotent;
// a second call also waits for them.
func (l *Ledger) Close() {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		l.wg.Wait()
		return
	}
	l.closed = true
	type ended struct {
		t     *Term
		stale []*Copy
	}
	var all []ended
	for _, t := range l.live {
		all = append(all, ended{t, l.endLocked(t)})
	}
	close(l.closing)
	l.mu.Unlock()
	for _, e := range all {
		l.afterEnd(e.t, e.stale)
	}
	l.wg.Wait()
}

// endLocked marks t ended and its copies still out stale, and returns them.
// A follower is counted in wg for each: afterEnd starts them.
func (l *Ledger) endLocked(t *Term) []*Copy {
	t.ended = true
	if l.live[t.scope] == t {
		delete(l.live, t.scope)
	}
	stale := make([]*Copy, 0, len(t.copies))
	for c := range t.copies {
		c.stale = true
		c.done = make(chan struct{})
		stale = append(stale, c)
	}
	if n := len(stale); n > 0 {
		l.stale.Add(int64(n))
		l.wg.Add(n)
	}
	if !t.quiescedLocked() {
		if l.ended[t.scope] == nil {
			l.ended[t.scope] = map[*Term]struct{}{}
		}
		l.ended[t.scope][t] = struct{}{}
	}
	return stale
}

// settleLocked forgets t among the ended terms of its scope once it has
// quiesced.
func (l *Ledger) settleLocked(t *Term) {
	if !t.quiescedLocked() {
		return
	}
	if m := l.ended[t.scope]; m != nil {
		delete(m, t)
		if len(m) == 0 {
			delete(l.ended, t.scope)
		}
	}
}

// afterEnd cancels the contexts of an ended term and of its stale copies,
// and follows the copies.
func (l *Ledger) afterEnd(t *Term, stale []*Copy) {
	t.cancel()
	for _, c := range stale {
		c.cancel()
	}
	for _, c := range stale {
		go l.follow(c)
	}
}

// follow ends the stale copy c at its message's verdict, at the overrun, or
// at Close, unless its relay ends it first.
func (l *Ledger) follow(c *Copy) {
	defer l.wg.Done()
	overrun := time.NewTimer(l.cfg.Overrun)
	defer overrun.Stop()
	var why Reason
	select {
	case <-c.done:
		return
	case <-c.msg.Acked():
		why = Acked
	case <-c.msg.Nacked():
		why = Nacked
	case <-overrun.C:
		why = Overran
	case <-l.closing:
		why = Closed
	}
	c.End(why)
}

// linger waits for the verdict of the message of a copy ended by an
// overrun, or for Close, then stops counting it (Lingering).
func (l *Ledger) linger(msg *message.Message) {
	defer l.wg.Done()
	select {
	case <-msg.Acked():
	case <-msg.Nacked():
	case <-l.closing:
	}
	l.abandoned.Add(-1)
	select {
	case l.freed <- struct{}{}:
	default:
	}
}

// verdict reports whether msg has been acked or nacked.
func verdict(msg *message.Message) bool {
	select {
	case <-msg.Acked():
		return true
	case <-msg.Nacked():
		return true
	default:
		return false
	}
}

// Epoch is the number the term was begun with.
func (t *Term) Epoch() int64 { return t.epoch }

// Scope is the scope the term owns.
func (t *Term) Scope() int { return t.scope }

// Context is cancelled when the term ends.
func (t *Term) Context() context.Context { return t.ctx }

// Done is closed when the term ends.
func (t *Term) Done() <-chan struct{} { return t.ctx.Done() }

// Live reports whether the term has not ended.
func (t *Term) Live() bool {
	t.l.mu.Lock()
	defer t.l.mu.Unlock()
	return !t.ended
}

// End ends the term: the contexts of the term and of every message handed
// out under it and still out are cancelled before End returns (a term's end cancels its messages), and
// those copies become stale, followed by the ledger. It is idempotent.
func (t *Term) End() {
	l := t.l
	l.mu.Lock()
	if t.ended {
		l.mu.Unlock()
		return
	}
	stale := l.endLocked(t)
	l.mu.Unlock()
	l.afterEnd(t, stale)
}

// Quiesced reports whether the term ended, every copy handed out under it
// has ended and every Enter has left (quiescence).
func (t *Term) Quiesced() bool {
	t.l.mu.Lock()
	defer t.l.mu.Unlock()
	return t.quiescedLocked()
}

func (t *Term) quiescedLocked() bool { return t.ended && len(t.copies) == 0 && t.work == 0 }

// Enter registers work under t, such as a write fenced on its epoch that
// records a verdict: until leave is called the term does not quiesce, so a
// relay that waits for quiescence before a new term of the scope never
// runs that term beside the write. It fails (ok false, nothing to leave)
// when t has ended: the work must not be done (a verdict of an ended term is not progress). leave is idempotent.
func (t *Term) Enter() (leave func(), ok bool) {
	l := t.l
	l.mu.Lock()
	defer l.mu.Unlock()
	if t.ended {
		return func() {}, false
	}
	t.work++
	var once sync.Once
	return func() {
		once.Do(func() {
			l.mu.Lock()
			t.work--
			l.settleLocked(t)
			l.mu.Unlock()
		})
	}, true
}

// Hand registers msg as a copy of key handed out under t and sets its
// context: parent's values, cancelled when the term ends or the copy ends.
// Call it before the message reaches the consumer; if it does not after
// all, end the copy with Withdrawn. It fails with ErrEnded when t has
// ended and with ErrKeyOut when a copy of key is out (one copy per key, a term's end cancels its messages).
func (t *Term) Hand(parent context.Context, key string, msg *message.Message) (*Copy, error) {
	l := t.l
	l.mu.Lock()
	defer l.mu.Unlock()
	if t.ended {
		return nil, ErrEnded
	}
	if l.out[key] != nil {
		return nil, ErrKeyOut
	}
	ctx, cancel := context.WithCancel(parent)
	msg.SetContext(ctx)
	c := &Copy{t: t, key: key, msg: msg, cancel: cancel}
	l.out[key] = c
	t.copies[c] = struct{}{}
	return c, nil
}

// Term is the term the copy was handed out under.
func (c *Copy) Term() *Term { return c.t }

// Delivered starts the copy's overdue clock: its message has reached the
// consumer (the time it waited to be taken does not count). Call it once,
// before Overdue.
func (c *Copy) Delivered() {
	if d := c.t.l.cfg.Overdue; d > 0 {
		t := time.NewTimer(d)
		if !c.due.CompareAndSwap(nil, t) {
			t.Stop()
		}
	}
}

// Overdue fires once the copy's message has been with the consumer
// Config.Overdue (never before Delivered, nor when Config.Overdue is not
// positive): its handler has not answered in the time a relay allows, and
// the relay gives up on it (End with Overran) and counts a failed attempt.
// The same rule for every keyed relay.
func (c *Copy) Overdue() <-chan time.Time {
	if t := c.due.Load(); t != nil {
		return t.C
	}
	return nil
}

// Key is the copy's key.
func (c *Copy) Key() string { return c.key }

// End ends the copy for why and cancels its message's context; it is
// idempotent. It reports whether this call ended the copy while its term
// was live: only then may the relay record the verdict (a verdict of an ended term is not progress), with a write
// fenced on the term.
func (c *Copy) End(why Reason) bool {
	l := c.t.l
	l.mu.Lock()
	if c.ended {
		l.mu.Unlock()
		return false
	}
	c.ended = true
	if c.done != nil {
		close(c.done)
	}
	delete(c.t.copies, c)
	if l.out[c.key] == c {
		delete(l.out, c.key)
	}
	live := !c.t.ended
	stale := c.stale
	if stale {
		l.stale.Add(-1)
		l.settleLocked(c.t)
	}
	// An overrun copy's handler may still run: it lingers until its
	// message's verdict (or Close).
	abandon := why == Overran && !l.closed && !verdict(c.msg)
	if abandon {
		l.abandoned.Add(1)
		l.wg.Add(1)
	}
	l.mu.Unlock()
	if abandon {
		go l.linger(c.msg)
	}
	c.cancel()
	if t := c.due.Load(); t != nil {
		t.Stop()
	}
	if stale {
		select {
		case l.freed <- struct{}{}:
		default:
		}
		if f := l.cfg.OnStaleEnd; f != nil {
			f(c.key, why)
		}
	}
	return live
}
