package relaytest

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/google/uuid"

	"github.com/outboxkit/watermill-outbox/forwarder"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// poisonMaxAttempts is the MaxAttempts of the poison cases' relays.
const poisonMaxAttempts = 3

// TestPoisonCopyOfEveryDeadEvent checks forwarder.PoisonQueue's promise
// (README, step 3; docs/ARCHITECTURE.md, "Dead rows and the poison queue")
// whichever relay delivers: a router with it router-wide copies each dead
// outbox event to the poison topic exactly once, with its cause as the
// reason, the events that die outside the handler included; the row is
// dead, never marked published, and delivered again by a replay once its
// cause is fixed, with no second copy. One subtest per way to die:
//
//   - RefusedByAMiddleware: a middleware inside the poison queue refuses
//     the event (Permanent), a failure inside the router;
//   - HeadersNotAnObject: the row's headers column holds a JSON array, so
//     it cannot become a message; the relay hands it to the router without
//     them, refused;
//   - LeaseExpiredOnTheLastAttempt: the row was leased on its last allowed
//     attempt by a relay that died; the next claim (or the next leader)
//     parks it dead with its death notice, and the relay hands the notice
//     to the router (not for the WAL relay, which leases nothing and
//     whose restart resets a row's attempts: no row dies of it,
//     docs/WAL.md).
func TestPoisonCopyOfEveryDeadEvent(t *testing.T, r Relay) {
	t.Run("RefusedByAMiddleware", func(t *testing.T) {
		t.Parallel()
		e := setup(t, r, true, schema.WithAllColumns())
		ev := e.enqueue(topicA, "refused")[0]
		p := startPoisonRig(e, ev.ID)
		p.settle(ev, "fraud check: order refused")
		p.refused.Delete(ev.ID.String())
		p.replayed(ev)
	})
	t.Run("HeadersNotAnObject", func(t *testing.T) {
		t.Parallel()
		e := setup(t, r, true, schema.WithAllColumns())
		id := uuid.New()
		if _, err := e.pool.Exec(context.Background(), `INSERT INTO `+e.tbl.Sanitize()+` (tenant_id, topic, payload, event_id, headers, ordering_key)
VALUES ($1::uuid, $2, '{"n":1}', $3::uuid, '["not", "an", "object"]', 'headers')`, e.tenant.String(), topicA, id.String()); err != nil {
			t.Fatal(err)
		}
		ev := event{ID: id, Key: "headers", Topic: topicA}
		p := startPoisonRig(e)
		p.settle(ev, "headers column is not a JSON object")
		if _, err := e.pool.Exec(context.Background(), `UPDATE `+e.tbl.Sanitize()+` SET headers = '{"fixed": "yes"}' WHERE event_id = $1`, id); err != nil {
			t.Fatal(err)
		}
		p.replayed(ev)
	})
	if r.Mode == ModeWAL {
		// No such death: the WAL relay leases nothing and keeps a row's
		// attempts in memory, so no row dies of its relay's death
		// (docs/WAL.md).
		return
	}
	t.Run("LeaseExpiredOnTheLastAttempt", func(t *testing.T) {
		t.Parallel()
		e := setup(t, r, true, schema.WithAllColumns())
		id := uuid.New()
		// Leased an hour ago on its last allowed attempt by a relay that
		// was killed: no ordering key, so that ordered mode claims it too.
		if _, err := e.pool.Exec(context.Background(), `INSERT INTO `+e.tbl.Sanitize()+` (tenant_id, topic, payload, event_id, attempts, locked_at, available_at)
VALUES ($1::uuid, $2, '{"n":1}', $3::uuid, $4::int, now() - interval '1 hour', now() - interval '1 hour')`,
			e.tenant.String(), topicA, id.String(), poisonMaxAttempts); err != nil {
			t.Fatal(err)
		}
		ev := event{ID: id, Topic: topicA}
		p := startPoisonRig(e)
		p.settle(ev, "it was the last allowed attempt")
		p.replayed(ev)
	})
}

// poisonRig is a user's router over the relay under test: the forwarder
// added with AddTo, forwarder.PoisonQueue and a middleware that refuses
// some events router-wide, an in-process destination and a poison topic
// whose copies are counted by event_id.
type poisonRig struct {
	e       *env
	refused sync.Map // event_id -> true: refused by the middleware
	mu      sync.Mutex
	copies  map[string][]string // event_id -> the reasons of its copies
}

func startPoisonRig(e *env, refuse ...uuid.UUID) *poisonRig {
	t := e.t
	t.Helper()
	p := &poisonRig{e: e, copies: map[string][]string{}}
	for _, id := range refuse {
		p.refused.Store(id.String(), true)
	}
	// Publish returns once the copy is counted, so every copy made before
	// a row's fate was written is counted when the fate can be read.
	poison := gochannel.NewGoChannel(gochannel.Config{Persistent: true, BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = poison.Close() })
	copies, err := poison.Subscribe(context.Background(), "poison")
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for m := range copies {
			p.mu.Lock()
			id := m.Metadata.Get(schema.MetadataEventID)
			p.copies[id] = append(p.copies[id], m.Metadata.Get(middleware.ReasonForPoisonedKey))
			p.mu.Unlock()
			m.Ack()
		}
	}()
	dest := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{}) // no subscriber: a publish succeeds
	t.Cleanup(func() { _ = dest.Close() })
	sub, err := e.newRelay(Options{MaxAttempts: poisonMaxAttempts})
	if err != nil {
		t.Fatalf("the %s relay: %v", e.r.Name, err)
	}
	pq, err := forwarder.PoisonQueue(poison, "poison")
	if err != nil {
		t.Fatal(err)
	}
	refuse1 := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			if _, ok := p.refused.Load(msg.UUID); ok {
				return nil, subscriber.Permanent(errors.New("fraud check: order refused"))
			}
			return h(msg)
		}
	}
	rt, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	rt.AddMiddleware(subscriber.CaptureError, pq, refuse1)
	f, err := forwarder.New(sub, dest, forwarder.Config{Middleware: []message.HandlerMiddleware{}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	f.AddTo(rt)
	done := make(chan error, 1)
	go func() { done <- rt.Run(context.Background()) }()
	t.Cleanup(func() {
		if err := rt.Close(); err != nil {
			t.Errorf("close the router: %v", err)
		}
		if err := <-done; err != nil {
			t.Errorf("the router's Run: %v", err)
		}
		_ = sub.Close()
	})
	<-rt.Running()
	return p
}

// reasons returns the reasons of the copies of ev so far.
func (p *poisonRig) reasons(ev event) []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.copies[ev.ID.String()]...)
}

// settle waits until ev's row is dead and its death notice, if any, was
// answered (a copy is published before the verdict that deletes the
// notice or sends the row dead), then checks that ev was copied exactly
// once, with a reason naming cause, and that its row is dead, not
// published, with a last_error naming cause.
func (p *poisonRig) settle(ev event, cause string) {
	e := p.e
	e.t.Helper()
	e.eventually(within, func() bool { return e.row(ev.ID).Dead() && p.notices() == 0 }, func() string {
		return "the row is not dead, or its death notice was not answered: " + e.rowStates([]event{ev})
	})
	if reasons := p.reasons(ev); len(reasons) != 1 || !strings.Contains(reasons[0], cause) {
		e.t.Fatalf("the %s relay: event %s copied to the poison topic with reasons %q, want one copy naming %q", e.r.Name, ev, reasons, cause)
	}
	s := e.row(ev.ID)
	if s.Published || s.Delivered {
		e.t.Fatalf("the %s relay: dead event %s marked delivered: %s", e.r.Name, ev, s)
	}
	if !strings.Contains(s.LastError+" "+s.RunbookError, cause) {
		e.t.Errorf("the %s relay: dead event %s: %s, want a last_error naming %q", e.r.Name, ev, s, cause)
	}
}

// notices is how many death notices the table still holds.
func (p *poisonRig) notices() int {
	var n int
	if err := p.e.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+sqlq.DeadNoticesTable(p.e.tbl)).Scan(&n); err != nil {
		p.e.t.Fatalf("count the death notices: %v", err)
	}
	return n
}

// replayed replays ev's dead row, its cause fixed, and waits until the
// relay delivered and acked it: still one copy.
func (p *poisonRig) replayed(ev event) {
	e := p.e
	e.t.Helper()
	err := retry(within, func() error {
		_, err := runbook.New(e.pool, e.tbl).ReplayEvent(context.Background(), ev.ID, runbook.ReplayOptions{})
		return err
	}, func(err error) bool {
		return errors.Is(err, runbook.ErrLocked) || errors.Is(err, runbook.ErrNotRelayedYet)
	})
	if err != nil {
		e.t.Fatalf("replay the dead row %s: %v", ev, err)
	}
	e.eventually(within, func() bool { return e.row(ev.ID).Delivered }, func() string {
		return "the replayed row was not delivered: " + e.rowStates([]event{ev})
	})
	if reasons := p.reasons(ev); len(reasons) != 1 {
		e.t.Errorf("the %s relay: event %s copied %d times after its replay was delivered, want 1: %q", e.r.Name, ev, len(reasons), reasons)
	}
}
