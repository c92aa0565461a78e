package console_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/console"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

var heldRow = regexp.MustCompile(`(?s)<tr data-key="([^"]+)">(.*?)</tr>`)

// TestHeldPageOffersOnlyAllowedActions: a real ordered relay leaves holds
// in four states (retrying, dead, replay, and skip_requested once the relay
// stopped); the held keys page shows each state and, per row, exactly the
// Replay and Skip buttons runbook.HoldState.Allows accepts: none on a
// skip_requested hold, no Replay on a pending replay. The event page of a
// row whose hold refuses a replay has no Replay button and says why; a
// POST of a refused action is a 409 that changes nothing.
func TestHeldPageOffersOnlyAllowedActions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	keys := []string{"retry", "dead", "skip", "replay"}
	ids := make([]uuid.UUID, len(keys))
	var msgs []publisher.Message
	for i, k := range keys {
		ids[i] = uuid.New()
		msgs = append(msgs, publisher.Message{TenantID: uuid.New(), Topic: "org.held.v1", EventID: ids[i], Payload: json.RawMessage(`{}`), OrderingKey: k})
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := publisher.EnqueueBatch(ctx, tx, tbl, msgs)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	retry, dead, skip, replay := ids[0], ids[1], ids[2], ids[3]
	sub, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: tbl, Ordered: true, MaxAttempts: 100, LockTTL: time.Second,
		ElectionInterval: 100 * time.Millisecond, PollInterval: 100 * time.Millisecond, CloseTimeout: time.Second,
		Backoff: func(int) time.Duration { return time.Hour }}, watermill.NopLogger{})

	if err != nil {
		t.Fatal(err)
	}
	ch, err := sub.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu        sync.Mutex
		delivered = map[uuid.UUID]int{}
		wg        sync.WaitGroup
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for msg := range ch {
			id := uuid.MustParse(msg.UUID)
			mu.Lock()
			delivered[id]++
			n := delivered[id]
			mu.Unlock()
			switch {
			case id == retry || (id == replay && n > 1): // the replay's delivery fails and waits an hour
				subscriber.RecordError(msg, errors.New("flaky"))
				msg.Nack()
			case id == dead || id == skip:
				subscriber.RecordError(msg, subscriber.Permanent(errors.New("poison")))
				msg.Nack()
			default:
				msg.Ack()
			}
		}
	}()
	states := func() map[string]runbook.HoldState {
		list, err := runbook.New(pool, tbl).HeldKeys(ctx, 0)
		if err != nil {
			t.Fatal(err)
		}
		m := map[string]runbook.HoldState{}
		for _, h := range list {
			m[h.Key] = h.State
		}
		return m
	}
	for deadline := time.Now().Add(2 * time.Minute); ; {
		s := states()
		mu.Lock()
		acked := delivered[replay] > 0
		mu.Unlock()
		if acked && s["retry"] == runbook.HoldRetrying && s["dead"] == runbook.HoldDead && s["skip"] == runbook.HoldDead {
			// The replay of the acked row, once its partition's floor
			// passed it (ErrNotRelayedYet until then).
			_, err := runbook.New(pool, tbl).ReplayEvent(ctx, replay, runbook.ReplayOptions{})
			if err != nil && !errors.Is(err, runbook.ErrNotRelayedYet) {
				t.Fatalf("replay of the acked row: %v", err)
			}
			if err == nil {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("holds: %v", s)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err := sub.Close(); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	// With no relay running, the skip stays requested.
	if sk, err := runbook.New(pool, tbl).SkipEvent(ctx, skip, false); err != nil || sk.Changed != 1 {
		t.Fatalf("skip: %+v, %v", sk, err)
	}
	want := map[string]runbook.HoldState{"retry": runbook.HoldRetrying, "dead": runbook.HoldDead, "skip": runbook.HoldSkipRequested, "replay": runbook.HoldReplay}
	if got := states(); len(got) != len(want) || got["retry"] != want["retry"] || got["dead"] != want["dead"] || got["skip"] != want["skip"] || got["replay"] != want["replay"] {
		t.Fatalf("holds: %v, want %v", got, want)
	}

	const token = "held-states-token-of-the-console"
	h, err := console.New(pool, console.Config{Tables: []schema.Table{tbl}, Token: token})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()
	auth := login(t, srv.URL, token)
	page := do(t, "GET", srv.URL+"/t/"+tbl.String()+"/held", nil, auth)
	rows := map[string]string{}
	for _, m := range heldRow.FindAllStringSubmatch(page.body, -1) {
		rows[m[1]] = m[2]
	}
	if len(rows) != len(want) {
		t.Fatalf("held page rows %v:\n%s", rows, page.body)
	}
	for key, s := range want {
		row := rows[key]
		if !strings.Contains(row, `data-state="`+s.String()+`">`+s.Label()) {
			t.Errorf("row %s does not show state %q:\n%s", key, s.Label(), row)
		}
		if got, allowed := strings.Contains(row, `class="skip"`), s.Allows(runbook.OpSkip) == nil; got != allowed {
			t.Errorf("row %s (%s): Skip button %v, the rules allow a skip: %v", key, s, got, allowed)
		}
		if got, allowed := strings.Contains(row, `class="pick"`), s.Allows(runbook.OpSkip) == nil; got != allowed {
			t.Errorf("row %s (%s): bulk skip box %v, the rules allow a skip: %v", key, s, got, allowed)
		}
		if got, allowed := strings.Contains(row, `class="replay"`), s.Allows(runbook.OpReplay) == nil; got != allowed {
			t.Errorf("row %s (%s): Replay button %v, the rules allow a replay: %v", key, s, got, allowed)
		}
	}
	// The rules as the test states them, so that the page cannot follow a
	// wrong rule unnoticed: no button on a requested skip, Skip alone on a
	// pending replay, both on retrying and dead holds.
	for key, buttons := range map[string][2]bool{"retry": {true, true}, "dead": {true, true}, "skip": {false, false}, "replay": {true, false}} {
		if strings.Contains(rows[key], `class="skip"`) != buttons[0] || strings.Contains(rows[key], `class="replay"`) != buttons[1] {
			t.Errorf("row %s: Skip %v, Replay %v; want %v", key, strings.Contains(rows[key], `class="skip"`), strings.Contains(rows[key], `class="replay"`), buttons)
		}
	}

	event := func(id uuid.UUID) string {
		return do(t, "GET", srv.URL+"/t/"+tbl.String()+"/event/"+id.String(), nil, auth).body
	}
	if p := event(dead); !strings.Contains(p, `id="replay"`) {
		t.Errorf("the dead held row's page has no Replay button:\n%s", p)
	}
	for _, id := range []uuid.UUID{skip, replay} {
		if p := event(id); strings.Contains(p, `id="replay"`) || !strings.Contains(p, "Not replayable now") {
			t.Errorf("the page of a row whose hold refuses a replay offers one:\n%s", p)
		}
	}

	snapshot := func() string {
		var s string
		if err := pool.QueryRow(ctx, `SELECT string_agg(h::text, E'\n' ORDER BY h.ordering_key) FROM `+tbl.HoldsTable()+` AS h`).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	before := snapshot()
	csrf := csrfField.FindStringSubmatch(page.body)[1]
	for _, c := range []struct {
		id     uuid.UUID
		action string
	}{{skip, "skip"}, {skip, "replay"}, {replay, "replay"}} {
		r := do(t, "POST", srv.URL+"/t/"+tbl.String()+"/event/"+c.id.String()+"/"+c.action, url.Values{"csrf": {csrf}}, auth)
		if r.code != 409 || !strings.Contains(r.body, "which refuses "+c.action) {
			t.Errorf("POST %s of a hold that refuses it: %d\n%s", c.action, r.code, r.body)
		}
	}
	if after := snapshot(); after != before {
		t.Fatalf("refused actions changed the holds:\n%s\n%s", before, after)
	}
}
