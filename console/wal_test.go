package console_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"html"
	"net/http/httptest"
	"net/url"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/chromedp/chromedp"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/console"
	"github.com/outboxkit/watermill-outbox/internal/pgtest"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
	"github.com/outboxkit/watermill-outbox/walrelay"
)

// walTable starts a private PostgreSQL with wal_level = logical (the shared
// server runs with replica) and returns a pool on it and an outbox table,
// with every optional column, set up for the WAL relay.
func walTable(t *testing.T) (*pgxpool.Pool, schema.Table) {
	t.Helper()
	pg := pgtest.Start(t, pgtest.Options{Settings: map[string]string{
		"wal_level": "logical", "max_replication_slots": "4", "max_wal_senders": "4", "wal_sender_timeout": "10s",
	}})
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, pg.URL("", ""))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	tbl := schema.MustParseTable("public.wal_console")
	if err := schema.Migrate(ctx, pool, tbl, schema.WithAllColumns()); err != nil {
		t.Fatal(err)
	}
	if _, err := walrelay.Setup(ctx, pool, tbl, walrelay.Names{}); err != nil {
		t.Fatal(err)
	}
	return pool, tbl
}

// walEnqueue commits one event per key ("" for none) in one transaction.
func walEnqueue(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, topic string, keys ...string) []uuid.UUID {
	t.Helper()
	ctx := context.Background()
	ids := make([]uuid.UUID, len(keys))
	msgs := make([]publisher.Message, len(keys))
	for i, k := range keys {
		ids[i] = uuid.New()
		msgs[i] = publisher.Message{TenantID: uuid.New(), Topic: topic, EventID: ids[i], Payload: json.RawMessage(`{"n":1}`), OrderingKey: k}
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := publisher.EnqueueBatch(ctx, tx, tbl, msgs)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return ids
}

var (
	overviewCell = func(name string) *regexp.Regexp {
		return regexp.MustCompile(`data-count="` + name + `">(?:<a [^>]*>)?([^<]*)<`)
	}
	rowEvent   = regexp.MustCompile(`<tr data-event="([0-9a-f-]{36})">`)
	deadEvent  = regexp.MustCompile(`class="event-link" href="/t/[^/]+/event/([0-9a-f-]{36})"`)
	heldKeyRow = regexp.MustCompile(`<tr data-key="([^"]*)">`)
	topicRow   = regexp.MustCompile(`<tr>\s*<td>([^<]*)</td><td class="n">(\d+)</td><td class="n">(\d+)</td><td class="n">(\d+)</td>`)
	eventState = regexp.MustCompile(`<dd id="state">([^<]*)</dd>`)
)

// sortedIDs returns the event ids of rows, sorted.
func sortedIDs(rows []runbook.Row) []string {
	out := make([]string, len(rows))
	for i, r := range rows {
		out[i] = r.EventID.String()
	}
	sort.Strings(out)
	return out
}

func sorted(s []string) []string {
	out := append([]string(nil), s...)
	sort.Strings(out)
	return out
}

// TestConsoleOnWALTable walks every page of the console for a table the
// WAL relay streams, with rows delivered (streamed), pending, retrying in
// the relay's memory, dead, one holding its key and one parked behind it;
// every figure and list matches runbook (the state layer): the overview
// and /api/counts, each row list, the dead rows and their causes, the held
// keys, the backlog by topic, the replay preview, each event's state; the
// overview names the relay reading the slot.
func TestConsoleOnWALTable(t *testing.T) {
	t.Parallel()
	pool, tbl := walTable(t)
	ctx := context.Background()
	const topic = "org.wal.console.v1"
	ok := walEnqueue(t, pool, tbl, topic, "a", "b", "c")
	held := walEnqueue(t, pool, tbl, topic, "held", "held")
	poison := walEnqueue(t, pool, tbl, topic, "")

	var (
		mu      sync.Mutex
		retries int
	)
	retryKey := "retry"
	s, err := walrelay.New(ctx, pool, walrelay.Config{Table: tbl, StatusInterval: 100 * time.Millisecond, ElectionInterval: 100 * time.Millisecond,
		CloseTimeout: 2 * time.Second, Backoff: func(int) time.Duration { return 10 * time.Minute }}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ch, err := s.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for msg := range ch {
			switch {
			case msg.UUID == held[0].String() || msg.UUID == poison[0].String():
				subscriber.RecordError(msg, subscriber.Permanent(errors.New("kafka: Message was too large")))
				msg.Nack()
			case msg.Metadata.Get(schema.MetadataOrderingKey) == retryKey:
				mu.Lock()
				retries++
				mu.Unlock()
				subscriber.RecordError(msg, errors.New("broker down"))
				msg.Nack()
			default:
				msg.Ack()
			}
		}
	}()
	stats := func() runbook.TableStats {
		t.Helper()
		st, err := runbook.New(pool, tbl).Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	waitStats := func(what string, cond func(runbook.TableStats) bool) runbook.TableStats {
		t.Helper()
		for deadline := time.Now().Add(2 * time.Minute); ; {
			st := stats()
			if cond(st) {
				return st
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: not within 2 minutes; stats %+v", what, st)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	waitStats("3 streamed, 2 dead, 1 parked", func(st runbook.TableStats) bool {
		return st.StreamedUnpublished == 3 && st.Dead == 2 && st.Pending == 1 && st.HeldKeys == 1
	})
	retrying := walEnqueue(t, pool, tbl, "org.wal.other.v1", retryKey, retryKey)
	for deadline := time.Now().Add(2 * time.Minute); ; {
		mu.Lock()
		n := retries
		mu.Unlock()
		if n > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the retrying key's first row never came")
		}
		time.Sleep(20 * time.Millisecond)
	}
	st := waitStats("3 pending (1 parked, 2 of a key retried in memory)", func(st runbook.TableStats) bool {
		return st.Pending == 3 && st.WaitingBehindHeldKeys == 1 && st.Dead == 2 && st.StreamedUnpublished == 3
	})
	if st.Mode != schema.ModeWAL || st.Retrying != 0 || st.DeadHeldKeys != 1 {
		t.Fatalf("stats %+v: want mode wal, retrying 0 (the WAL relay retries in memory), 1 dead held key", st)
	}

	const token = "wal-console-token-0123456789"
	h, err := console.New(pool, console.Config{Tables: []schema.Table{tbl}, Token: token})
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(h)
	defer hs.Close()
	srv := hs.URL
	auth := map[string]string{"Authorization": "Bearer " + token}
	name := tbl.String()
	get := func(path string) string {
		t.Helper()
		r := do(t, "GET", srv+path, nil, auth)
		if r.code != 200 {
			t.Fatalf("GET %s: %d\n%s", path, r.code, r.body)
		}
		return r.body
	}

	// The overview and /api/counts.
	page := get("/")
	heldKeys, err := runbook.New(pool, tbl).HeldKeys(ctx, 1000)
	if err != nil {
		t.Fatal(err)
	}
	for cell, want := range map[string]int64{"pending": st.Pending, "retrying": st.Retrying, "locked": st.Locked, "dead": st.Dead, "held_keys": int64(len(heldKeys))} {
		m := overviewCell(cell).FindStringSubmatch(page)
		if m == nil || strings.TrimSpace(m[1]) != strconv.FormatInt(want, 10) {
			t.Errorf("overview %s: %v, runbook says %d", cell, m, want)
		}
	}
	if m := overviewCell("leader").FindStringSubmatch(page); m == nil || !strings.Contains(html.UnescapeString(m[1]), "outbox-walrelay") {
		t.Errorf("the overview's active relay of a WAL table: %v, want the session reading the slot (outbox-walrelay)", m)
	}
	var counts map[string]struct {
		Stats runbook.TableStats `json:"stats"`
		Held  int                `json:"held_keys"`
	}
	if err := json.Unmarshal([]byte(get("/api/counts")), &counts); err != nil {
		t.Fatal(err)
	}
	if cs := counts[name]; cs.Stats.Pending != st.Pending || cs.Stats.Retrying != st.Retrying || cs.Stats.Dead != st.Dead ||
		cs.Stats.WaitingBehindHeldKeys != st.WaitingBehindHeldKeys || cs.Stats.HeldKeys != st.HeldKeys || cs.Stats.StreamedUnpublished != st.StreamedUnpublished ||
		cs.Stats.Mode != schema.ModeWAL || cs.Held != len(heldKeys) {
		t.Errorf("/api/counts %+v (held %d), runbook %+v (held %d)", cs.Stats, cs.Held, st, len(heldKeys))
	}

	// Every row list: its total and its rows are runbook.Runbook.ListRows'.
	for _, state := range []runbook.ListState{runbook.ListPending, runbook.ListRetrying, runbook.ListDead, runbook.ListDelivered, runbook.ListAll} {
		want, err := runbook.New(pool, tbl).ListRows(ctx, runbook.ListFilter{State: state, Limit: 100})
		if err != nil {
			t.Fatal(err)
		}
		body := get("/t/" + name + "/rows?state=" + string(state))
		var total int64
		if m := rowsPosition.FindStringSubmatch(body); m != nil {
			total, _ = strconv.ParseInt(m[3], 10, 64)
		} else if !strings.Contains(body, `id="no-rows"`) {
			t.Fatalf("rows %s: no position and no empty list:\n%s", state, body)
		}
		var got []string
		for _, m := range rowEvent.FindAllStringSubmatch(body, -1) {
			got = append(got, m[1])
		}
		if total != want.Total || fmt.Sprint(sorted(got)) != fmt.Sprint(sortedIDs(want.Rows)) {
			t.Errorf("rows %s: the console lists %d of %d, runbook %d of %d", state, len(got), total, len(want.Rows), want.Total)
		}
	}
	for state, want := range map[runbook.ListState]int64{runbook.ListPending: 3, runbook.ListDead: 2, runbook.ListDelivered: 3, runbook.ListAll: 8} {
		if m := rowsPosition.FindStringSubmatch(get("/t/" + name + "/rows?state=" + string(state))); m == nil || m[3] != strconv.FormatInt(want, 10) {
			t.Errorf("rows %s: %v, want %d", state, m, want)
		}
	}

	// The dead rows: the total, the cause, the rows.
	dead, err := runbook.New(pool, tbl).Dead(ctx, runbook.DeadFilter{})
	if err != nil {
		t.Fatal(err)
	}
	body := get("/t/" + name + "/dead")
	if !strings.Contains(body, plural(st.Dead, "dead row", "dead rows")) {
		t.Errorf("the dead rows page does not count %d dead rows:\n%s", st.Dead, body)
	}
	var causes []string
	for _, m := range causeRow.FindAllStringSubmatch(body, -1) {
		causes = append(causes, m[1]+" "+html.UnescapeString(m[2]))
	}
	if fmt.Sprint(causes) != "[2 permanent: kafka: Message was too large]" {
		t.Errorf("causes %v, want [2 permanent: kafka: Message was too large]", causes)
	}
	i := strings.Index(body, `id="dead-rows"`)
	if i < 0 {
		t.Fatalf("the dead rows page lists no row:\n%s", body)
	}
	var listed []string
	for _, m := range deadEvent.FindAllStringSubmatch(body[i:], -1) {
		listed = append(listed, m[1])
	}
	if fmt.Sprint(sorted(listed)) != fmt.Sprint(sortedIDs(dead)) {
		t.Errorf("the dead rows page lists %v, runbook's Dead %v", listed, sortedIDs(dead))
	}
	// The replay preview of every dead row and of the cause count them.
	for _, q := range []url.Values{{}, {"cause": {"permanent: kafka: Message was too large"}}} {
		form := previewForm(t, srv, name, q, auth)
		if form.Get("rows") != strconv.FormatInt(st.Dead, 10) {
			t.Errorf("the replay preview (%v) counts %s rows, %d are dead", q, form.Get("rows"), st.Dead)
		}
	}

	// The held keys, labelled for the WAL relay: no partition.
	heldPage := get("/t/" + name + "/held")
	if !strings.Contains(heldPage, `<p id="held-mode">WAL mode:`) || !strings.Contains(heldPage, `<th id="position-heading">sequence</th>`) ||
		strings.Contains(heldPage, "partition") || strings.Contains(heldPage, "Ordered mode") {
		t.Errorf("the held keys page of a WAL table is not labelled for it:\n%s", heldPage)
	}
	var keys []string
	for _, m := range heldKeyRow.FindAllStringSubmatch(heldPage, -1) {
		keys = append(keys, m[1])
	}
	if fmt.Sprint(keys) != "[held]" || len(heldKeys) != 1 || heldKeys[0].Key != "held" || heldKeys[0].EventID != held[0].String() {
		t.Errorf("held keys: the console %v, runbook %+v", keys, heldKeys)
	}

	// The held keys page in a browser at 1366 px, logged in: the held row's
	// Replay and Skip buttons and the bulk buttons are on screen, nothing
	// scrolls sideways (docs/console-held-wal.png).
	bctx := browser(t)
	steps(t, bctx, "the WAL held keys",
		chromedp.Navigate(srv+"/t/"+name+"/held"),
		chromedp.WaitVisible(`#need-login`),
		chromedp.SendKeys(`input[name="token"]`, token),
		chromedp.Click(`#login`),
		chromedp.WaitVisible(`#held-mode`),
		chromedp.WaitVisible(`tr[data-key="held"] button.skip`),
	)
	offscreen, err := chromedp.Run(bctx, chromedp.Evaluate[[]string](`["tr[data-key='held'] button.replay", "tr[data-key='held'] button.skip", "#skip-ticked", "#replay-ticked"].filter(function (sel) {
  var b = document.querySelector(sel); if (!b) { return true; } var r = b.getBoundingClientRect(); return r.width === 0 || r.left < 0 || r.right > window.innerWidth; })`))
	if err != nil || len(offscreen) != 0 {
		t.Errorf("the WAL held keys page at 1366 px: missing or off screen %v (%v)", offscreen, err)
	}
	if scroll, err := chromedp.Run(bctx, chromedp.Evaluate[bool](`document.documentElement.scrollWidth > window.innerWidth`)); err != nil || scroll {
		t.Errorf("the WAL held keys page scrolls sideways at 1366 px (%v)", err)
	}
	screenshot(t, bctx, "held-wal")

	// The backlog by topic.
	topics, err := runbook.New(pool, tbl).Topics(ctx, 100)
	if err != nil {
		t.Fatal(err)
	}
	var want, got []string
	for _, tb := range topics {
		want = append(want, fmt.Sprintf("%s %d %d %d", tb.Topic, tb.Pending, tb.Retrying, tb.Dead))
	}
	for _, m := range topicRow.FindAllStringSubmatch(get("/t/"+name+"/topics"), -1) {
		got = append(got, fmt.Sprintf("%s %s %s %s", html.UnescapeString(m[1]), m[2], m[3], m[4]))
	}
	if fmt.Sprint(sorted(got)) != fmt.Sprint(sorted(want)) || len(got) != 2 {
		t.Errorf("backlog by topic: the console %v, runbook %v", got, want)
	}

	// The relays: the slot and who reads it.
	if body := get("/t/" + name + "/relays"); !strings.Contains(body, `<strong id="mode">wal</strong>`) || !strings.Contains(body, "(outbox-walrelay)") {
		t.Errorf("the relays page does not show the WAL slot's reader:\n%s", body)
	}

	// Each event's page says where the row is, as runbook.Runbook.Event does; a
	// delivered row has no Replay button.
	for _, c := range []struct {
		id        uuid.UUID
		state     string
		replay    bool
		delivered bool
	}{
		{ok[0], "delivered", false, true},
		{held[0], "dead", true, false},
		{held[1], "waits behind a held key", false, false},
		{poison[0], "dead", true, false},
		{retrying[0], "pending", false, false},
		{retrying[1], "pending", false, false},
	} {
		ev, err := runbook.New(pool, tbl).Event(ctx, c.id)
		if err != nil {
			t.Fatal(err)
		}
		body := get("/t/" + name + "/event/" + c.id.String())
		m := eventState.FindStringSubmatch(body)
		if m == nil || m[1] != c.state || ev.Delivered != c.delivered {
			t.Errorf("event %s: the page says %v, want %q (runbook: delivered %v)", c.id, m, c.state, ev.Delivered)
		}
		if strings.Contains(body, `id="replay"`) != c.replay || strings.Contains(body, `id="no-replay"`) == c.replay {
			t.Errorf("event %s (%s): Replay button shown %v, want %v", c.id, c.state, !c.replay, c.replay)
		}
		if c.replay {
			// The button's promise: runbook would replay it.
			if _, err := runbook.New(pool, tbl).ReplayEvent(ctx, c.id, runbook.ReplayOptions{DryRun: true}); err != nil {
				t.Errorf("event %s shows a Replay button, runbook refuses: %v", c.id, err)
			}
		} else if !ev.Delivered {
			if _, err := runbook.New(pool, tbl).ReplayEvent(ctx, c.id, runbook.ReplayOptions{DryRun: true}); err == nil {
				t.Errorf("event %s shows no Replay button, runbook would replay it", c.id)
			}
		}
	}
}

// plural is the console's way of counting: "1 row", "2 rows".
func plural(n int64, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return strconv.FormatInt(n, 10) + " " + many
}
