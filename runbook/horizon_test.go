package runbook_test

import (
	"context"
	"strings"
	"testing"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
)

// TestRunbookFindsThePinningSession: the query docs/OPERATIONS.md gives for
// "A long-open transaction (a pinned xmin horizon)" names a session that
// holds a transaction id, idle in its transaction.
func TestRunbookFindsThePinningSession(t *testing.T) {
	t.Parallel()
	ops := string(readDeployFile(t, "../docs/OPERATIONS.md"))
	const marker = "<!-- runbook/horizon_test.go runs this query against a pinned session -->"
	_, rest, ok := strings.Cut(ops, marker)
	if !ok {
		t.Fatal("docs/OPERATIONS.md: the pinned-horizon query's marker is gone")
	}
	_, rest, ok = strings.Cut(rest, "```sql\n")
	if !ok {
		t.Fatal("docs/OPERATIONS.md: no sql block after the pinned-horizon marker")
	}
	query, _, ok := strings.Cut(rest, "```")
	if !ok {
		t.Fatal("docs/OPERATIONS.md: the pinned-horizon sql block is not closed")
	}
	query = strings.TrimSuffix(strings.TrimSpace(query), ";")

	ctx := context.Background()
	pool := testdb.Pool(t)
	pin, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pin.Rollback(context.Background()) })
	var (
		pid int32
		xid int64
	)
	if err := pin.QueryRow(ctx, `SELECT pg_backend_pid(), txid_current()`).Scan(&pid, &xid); err != nil {
		t.Fatal(err)
	}
	var (
		state string
		found bool
	)
	if err := pool.QueryRow(ctx, `SELECT state, xid_age IS NOT NULL FROM (`+query+`) AS q WHERE pid = $1`, pid).Scan(&state, &found); err != nil {
		t.Fatalf("the runbook's query does not list the session holding a transaction id (pid %d): %v\n%s", pid, err, query)
	}
	if !found || state != "idle in transaction" {
		t.Fatalf("the pinning session is listed as %q with xid_age set %v, want idle in transaction with its xid's age", state, found)
	}
}
