//go:build fault

package fault

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/pgtest"
	"github.com/outboxkit/watermill-outbox/schema"
)

// TestFaultWALKills runs two `outbox relay` processes with
// OUTBOX_RELAY_SOURCE=wal on one table of a private wal_level=logical
// PostgreSQL (set up with `outbox migrate --wal`) while a producer commits
// keyed events, SIGKILLs relays at random and starts replacements; at the
// broker (RabbitMQ) nothing committed is missing and every key's first
// occurrences are in commit order; duplicates are counted.
//
//	go test -tags fault ./tests/fault -run TestFaultWALKills
func TestFaultWALKills(t *testing.T) {
	events := envInt("FAULT_EVENTS", 3000)
	kills := envInt("FAULT_KILLS", 4)
	ctx := context.Background()

	bin := filepath.Join(t.TempDir(), "outbox")
	run(t, "go", "build", "-o", bin, "../../cmd/outbox")
	pg := pgtest.Start(t, pgtest.Options{Settings: map[string]string{"wal_level": "logical", "max_replication_slots": "10", "max_wal_senders": "10"}})
	pool, err := pgxpool.New(ctx, pg.URL("", ""))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	tbl := schema.MustParseTable("public.fault_wal")
	migrate := exec.Command(bin, "migrate", "--table", tbl.String(), "--ordered", "--wal")
	migrate.Env = append(os.Environ(), "OUTBOX_DATABASE_URL="+pg.URL("", ""))
	out, err := migrate.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "set up the WAL relay of "+tbl.String()) {
		t.Fatalf("outbox migrate --wal: %v\n%s", err, out)
	}
	topic := "fault" + strings.ReplaceAll(uuid.NewString()[:8], "-", "") + ".wal.happened.v1"
	h := &harness{t: t, bin: bin, logDir: t.TempDir(), env: append(os.Environ(),
		"OUTBOX_DATABASE_URL="+pg.URL("", ""),
		"OUTBOX_RELAY_TABLES="+tbl.String(),
		"OUTBOX_RELAY_SOURCE=wal",
		"OUTBOX_BACKEND=amqp",
		"OUTBOX_AMQP_URL="+amqpURL,
		"OUTBOX_RELAY_DISPATCH_TIMEOUT=5s",
		"OUTBOX_CLEANER_ENABLED=false",
	)}
	keyedKills(t, h, pool, tbl, topic, events, kills, 2)
}
