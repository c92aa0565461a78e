package subscriber_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// suitePubSub adapts two assumptions of Watermill's universal suite to the
// outbox contract, and nothing else:
//   - The suite publishes the same message UUIDs to several topics, while
//     event_id is unique per outbox table; so each topic gets its own outbox
//     table (derived from the topic name, so a second pub/sub sees it), and
//     Publish/Subscribe use the row's topic column inside it as usual.
//   - The suite's payloads "x" and nil are not JSON; they are stored as JSON
//     strings. Tests that compare payloads publish numbers, stored untouched.
type suitePubSub struct {
	pool   *pgxpool.Pool
	schema string
	tenant uuid.UUID

	mu     sync.Mutex
	subs   []*subscriber.Subscriber
	closed bool
}

var migrateMu sync.Mutex

func (p *suitePubSub) table(topic string) (schema.Table, error) {
	h := fnv.New64a()
	_, _ = h.Write([]byte(topic))
	t := schema.MustParseTable(fmt.Sprintf("%s.o_%x", p.schema, h.Sum64()))
	migrateMu.Lock()
	defer migrateMu.Unlock()
	return t, schema.Migrate(context.Background(), p.pool, t, schema.WithHeadersColumn())
}

// suitePublisher is the publishing half; closing it leaves the subscriber.
type suitePublisher struct{ p *suitePubSub }

func (sp suitePublisher) Publish(topic string, msgs ...*message.Message) error {
	return sp.p.Publish(topic, msgs...)
}

func (sp suitePublisher) Close() error { return nil }

func (p *suitePubSub) Publish(topic string, msgs ...*message.Message) error {
	t, err := p.table(topic)
	if err != nil {
		return err
	}
	for _, m := range msgs {
		if !json.Valid(m.Payload) {
			b, _ := json.Marshal(string(m.Payload))
			m.Payload = b
		}
	}
	pub, err := publisher.NewDBPublisher(p.pool, publisher.DBPublisherConfig{Table: t, DefaultTenantID: p.tenant, EnqueuerConfig: publisher.EnqueuerConfig{ValidateTopic: publisher.ValidateTopicRelaxed}})
	if err != nil {
		return err
	}
	return pub.Publish(topic, msgs...)
}

func (p *suitePubSub) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	t, err := p.table(topic)
	if err != nil {
		return nil, err
	}
	sub, err := subscriber.New(context.Background(), p.pool, subscriber.Config{
		Table:               t,
		PollInterval:        100 * time.Millisecond,
		LockTTL:             5 * time.Second,
		CloseTimeout:        time.Second,
		DisableSingleActive: true,
		Backoff:             func(int) time.Duration { return 100 * time.Millisecond },
	}, watermill.NopLogger{})

	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil, subscriber.ErrSubscriberClosed
	}
	p.subs = append(p.subs, sub)
	p.mu.Unlock()
	return sub.Subscribe(ctx, topic)
}

func (p *suitePubSub) Close() error {
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

// suiteFeatures are the honest features of the outbox pub/sub.
var suiteFeatures = tests.Features{
	ConsumerGroups:      false, // every subscription of a table shares its rows
	ExactlyOnceDelivery: false,
	GuaranteedOrder:     false,
	Persistent:          true,
}

func suiteConstructor(t *testing.T) tests.PubSubConstructor {
	sch := testdb.Schema(t)
	pool := testdb.Pool(t)
	return func(t *testing.T) (message.Publisher, message.Subscriber) {
		ps := &suitePubSub{pool: pool, schema: sch, tenant: uuid.New()}
		return suitePublisher{ps}, ps
	}
}

func TestPubSub(t *testing.T) {
	t.Parallel()
	tests.TestPubSub(t, suiteFeatures, suiteConstructor(t), nil)
}
