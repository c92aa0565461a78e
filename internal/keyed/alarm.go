package keyed

import (
	"sync"
	"time"
)

// Alarm wakes a relay's loop at the earliest time asked for and not rung
// yet, so that a retry follows Backoff instead of waiting for the next poll
// or tick while the relay sleeps: the default relay's claim loop asks for
// the time a row it nacked is due again, the WAL relay's loop for the
// engine's earliest wake-up (Engine.Due). The zero value is not usable; use
// NewAlarm.
type Alarm struct {
	mu    sync.Mutex
	at    time.Time // the earliest time asked for; zero when none
	timer *time.Timer
	c     chan struct{}
	done  bool
}

// NewAlarm returns an alarm that has not been asked for anything.
func NewAlarm() *Alarm { return &Alarm{c: make(chan struct{}, 1)} }

// At asks for a ring at t. A later time than one still pending changes
// nothing: the earlier ring wakes the loop, which asks again if it must.
func (a *Alarm) At(t time.Time) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.done || (!a.at.IsZero() && !t.Before(a.at)) {
		return
	}
	a.at = t
	if a.timer == nil {
		a.timer = time.AfterFunc(time.Until(t), a.ring)
		return
	}
	a.timer.Reset(time.Until(t))
}

func (a *Alarm) ring() {
	a.mu.Lock()
	if a.at.IsZero() || time.Now().Before(a.at) {
		a.mu.Unlock()
		return // a stopped alarm, or a ring moved later by nothing (At only moves it earlier)
	}
	a.at = time.Time{}
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
	a.done, a.at = true, time.Time{}
	if a.timer != nil {
		a.timer.Stop()
	}
}
