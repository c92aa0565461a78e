package console_test

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// TestRelaysSayWhoTheyAre: a default-mode relay whose sessions are named
// as the daemon names them shows on the overview and on the relays page by
// that name, as the leader; an ordered relay shows as the owner of its
// partitions with a live lease.
func TestRelaysSayWhoTheyAre(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox")
	const name = "outbox-relay testhost 4242 v9.9.9"
	relayPool := testdb.NewPool(t, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["application_name"] = name })
	sub, err := subscriber.New(context.Background(), relayPool, subscriber.Config{Table: tbl, PollInterval: 100 * time.Millisecond}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if _, err := sub.Subscribe(ctx, subscriber.AllTopics); err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	srv := server(t, pool, tbl, "")
	page := srv.URL + "/t/" + tbl.String() + "/relays"
	var body string
	for deadline := time.Now().Add(2 * time.Minute); ; {
		body = do(t, "GET", page, nil, nil).body
		if strings.Contains(body, `<tr class="relay leader"><td class="app">`+name+`</td>`) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the relay does not show as the leader by its name:\n%s", body)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !strings.Contains(body, `<strong id="mode">default</strong>`) {
		t.Errorf("mode missing:\n%s", body)
	}
	if o := do(t, "GET", srv.URL+"/", nil, nil).body; !strings.Contains(o, `class="relays-link">`+name+`</a>`) {
		t.Errorf("the overview does not name the active relay:\n%s", o)
	}

	otbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	heldKeys(t, pool, otbl, "k")
	osrv := server(t, pool, otbl, "")
	host, _ := os.Hostname()
	for deadline := time.Now().Add(2 * time.Minute); ; {
		body = do(t, "GET", osrv.URL+"/t/"+otbl.String()+"/relays", nil, nil).body
		if strings.Contains(body, `<td class="owner">`+host+"-") && strings.Contains(body, "<td>live</td>") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the ordered relay does not show as a live partition owner:\n%s", body)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
