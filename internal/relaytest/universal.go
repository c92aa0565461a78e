package relaytest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// Universal runs Watermill's universal suite (pubsub/tests.TestPubSub)
// against r with features f, which must be honest. It adapts two
// assumptions of the suite to the outbox contract, as
// subscriber/pubsub_test.go does for the default relay, and nothing else:
//   - The suite publishes the same message UUIDs to several topics, while
//     event_id is unique per outbox table; so each topic gets its own
//     outbox table (derived from the topic name, so a second pub/sub sees
//     it, and set up for r when it is created, before any row), and the
//     relay subscribes to every topic of that table.
//   - The suite's payloads "x" and nil are not JSON; they are stored as
//     JSON strings. Tests that compare payloads publish numbers, stored
//     untouched.
//
// With -short the suite publishes few messages.
func Universal(t *testing.T, r Relay, f tests.Features) {
	t.Helper()
	pool := r.Pool(t)
	var b [6]byte
	_, _ = rand.Read(b[:])
	sch := "wm_" + hex.EncodeToString(b[:])
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `CREATE SCHEMA `+pgx.Identifier{sch}.Sanitize()); err != nil {
		t.Fatalf("create schema: %v", err)
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), `DROP SCHEMA `+pgx.Identifier{sch}.Sanitize()+` CASCADE`)
	})
	u := &universal{r: r, pool: pool, schema: sch, tables: map[string]schema.Table{}}
	// The suite leaves some subscribers open (those of its multiplier):
	// they are closed at the end, before the schema is dropped.
	t.Cleanup(u.closeAll)
	tests.TestPubSub(t, f, func(t *testing.T) (message.Publisher, message.Subscriber) {
		ps := &universalPubSub{u: u, tenant: uuid.New()}
		return universalPublisher{ps}, ps
	}, nil)
}

// universal holds the tables of one run of the suite.
type universal struct {
	r      Relay
	pool   *pgxpool.Pool
	schema string

	mu     sync.Mutex
	tables map[string]schema.Table
	subs   []message.Subscriber // every relay made, closed at the end
}

func (u *universal) closeAll() {
	u.mu.Lock()
	subs := u.subs
	u.subs = nil
	u.mu.Unlock()
	for _, s := range subs {
		_ = s.Close()
	}
}

func (u *universal) table(topic string) (schema.Table, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if t, ok := u.tables[topic]; ok {
		return t, nil
	}
	h := fnv.New64a()
	_, _ = h.Write([]byte(topic))
	t := schema.MustParseTable(fmt.Sprintf("%s.o_%x", u.schema, h.Sum64()))
	ctx := context.Background()
	opts := append([]schema.MigrateOption{schema.WithHeadersColumn()}, u.r.Migrate...)
	if err := schema.Migrate(ctx, u.pool, t, opts...); err != nil {
		return t, err
	}
	if u.r.SetUp != nil {
		if err := u.r.SetUp(ctx, u.pool, t); err != nil {
			return t, err
		}
	}
	u.tables[topic] = t
	return t, nil
}

// universalPubSub is one pub/sub of the suite.
type universalPubSub struct {
	u      *universal
	tenant uuid.UUID

	mu     sync.Mutex
	subs   []message.Subscriber
	closed bool
}

// universalPublisher is the publishing half; closing it leaves the
// subscriber.
type universalPublisher struct{ p *universalPubSub }

func (up universalPublisher) Publish(topic string, msgs ...*message.Message) error {
	return up.p.Publish(topic, msgs...)
}

func (up universalPublisher) Close() error { return nil }

func (p *universalPubSub) Publish(topic string, msgs ...*message.Message) error {
	t, err := p.u.table(topic)
	if err != nil {
		return err
	}
	for _, m := range msgs {
		if !json.Valid(m.Payload) {
			b, _ := json.Marshal(string(m.Payload))
			m.Payload = b
		}
	}
	pub, err := publisher.NewDBPublisher(p.u.pool, publisher.DBPublisherConfig{Table: t, DefaultTenantID: p.tenant, EnqueuerConfig: publisher.EnqueuerConfig{ValidateTopic: publisher.ValidateTopicRelaxed}})
	if err != nil {
		return err
	}
	return pub.Publish(topic, msgs...)
}

func (p *universalPubSub) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	t, err := p.u.table(topic)
	if err != nil {
		return nil, err
	}
	sub, err := p.u.r.New(ctx, p.u.pool, t, Options{DisableSingleActive: true}.withDefaults())
	if err != nil {
		return nil, err
	}
	p.u.mu.Lock()
	p.u.subs = append(p.u.subs, sub)
	p.u.mu.Unlock()
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		_ = sub.Close()
		return nil, subscriber.ErrSubscriberClosed
	}
	p.subs = append(p.subs, sub)
	p.mu.Unlock()
	return sub.Subscribe(ctx, subscriber.AllTopics)
}

func (p *universalPubSub) Close() error {
	p.mu.Lock()
	p.closed = true
	subs := p.subs
	p.subs = nil
	p.mu.Unlock()
	var errs []error
	for _, s := range subs {
		errs = append(errs, s.Close())
	}
	return errors.Join(errs...)
}
