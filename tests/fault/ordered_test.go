//go:build fault

package fault

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/uuid"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
)

// TestFaultOrderedKills runs three ordered `outbox relay` processes on one
// table while producers commit keyed events, SIGKILLs relays at random and
// starts replacements; at the broker (RabbitMQ, one queue) every key's first
// occurrences are in sequence order and nothing committed is missing. It
// restarts no service, so it can run beside other tests:
//
//	go test -tags fault ./tests/fault -run TestFaultOrderedKills
func TestFaultOrderedKills(t *testing.T) {
	events := envInt("FAULT_EVENTS", 3000)
	kills := envInt("FAULT_KILLS", 4)
	ctx := context.Background()

	bin := filepath.Join(t.TempDir(), "outbox")
	run(t, "go", "build", "-o", bin, "../../cmd/outbox")
	pool := testdb.NewPool(t, nil)
	tbl := schema.MustParseTable(testdb.Schema(t) + ".fault_ordered")
	if err := schema.Migrate(ctx, pool, tbl, schema.WithOrderingKeyColumn()); err != nil {
		t.Fatal(err)
	}
	topic := "fault" + strings.ReplaceAll(uuid.NewString()[:8], "-", "") + ".ordered.happened.v1"
	h := &harness{t: t, bin: bin, logDir: t.TempDir(), env: append(os.Environ(),
		"OUTBOX_DATABASE_URL="+testdb.URL(),
		"OUTBOX_RELAY_TABLES="+tbl.String(),
		"OUTBOX_RELAY_ORDERED=true",
		"OUTBOX_BACKEND=amqp",
		"OUTBOX_AMQP_URL="+amqpURL,
		"OUTBOX_RELAY_LOCK_TTL=2s",
		"OUTBOX_RELAY_POLL_INTERVAL=200ms",
		"OUTBOX_RELAY_DISPATCH_TIMEOUT=5s",
		"OUTBOX_CLEANER_ENABLED=false",
	)}
	keyedKills(t, h, pool, tbl, topic, events, kills, 3)
}
