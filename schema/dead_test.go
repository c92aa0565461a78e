package schema_test

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
)

// insertRows inserts one row per SET clause and returns their event_ids.
func insertRows(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, sets ...string) []string {
	t.Helper()
	ctx := context.Background()
	ids := make([]string, len(sets))
	for i, set := range sets {
		err := pool.QueryRow(ctx, `INSERT INTO `+tbl.Sanitize()+` (tenant_id, topic, payload, event_id)
VALUES (gen_random_uuid(), 'org.dead.v1', '{}', gen_random_uuid()) RETURNING event_id::text`).Scan(&ids[i])
		if err != nil {
			t.Fatal(err)
		}
		if set != "" {
			if _, err := pool.Exec(ctx, `UPDATE `+tbl.Sanitize()+` SET `+set+` WHERE event_id = $1`, ids[i]); err != nil {
				t.Fatal(err)
			}
		}
	}
	return ids
}

// TestClaimSkipsDeadAndParksExpiredLastAttempt: the relay's claim and the
// watermill-sql adapters' claim never return a dead row (dead_at set, even
// due now and with few attempts), and park dead a row whose lease expired on
// its last allowed attempt; the relay's claim reports it as parked, the
// adapters' claim leaves it out.
func TestClaimSkipsDeadAndParksExpiredLastAttempt(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	for _, adapter := range []bool{false, true} {
		tbl := testdb.Table(t, "claim_dead_outbox")
		ids := insertRows(t, pool, tbl,
			"",                              // due
			"dead_at = now(), attempts = 1", // dead, due now
			"attempts = 5, locked_at = now() - interval '1 hour', available_at = now() - interval '2 hours'", // lease expired on the last attempt
			"attempts = 9", // above max, not leased: claimed (max lowered)
		)
		var (
			claimed, parked []string
			err             error
		)
		if adapter {
			a := sqlq.Adapter{Table: tbl, MaxAttempts: 5}
			st := a.ClaimStatement(sqlq.AllTopics)
			rows, qerr := pool.Query(ctx, st.SQL, st.Args...)
			if qerr != nil {
				t.Fatal(qerr)
			}
			for rows.Next() {
				_, msg, serr := a.ScanClaimed(rows)
				if serr != nil {
					t.Fatal(serr)
				}
				claimed = append(claimed, msg.UUID)
			}
			err = rows.Err()
		} else {
			q := sqlq.NewQueries(tbl, schema.Columns{})
			rows, qerr := pool.Query(ctx, q.ClaimAll, 5, 60.0, 10)
			if qerr != nil {
				t.Fatal(qerr)
			}
			for rows.Next() {
				var r sqlq.ClaimedRow
				if serr := r.ScanClaim(rows, schema.Columns{}); serr != nil {
					t.Fatal(serr)
				}
				if r.Parked {
					parked = append(parked, r.EventID)
				} else {
					claimed = append(claimed, r.EventID)
				}
			}
			err = rows.Err()
		}
		if err != nil {
			t.Fatal(err)
		}
		if strings.Join(claimed, ",") != ids[0]+","+ids[3] {
			t.Fatalf("adapter %v: claimed %v, want %v", adapter, claimed, []string{ids[0], ids[3]})
		}
		if !adapter && (len(parked) != 1 || parked[0] != ids[2]) {
			t.Fatalf("parked %v, want [%s]", parked, ids[2])
		}
		var dead, inf, locked bool
		var attempts int
		var lastError string
		if err := pool.QueryRow(ctx, `SELECT dead_at IS NOT NULL, available_at = 'infinity', locked_at IS NOT NULL, attempts, last_error
FROM `+tbl.Sanitize()+` WHERE event_id = $1`, ids[2]).Scan(&dead, &inf, &locked, &attempts, &lastError); err != nil {
			t.Fatal(err)
		}
		if !dead || !inf || locked || attempts != 5 || !strings.Contains(lastError, "lease of attempt 5 expired") || !strings.Contains(lastError, "max 5") {
			t.Fatalf("adapter %v: expired last attempt: dead %v parked %v locked %v attempts %d last_error %q", adapter, dead, inf, locked, attempts, lastError)
		}
	}
}

// TestMigrateAddsDeadAtToExistingTable: a table created by a version
// without dead_at gets the column from Migrate, which marks dead the rows
// that version considered dead (parked at 'infinity', or 25 attempts and not
// leased) and nothing else; running it again changes nothing.
func TestMigrateAddsDeadAtToExistingTable(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "legacy_outbox")
	if _, err := pool.Exec(ctx, `ALTER TABLE `+tbl.Sanitize()+` DROP COLUMN dead_at`); err != nil {
		t.Fatal(err)
	}
	if err := schema.CheckDeadAt(ctx, pool, tbl); err == nil || !strings.Contains(err.Error(), "outbox migrate") {
		t.Fatalf("CheckDeadAt on a legacy table: %v", err)
	}
	ids := insertRows(t, pool, tbl,
		"attempts = 25, last_error = 'x', available_at = 'infinity'",                 // parked by an old nack
		"attempts = 3, last_error = 'permanent: x', available_at = 'infinity'",       // old permanent error
		"attempts = 25, last_error = 'x'",                                            // stranded at max, not leased
		"attempts = 25, locked_at = now()",                                           // last attempt in flight
		"attempts = 3, last_error = 'x', available_at = now() + interval '1 minute'", // retrying
		"published_at = now(), attempts = 25",                                        // published
	)
	for range 2 {
		if err := schema.Migrate(ctx, pool, tbl); err != nil {
			t.Fatal(err)
		}
	}
	if err := schema.CheckDeadAt(ctx, pool, tbl); err != nil {
		t.Fatal(err)
	}
	want := []bool{true, true, true, false, false, false}
	for i, id := range ids {
		var dead, inf bool
		if err := pool.QueryRow(ctx, `SELECT dead_at IS NOT NULL, available_at = 'infinity' FROM `+tbl.Sanitize()+` WHERE event_id = $1`, id).Scan(&dead, &inf); err != nil {
			t.Fatal(err)
		}
		if dead != want[i] || (dead && !inf) {
			t.Errorf("row %d: dead %v parked %v, want dead %v", i, dead, inf, want[i])
		}
	}
}
