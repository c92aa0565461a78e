package subscriber

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// Abandon makes the ordered relays of s stop, at Close, like a killed
// process: without giving their partitions back or leaving the membership.
func Abandon(s *Subscriber) { s.hooks.abandon.Store(true) }

// SetBeforeIdle makes f run each time a subscription of s found nothing and
// is about to try the idle lock. Set it before Subscribe.
func SetBeforeIdle(s *Subscriber, f func()) { s.hooks.beforeIdle = f }

// AfterClaimQuery makes s run fn after each claim statement was sent and
// before its rows are read.
func AfterClaimQuery(s *Subscriber, fn func()) { s.hooks.afterClaimQuery = fn }

// LeaderSetting reads a setting of s's leader session; ok is false when s is
// not the leader.
func LeaderSetting(ctx context.Context, s *Subscriber, name string) (value string, ok bool, err error) {
	if s.leader == nil {
		return "", false, nil
	}
	err = s.leader.withConn(ctx, func(ctx context.Context, conn *pgx.Conn) error {
		return conn.QueryRow(ctx, `SELECT current_setting($1)`, name).Scan(&value)
	})
	if errors.Is(err, errNotLeader) {
		return "", false, nil
	}
	return value, err == nil, err
}

// LeaderKeepalive exposes the keepalive settings derived from a leader
// timeout.
var LeaderKeepalive = leaderKeepalive

// SetWriteTimeout sets the timeout of each ack, nack, renewal and release
// statement of s (each attempt of a grouped ack has its own).
func SetWriteTimeout(s *Subscriber, d time.Duration) { s.writeTimeout = d }

// DumpOrderedMemory describes what the ordered relays of s hold in memory
// for the partitions in parts (all when empty): leases, floors, watches,
// and every key with a queue, a runner or a hold.
func DumpOrderedMemory(s *Subscriber, parts ...int) string {
	s.closeMu.Lock()
	relays := append([]*orderedRelay(nil), s.ordered...)
	s.closeMu.Unlock()
	want := map[int]bool{}
	for _, p := range parts {
		want[p] = true
	}
	var b strings.Builder
	for _, r := range relays {
		r.mu.Lock()
		fmt.Fprintf(&b, "relay %s: in flight %d due %s needHolds %v holdsRead %s ago gen %d\n",
			r.id, r.sub.slots.InUse(), r.keyed.Due().Format(time.StampMilli), r.needHolds, time.Since(r.holdsRead).Round(time.Millisecond), r.gen)
		for id, p := range r.parts {
			if len(want) > 0 && !want[id] {
				continue
			}
			fmt.Fprintf(&b, "  part %d: floor %d persisted %d seen %d open %d watches %d full %v releasing %v fresh %v deadline in %s\n",
				id, p.floor, p.persisted, p.seen, len(p.open), len(p.watches), p.full, p.releasing, p.fresh, time.Until(p.deadline).Round(time.Millisecond))
			for _, w := range p.watches {
				fmt.Fprintf(&b, "    watch %s hash %d (%d, %d] ended %v\n", w.vxid, w.hash, w.from, w.to, w.ended)
			}
		}
		for name, k := range r.keys {
			if len(want) > 0 && !want[k.p.id] {
				continue
			}
			fmt.Fprintf(&b, "  key %s part %d (current %v): queue %d out %v lastDone %d holdGen %d action %d",
				name, k.p.id, r.parts[k.p.id] == k.p, len(k.queue), k.Out(), k.lastDone, k.holdGen, r.nextActionLocked(k))
			if h := k.hold; h != nil {
				fmt.Fprintf(&b, " hold %+v due in %s", *h, time.Until(h.DueAt).Round(time.Millisecond))
			}
			b.WriteString("\n")
		}
		r.mu.Unlock()
	}
	return b.String()
}

// CheckOrderedMemory checks the invariants of docs/ORDERING.md that the
// ordered relays of s keep in memory, and describes the first broken one:
//   - every open row of an owned partition (not being given back) is queued on its key or is the
//     key's row in flight, exactly once, and above the floor;
//   - queues are in sequence order and hold only open rows; no queued row
//     is covered by its key's hold;
//   - persisted <= floor <= seen.
func CheckOrderedMemory(s *Subscriber) error {
	s.closeMu.Lock()
	relays := append([]*orderedRelay(nil), s.ordered...)
	s.closeMu.Unlock()
	for _, r := range relays {
		if err := r.check(); err != nil {
			return fmt.Errorf("relay %s: %w", r.id, err)
		}
	}
	return nil
}

func (r *orderedRelay) check() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	owners := map[*partState]map[int64]string{}
	for id, p := range r.parts {
		if p.floor < p.persisted || p.floor > p.seen {
			return fmt.Errorf("partition %d: floor %d outside [persisted %d, seen %d]", id, p.floor, p.persisted, p.seen)
		}
		owners[p] = map[int64]string{}
	}
	for name, k := range r.keys {
		seen, ok := owners[k.p]
		if !ok || r.parts[k.p.id] != k.p {
			continue // a key of a dropped partition, its runner ending
		}
		claim := func(seq int64, what string) error {
			if prev, dup := seen[seq]; dup {
				return fmt.Errorf("partition %d: row %d is both %s and %s", k.p.id, seq, prev, what)
			}
			seen[seq] = what
			return nil
		}
		var last int64
		for _, e := range k.queue {
			seq := e.row.Sequence
			if seq <= last {
				return fmt.Errorf("key %s: queue out of order at %d", name, seq)
			}
			last = seq
			if _, open := k.p.open[seq]; !open {
				return fmt.Errorf("key %s: queued row %d is not open", name, seq)
			}
			// Rows above an active hold load while it moves on (advancing)
			// and stay until it has; rows at or below a hold are done.
			if h := k.hold; h != nil && !h.replay && seq <= h.Seq {
				return fmt.Errorf("key %s: queued row %d is covered by its hold %+v", name, seq, *h)
			}
			if err := claim(seq, "queued on "+name); err != nil {
				return err
			}
		}
		if k.flying != 0 {
			if _, open := k.p.open[k.flying]; open {
				if err := claim(k.flying, "in flight on "+name); err != nil {
					return err
				}
			}
		}
	}
	for p, seen := range owners {
		if p.releasing {
			continue // its queues were dropped; its open rows keep the floor below them until it is given back
		}
		for seq := range p.open {
			if _, ok := seen[seq]; !ok {
				return fmt.Errorf("partition %d: open row %d is neither queued nor in flight (the floor %d cannot pass it)", p.id, seq, p.floor)
			}
			if seq <= p.floor {
				return fmt.Errorf("partition %d: open row %d at or below the floor %d", p.id, seq, p.floor)
			}
		}
	}
	return nil
}

// OrderedOpenRows is how many rows the ordered relays of s hold open (loaded,
// neither acked nor covered by a hold), over every partition.
func OrderedOpenRows(s *Subscriber) int {
	s.closeMu.Lock()
	relays := append([]*orderedRelay(nil), s.ordered...)
	s.closeMu.Unlock()
	n := 0
	for _, r := range relays {
		r.mu.Lock()
		for _, p := range r.parts {
			n += len(p.open)
		}
		r.mu.Unlock()
	}
	return n
}

// Bounded reports whether s claims AllTopics with the bounded claim now:
// not disabled, and the table's available_at has the default it needs.
func Bounded(s *Subscriber) bool {
	b := s.bounded
	if b == nil {
		return false
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.on
}

// BoundOf returns the bounded claim's bound (its available_at part) and
// whether one is set.
func BoundOf(s *Subscriber) (time.Time, bool) {
	b := s.bounded
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.at, b.set
}

// How far the bound may trail the head (boundedclaim.go).
const (
	BoundedCutEvery = boundedCutEvery
	BoundedMargin   = boundedMargin
)
