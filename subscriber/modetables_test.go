package subscriber_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// TestOrderedStartWithoutCreateRights (issue 57, item 5): a default-mode
// table has none of ordered mode's tables, which the switch to ordered mode
// creates. An ordered relay whose role may read and write the table but not
// create tables in its schema starts on it (New accepts it: its start
// switches) and is refused at its start's switch with ErrOrderedNotMigrated
// and an error naming `outbox migrate --mode=ordered --table=T`; nothing
// changed (the mode stays default, no table was created). Once the table's
// owner ran that migration, the same role's ordered relay starts and relays.
func TestOrderedStartWithoutCreateRights(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	admin := testdb.Pool(t)
	tbl := testdb.Table(t, "rights_outbox", schema.WithAllColumns())
	role := "relay_" + uuid.NewString()[:8]
	sch := pgx.Identifier{tbl.Schema()}.Sanitize()
	grant := func() {
		t.Helper()
		for _, stmt := range []string{
			`GRANT USAGE ON SCHEMA ` + sch + ` TO ` + role,
			`GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA ` + sch + ` TO ` + role,
			`GRANT USAGE ON ALL SEQUENCES IN SCHEMA ` + sch + ` TO ` + role,
		} {
			if _, err := admin.Exec(ctx, stmt); err != nil {
				t.Fatal(err)
			}
		}
	}
	if _, err := admin.Exec(ctx, `CREATE ROLE `+role+` LOGIN`); err != nil {
		t.Fatal(err)
	}
	grant()
	relayPool := testdb.NewPool(t, func(c *pgxpool.Config) { c.ConnConfig.User = role })
	t.Cleanup(func() {
		relayPool.Close()
		_, _ = admin.Exec(context.Background(), `DROP OWNED BY `+role)
		_, _ = admin.Exec(context.Background(), `DROP ROLE IF EXISTS `+role)
	})
	keyedTables := func() bool {
		t.Helper()
		var any bool
		if err := admin.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL OR to_regclass($2) IS NOT NULL OR to_regclass($3) IS NOT NULL`,
			tbl.HoldsTable(), tbl.PartitionsTable(), tbl.RelaysTable()).Scan(&any); err != nil {
			t.Fatal(err)
		}
		return any
	}
	if keyedTables() {
		t.Fatal("a new default-mode table has ordered mode's tables")
	}

	s, err := subscriber.New(ctx, relayPool, orderedCfg(tbl), watermill.NopLogger{})
	if err != nil {
		t.Fatalf("New of an ordered relay on a table its start switches: %v", err)
	}
	_, err = s.Subscribe(ctx, subscriber.AllTopics)
	if !errors.Is(err, subscriber.ErrOrderedNotMigrated) || !strings.Contains(err.Error(), "outbox migrate --mode=ordered --table="+tbl.String()) {
		t.Fatalf("Subscribe of an ordered relay that may not create ordered mode's tables: %v; want ErrOrderedNotMigrated naming the migration", err)
	}
	t.Logf("refused: %v", err)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if rec, ok, err := schema.RecordedMode(ctx, admin, tbl); err != nil || !ok || rec.Mode != schema.ModeDefault {
		t.Fatalf("after the refused start: mode %+v, recorded %v (%v); want default", rec, ok, err)
	}
	if keyedTables() {
		t.Fatal("the refused start created some of ordered mode's tables")
	}

	// The owner switches the table; the relay's role is granted the new tables.
	if err := schema.Migrate(ctx, admin, tbl, schema.WithMode(schema.ModeOrdered)); err != nil {
		t.Fatal(err)
	}
	grant()
	s, err = subscriber.New(ctx, relayPool, orderedCfg(tbl), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	d := consumeAll(t, s)
	var ids []string
	for _, k := range enqueueKeyed(t, admin, tbl, "k", "k") {
		ids = append(ids, k.event.String())
	}
	d.wait(t, ids, time.Minute)
}
