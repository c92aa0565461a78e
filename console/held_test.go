package console_test

import (
	"context"
	"encoding/json"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/console"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// heldKeys enqueues, for each key, a first row the relay fails once (a dead
// hold, MaxAttempts 1) and a second row it acks; it runs an ordered relay
// and returns the first rows and whether an event was acked.
func heldKeys(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, keys ...string) (first []uuid.UUID, acked func(uuid.UUID) bool, second []uuid.UUID) {
	t.Helper()
	ctx := context.Background()
	var msgs []publisher.Message
	failing := map[string]bool{}
	for _, k := range keys {
		a, b := uuid.New(), uuid.New()
		first, second = append(first, a), append(second, b)
		failing[a.String()] = true
		msgs = append(msgs,
			publisher.Message{TenantID: uuid.New(), Topic: "org.held.v1", EventID: a, Payload: json.RawMessage(`{}`), OrderingKey: k},
			publisher.Message{TenantID: uuid.New(), Topic: "org.held.v1", EventID: b, Payload: json.RawMessage(`{}`), OrderingKey: k})
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := publisher.EnqueueBatch(ctx, tx, tbl, msgs)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	sub, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: tbl, Ordered: true, MaxAttempts: 1, LockTTL: time.Second,
		ElectionInterval: 100 * time.Millisecond, PollInterval: 100 * time.Millisecond, CloseTimeout: 2 * time.Second}, watermill.NopLogger{})

	if err != nil {
		t.Fatal(err)
	}
	sctx, cancel := context.WithCancel(ctx)
	ch, err := sub.Subscribe(sctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu   sync.Mutex
		seen = map[string]bool{}
		done = make(chan struct{})
	)
	go func() {
		defer close(done)
		for msg := range ch {
			if failing[msg.UUID] {
				msg.Nack()
				continue
			}
			mu.Lock()
			seen[msg.UUID] = true
			mu.Unlock()
			msg.Ack()
		}
	}()
	t.Cleanup(func() {
		cancel()
		<-done
		_ = sub.Close()
	})
	return first, func(id uuid.UUID) bool {
		mu.Lock()
		defer mu.Unlock()
		return seen[id.String()]
	}, second
}

// TestHeldKeysFilterAndBulkSkip: the held keys page filters by text and
// to the dead holds; a bulk skip needs the typed count of ticked rows (a
// wrong count is a 400 page with a link back and changes nothing) and then
// skips exactly the ticked rows, whose keys go on; the other key stays
// held.
func TestHeldKeysFilterAndBulkSkip(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	first, acked, second := heldKeys(t, pool, tbl, "alpha-1", "alpha-2", "beta-1")
	const token = "held-bulk-token-of-the-console"
	h, err := console.New(pool, console.Config{Tables: []schema.Table{tbl}, Token: token})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()
	auth := login(t, srv.URL, token)
	held := srv.URL + "/t/" + tbl.String() + "/held"
	var page resp
	for deadline := time.Now().Add(2 * time.Minute); ; {
		page = do(t, "GET", held+"?dead=1", nil, auth)
		if strings.Count(page.body, `class="pick"`) == 3 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("three dead holds never showed:\n%s", page.body)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !strings.Contains(page.body, `<p id="held-mode">Ordered mode:`) || !strings.Contains(page.body, `<th id="position-heading">partition / sequence</th>`) {
		t.Errorf("the held keys page of an ordered table does not say its mode or label the partition:\n%s", page.body)
	}
	if f := do(t, "GET", held+"?q=ALPHA", nil, auth); strings.Count(f.body, `class="pick"`) != 2 || !strings.Contains(f.body, "2 held keys match, of 3") {
		t.Fatalf("filter alpha:\n%s", f.body)
	}
	if f := do(t, "GET", held+"?q=nothing-like-it", nil, auth); !strings.Contains(f.body, `No held key matches the filter`) {
		t.Fatalf("filter that matches nothing:\n%s", f.body)
	}
	csrf := csrfField.FindStringSubmatch(page.body)[1]
	form := url.Values{"csrf": {csrf}, "event": {first[0].String(), first[1].String()}}
	for _, bad := range []string{"", "3", "two"} {
		form.Set("confirm", bad)
		r := do(t, "POST", srv.URL+"/t/"+tbl.String()+"/skip", form, auth)
		if r.code != 400 || !strings.Contains(r.body, "Type the number of ticked rows (2)") || !strings.Contains(r.body, `<a href="/t/`+tbl.String()+`/held" id="back">`) {
			t.Fatalf("bulk skip confirmed with %q: %d\n%s", bad, r.code, r.body)
		}
	}
	if r := do(t, "POST", srv.URL+"/t/"+tbl.String()+"/skip", url.Values{"csrf": {csrf}, "event": {"nope"}, "confirm": {"1"}}, auth); r.code != 400 {
		t.Fatalf("bulk skip of a non-UUID: %d", r.code)
	}
	if r := do(t, "POST", srv.URL+"/t/"+tbl.String()+"/skip", url.Values{"event": {first[0].String()}, "confirm": {"1"}}, auth); r.code != 403 {
		t.Fatalf("bulk skip without CSRF: %d", r.code)
	}
	time.Sleep(300 * time.Millisecond)
	if acked(second[0]) || acked(second[1]) {
		t.Fatal("a refused bulk skip let a key go on")
	}
	form.Set("confirm", "2")
	r := do(t, "POST", srv.URL+"/t/"+tbl.String()+"/skip", form, auth)
	if r.code != 200 || !strings.Contains(r.body, "2 skips requested") {
		t.Fatalf("bulk skip: %d\n%s", r.code, r.body)
	}
	for deadline := time.Now().Add(2 * time.Minute); !acked(second[0]) || !acked(second[1]); {
		if time.Now().After(deadline) {
			t.Fatal("the skipped keys did not go on")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if acked(second[2]) {
		t.Fatal("the key that was not ticked went on")
	}
	// The relay resolves the holds of the delivered rows at a later tick.
	for deadline := time.Now().Add(2 * time.Minute); ; {
		p := do(t, "GET", held, nil, auth)
		if strings.Contains(p.body, `data-key="beta-1"`) && !strings.Contains(p.body, `data-key="alpha-1"`) && !strings.Contains(p.body, `data-key="alpha-2"`) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("held keys after the bulk skip:\n%s", p.body)
		}
		time.Sleep(50 * time.Millisecond)
	}
	// Skipping a row that no longer holds its key is reported, not a 500.
	form.Set("event", first[0].String())
	form.Set("confirm", "1")
	if r := do(t, "POST", srv.URL+"/t/"+tbl.String()+"/skip", form, auth); r.code != 409 || !strings.Contains(r.body, "1 refused") {
		t.Fatalf("bulk skip of a row already skipped: %d\n%s", r.code, r.body)
	}
	// The ticked rows can be replayed too: the dead hold's row is retried
	// (the relay fails it again, so it is dead again, later).
	deadSince := func() time.Time {
		t.Helper()
		keys, err := runbook.New(pool, tbl).HeldKeys(context.Background(), 100)
		if err != nil {
			t.Fatal(err)
		}
		for _, k := range keys {
			if k.Key == "beta-1" && k.DeadAt != nil {
				return *k.DeadAt
			}
		}
		return time.Time{}
	}
	before := deadSince()
	if before.IsZero() {
		t.Fatal("beta-1 is not a dead hold")
	}
	form.Set("event", first[2].String())
	if r := do(t, "POST", srv.URL+"/t/"+tbl.String()+"/replay-ticked", form, auth); r.code != 200 || !strings.Contains(r.body, "1 row replayed") ||
		!strings.Contains(r.body, `<a href="/t/`+tbl.String()+`/dead" id="back">`) {
		t.Fatalf("replay of the ticked held row: %d\n%s", r.code, r.body)
	}
	for deadline := time.Now().Add(2 * time.Minute); !deadSince().After(before); {
		if time.Now().After(deadline) {
			t.Fatal("the replayed held row was not tried again")
		}
		time.Sleep(50 * time.Millisecond)
	}
}
