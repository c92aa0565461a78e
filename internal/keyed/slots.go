package keyed

import "sync/atomic"

// Slots counts the messages one subscription has out against its
// MaxInFlight: reserved for a read under way, read and not yet handed over,
// and handed over and not yet acked or nacked. It is safe for concurrent
// use; the relay's loops and runners share one Slots.
type Slots struct {
	limit int64
	used  atomic.Int64
	// extra counts what is out besides the reserved slots: the messages
	// still in handlers that no live copy accounts for, left by ended terms
	// or given up on by an overrun (term.Ledger.Lingering). Nil: none.
	extra func() int
	freed chan struct{}
}

// NewSlots returns Slots for limit messages (at least 1). extra, if not
// nil, reports further messages that are out and count against the limit
// without being reserved (messages left in handlers by ended terms or by
// an overrun, until their handlers return).
func NewSlots(limit int, extra func() int) *Slots {
	return &Slots{limit: int64(max(1, limit)), extra: extra, freed: make(chan struct{}, 1)}
}

// Reserve takes up to want slots and returns how many it took (0: none is
// free). Give back what is not used with Unreserve.
func (s *Slots) Reserve(want int) int {
	limit := s.limit
	if s.extra != nil {
		limit -= int64(s.extra())
	}
	for {
		cur := s.used.Load()
		k := min(int64(want), limit-cur)
		if k <= 0 {
			return 0
		}
		if s.used.CompareAndSwap(cur, cur+k) {
			return int(k)
		}
	}
}

// Unreserve gives n slots back and signals Freed.
func (s *Slots) Unreserve(n int) {
	if n <= 0 {
		return
	}
	s.used.Add(-int64(n))
	s.Signal()
}

// Signal signals Freed without giving a slot back: room appeared elsewhere
// (an ended term's copy came back).
func (s *Slots) Signal() {
	select {
	case s.freed <- struct{}{}:
	default:
	}
}

// Freed receives after slots were given back (one signal for any number of
// Unreserve calls since the last receive).
func (s *Slots) Freed() <-chan struct{} { return s.freed }

// Full reports whether no slot is free now.
func (s *Slots) Full() bool { return s.InUse() >= int(s.limit) }

// InUse is the number of slots taken, with the extra messages out.
func (s *Slots) InUse() int {
	n := int(s.used.Load())
	if s.extra != nil {
		n += s.extra()
	}
	return n
}
