package keyed

import (
	"container/heap"
	"sync"
	"time"
)

// Alarm wakes a relay's loop at every time asked for, so that each retry
// follows Backoff instead of waiting for the next poll or tick while the
// relay sleeps: the default relay's claim loop asks for the time each row
// it nacked is due again, the WAL relay's loop for the engine's earliest
// wake-up (Engine.Due). It keeps every time asked for and not rung yet, not
// only the earliest: a loop woken for one row does not ask again for the
// others it nacked. The zero value is not usable; use NewAlarm.
type Alarm struct {
	mu    sync.Mutex
	times timeHeap               // the times asked for and not rung yet, earliest first
	asked map[time.Time]struct{} // the times in times, so that one asked twice is kept once
	timer *time.Timer            // set for times[0] while times is not empty
	c     chan struct{}
	done  bool
}

// alarmResolution is the step times are rounded up to, so that the rows
// nacked in one millisecond share one ring.
const alarmResolution = time.Millisecond

// NewAlarm returns an alarm that has not been asked for anything.
func NewAlarm() *Alarm {
	return &Alarm{c: make(chan struct{}, 1), asked: make(map[time.Time]struct{})}
}

// At asks for a ring at t (rounded up to the millisecond). Every time asked
// for rings, in turn, unless the alarm is stopped; times that have come by
// the time one rings ring together.
func (a *Alarm) At(t time.Time) {
	t = t.Round(0) // no monotonic reading: times compare as map keys
	if r := t.Truncate(alarmResolution); r.Before(t) {
		t = r.Add(alarmResolution)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.done {
		return
	}
	if _, ok := a.asked[t]; ok {
		return
	}
	a.asked[t] = struct{}{}
	heap.Push(&a.times, t)
	if a.times[0].Equal(t) {
		a.arm()
	}
}

// arm sets the timer for the earliest time asked for; the caller holds mu
// and times is not empty.
func (a *Alarm) arm() {
	d := time.Until(a.times[0])
	if a.timer == nil {
		a.timer = time.AfterFunc(d, a.ring)
		return
	}
	a.timer.Reset(d)
}

func (a *Alarm) ring() {
	a.mu.Lock()
	if a.done || len(a.times) == 0 {
		a.mu.Unlock()
		return // a stopped alarm
	}
	now := time.Now()
	if now.Before(a.times[0]) {
		a.arm() // a ring of a timer moved later (an earlier time rang first)
		a.mu.Unlock()
		return
	}
	for len(a.times) > 0 && !now.Before(a.times[0]) {
		delete(a.asked, heap.Pop(&a.times).(time.Time))
	}
	if len(a.times) > 0 {
		a.arm() // the next time asked for rings in its turn
	}
	a.mu.Unlock()
	select {
	case a.c <- struct{}{}:
	default: // a ring not taken yet wakes the loop as well
	}
}

// C receives once per ring; a ring that finds one not taken yet is merged
// with it.
func (a *Alarm) C() <-chan struct{} { return a.c }

// Stop ends the alarm: it rings no more, and At asks for nothing. Stop is
// idempotent.
func (a *Alarm) Stop() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.done, a.times, a.asked = true, nil, nil
	if a.timer != nil {
		a.timer.Stop()
	}
}

// timeHeap is a min-heap of times (container/heap).
type timeHeap []time.Time

func (h timeHeap) Len() int           { return len(h) }
func (h timeHeap) Less(i, j int) bool { return h[i].Before(h[j]) }
func (h timeHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *timeHeap) Push(x any)        { *h = append(*h, x.(time.Time)) }
func (h *timeHeap) Pop() any {
	old := *h
	t := old[len(old)-1]
	*h = old[:len(old)-1]
	return t
}
