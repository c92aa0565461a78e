package publisher_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
)

// TestTopicRuleMatchesItsMessage: the default rule accepts what its error
// message describes (one or more segments, then vN) and the message names
// the way out.
func TestTopicRuleMatchesItsMessage(t *testing.T) {
	t.Parallel()
	for _, ok := range []string{"billing.v2", "org.organization.created.v1", "a.b.c.d.e.v10", "shop-x.order.v1"} {
		if err := publisher.ValidateTopic(ok); err != nil {
			t.Errorf("ValidateTopic(%q): %v", ok, err)
		}
	}
	for _, bad := range []string{"v1", "orders", "Org.created.v1", "org..v1", "org.created.V1"} {
		err := publisher.ValidateTopic(bad)
		if err == nil {
			t.Errorf("ValidateTopic(%q) accepted", bad)
			continue
		}
		for _, want := range []string{"one or more dot-separated segments", "version segment vN", "ValidateTopicRelaxed"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("ValidateTopic(%q) error %q lacks %q", bad, err, want)
			}
		}
	}
	if err := publisher.ValidateTopicRelaxed("Orders_Created:1"); err != nil {
		t.Errorf("relaxed: %v", err)
	}
}

// serviceTenant is the one tenant of a single-tenant service: TenantID is
// required, so such a service passes a constant of its own (README).
var serviceTenant = uuid.MustParse("7b0c1c56-8d0a-4c55-9a1e-3f9a3c2d7e10")

// TestRelaxedEnqueuerAsInTheREADME: the README's pattern for topics outside
// the convention and for single-tenant services works as shown, and the
// package-level Enqueue refuses the same topic.
func TestRelaxedEnqueuerAsInTheREADME(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	table := testdb.Table(t, "relaxed_outbox")
	msg := func() publisher.Message {
		return publisher.Message{TenantID: serviceTenant, Topic: "OrdersCreated", EventID: uuid.New(), Payload: json.RawMessage(`{"order":42}`)}
	}
	enq, err := publisher.NewEnqueuer(publisher.EnqueuerConfig{ValidateTopic: publisher.ValidateTopicRelaxed})
	if err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := enq.Enqueue(ctx, tx, table, msg())
		return err
	}); err != nil {
		t.Fatalf("relaxed Enqueuer: %v", err)
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := publisher.Enqueue(ctx, tx, table, msg())
		return err
	})
	var ve *publisher.ValidationError
	if !errors.As(err, &ve) || ve.Field != "Topic" {
		t.Fatalf("default Enqueue of a broker-style topic: %v, want a Topic ValidationError", err)
	}
}
