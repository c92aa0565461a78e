package schema_test

import (
	"strings"
	"testing"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/schema"
)

func TestInboxSQL(t *testing.T) {
	t.Parallel()
	tbl := schema.MustParseTable("billing.app_inbox")
	up := schema.InboxUpSQL(tbl)
	for _, want := range []string{
		`CREATE TABLE IF NOT EXISTS "billing"."app_inbox"`,
		`CONSTRAINT "app_inbox_pkey" PRIMARY KEY (consumer, key)`,
		`CREATE INDEX IF NOT EXISTS "app_inbox_by_processed" ON "billing"."app_inbox" (consumer, processed_at)`,
	} {
		if !strings.Contains(up, want) {
			t.Errorf("InboxUpSQL lacks %q:\n%s", want, up)
		}
	}
	if down := schema.InboxDownSQL(tbl); down != "DROP TABLE IF EXISTS \"billing\".\"app_inbox\";\n" {
		t.Errorf("InboxDownSQL = %q", down)
	}
	q := sqlq.NewInboxQueries(tbl)
	if !strings.Contains(q.RecordNoWait, `'inbox:billing.app_inbox:'`) || !strings.Contains(q.Record, `INSERT INTO "billing"."app_inbox"`) {
		t.Errorf("queries not rendered for the table:\n%s\n%s", q.Record, q.RecordNoWait)
	}
}
