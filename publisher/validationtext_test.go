package publisher_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
)

// TestValidationErrorNamesAPositionOnlyInABatch: Enqueue's validation error
// names no message number ("invalid outbox message: Topic: ..."), an
// EnqueueBatch error names the message at fault (#1 here).
func TestValidationErrorNamesAPositionOnlyInABatch(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "pub_verr_outbox")
	ctx := context.Background()
	bad := newMsg("Not.A.Topic")
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := publisher.Enqueue(ctx, tx, tbl, bad)
		var ve *publisher.ValidationError
		if !errors.As(err, &ve) || ve.Index != 0 || ve.Field != "Topic" {
			t.Fatalf("Enqueue: %v, want a ValidationError on Topic with Index 0", err)
		}
		if !strings.HasPrefix(err.Error(), "invalid outbox message: Topic: ") || strings.Contains(err.Error(), "#") {
			t.Errorf("Enqueue error %q: want \"invalid outbox message: Topic: ...\", no message number", err)
		}
		_, err = publisher.EnqueueBatch(ctx, tx, tbl, []publisher.Message{newMsg("org.a.b.v1"), bad})
		if !errors.As(err, &ve) || ve.Index != 1 || !strings.HasPrefix(err.Error(), "invalid outbox message #1: Topic: ") {
			t.Errorf("EnqueueBatch error %v: want \"invalid outbox message #1: Topic: ...\"", err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
