package walrelay_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/cleaner"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
	"github.com/outboxkit/watermill-outbox/walrelay"
)

// TestWALHistory is a randomized history of the WAL relay: producers commit
// keyed events; handlers fail some events for good (they go dead and hold
// their key) and nack others now and then; an operator replays or skips
// every held row; relays are closed, replaced and have their replication
// session terminated. The history must keep these rules:
//
//  1. every committed event is acked, unless it was skipped;
//  2. a skipped event is never handed over (and then acked) after its skip
//     was requested (one acked before it lost its ack with a relay, at least
//     once; a copy handed over before the skip may be acked after it);
//  3. per key, first acks are in commit order (sequence order, as keyed
//     writers serialise), skipped events left out;
//  4. no event is acked before every earlier event of its key was acked or
//     its skip requested;
//  5. at no instant does a relay hand a message of a key to a handler while
//     another message of the key it handed out is still in a handler
//     (checked when each message is handed over); across relays the
//     promise needs handlers that return when their message's context
//     ends, which is not checked here.
//
// Faults beside the churn: handlers that hold their message for a while
// (half of them return early when its context ends, half ignore it) while
// sessions are cut; a crash of the server (immediate stop: the slot's
// confirmed position goes back); the cleaner with a retention of one
// millisecond; and transactions of hundreds of rows of one key, beyond
// MaxInFlight (32): a nacked head spills its key's backlog to a retrying
// hold, retried from the table (the operator acts on dead holds only).
//
// WAL_HISTORY_EVENTS sets the size (default 1,500).
func TestWALHistory(t *testing.T) {
	t.Parallel()
	events := 1500
	if v, err := strconv.Atoi(os.Getenv("WAL_HISTORY_EVENTS")); err == nil && v > 0 {
		events = v
	}
	// Commits wait for a synchronous standby that never comes when a
	// session asks for it (the late batches below); others commit locally.
	pool, tbl, pg := clusterWith(t, map[string]string{"synchronous_standby_names": "ghost", "synchronous_commit": "local"})
	ctx := context.Background()
	trace := &lockedLog{}
	logger := watermill.NewStdLoggerWithOut(trace, true, true)
	note := func(format string, args ...any) {
		trace.line(time.Now().Format("15:04:05.000000") + " test " + fmt.Sprintf(format, args...))
	}

	type ev = histEvent
	var (
		mu      sync.Mutex
		byID    = map[string]*ev{}
		byKey   = map[string][]*ev{} // in sequence order
		nacks   int
		replay  int
		skips   int
		inHand  = map[string]map[*walrelay.Subscriber]int{}
		overlap []string
		slow    int
		unknown int // dead rows the producers never recorded (a commit the crash hid from its producer)
		crashed bool
		late    int // batches committed late (see below)
	)
	// retry runs a statement of the test's own until it succeeds: around
	// the crash the pool's connections fail once each.
	retry := func(what string, f func() error) {
		var err error
		for deadline := time.Now().Add(liveness); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
			if err = f(); err == nil {
				return
			}
		}
		t.Errorf("%s: %v", what, err)
	}
	handle := func(msg *message.Message, handed time.Time) error {
		mu.Lock()
		defer mu.Unlock()
		e := byID[msg.UUID]
		if e == nil {
			return errors.New("unknown event")
		}
		if e.doomed {
			note("reject key %s seq %d", e.key, e.seq)
			return subscriber.Permanent(errors.New("rejected for good"))
		}
		if rand.IntN(20) == 0 {
			nacks++
			note("nack key %s seq %d", e.key, e.seq)
			return errors.New("transient")
		}
		if e.acks == 0 {
			e.firstAck = time.Now()
		}
		e.lastAck = time.Now()
		if handed.After(e.lastHanded) {
			e.lastHanded = handed
		}
		e.acks++
		note("ack key %s seq %d", e.key, e.seq)
		return nil
	}
	var (
		relaysMu sync.Mutex
		relays   []*walrelay.Subscriber
		names    = map[*walrelay.Subscriber]string{}
	)
	started := 0
	start := func() {
		started++
		name := "r" + strconv.Itoa(started)
		s := relayLogged(t, pool, tbl, func(c *walrelay.Config) {
			// A small MaxInFlight: a nacked head with a transaction of
			// hundreds of its key's rows behind it spills them to a
			// retrying hold (then retried from the table after Backoff).
			c.MaxInFlight = historyInFlight
			c.MaxAttempts = 3
			c.Backoff = func(int) time.Duration { return 10 * time.Millisecond }
		}, logger.With(watermill.LogFields{"relay": name}))
		note("relay started %s", name)
		ch, err := s.Subscribe(ctx, subscriber.AllTopics)
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			for msg := range ch {
				go func(msg *message.Message) {
					handed := time.Now()
					mu.Lock()
					e := byID[msg.UUID]
					if e != nil {
						if inHand[e.key] == nil {
							inHand[e.key] = map[*walrelay.Subscriber]int{}
						}
						note("handed key %s seq %d by %s", e.key, e.seq, name)
						if n := inHand[e.key][s]; n > 0 && len(overlap) < 20 {
							overlap = append(overlap, fmt.Sprintf("key %s seq %d handed over while %d message(s) of the key from the same relay are in a handler", e.key, e.seq, n))
						}
						inHand[e.key][s]++
					}
					hold := rand.IntN(50) == 0
					honour := rand.IntN(2) == 0
					if hold {
						slow++
					}
					mu.Unlock()
					if hold {
						// A slow handler: half return early when the
						// message's context ends (its session was cut).
						var done <-chan struct{}
						if honour {
							done = msg.Context().Done()
						}
						select {
						case <-done:
						case <-time.After(time.Duration(200+rand.IntN(600)) * time.Millisecond):
						}
					}
					err := handle(msg, handed)
					if e != nil {
						mu.Lock()
						inHand[e.key][s]--
						mu.Unlock()
					}
					if err != nil {
						subscriber.RecordError(msg, err)
						msg.Nack()
						return
					}
					msg.Ack()
				}(msg)
			}
		}()
		relaysMu.Lock()
		relays = append(relays, s)
		names[s] = name
		relaysMu.Unlock()
	}
	start()
	start()

	// Producers: batches of keyed events; 4% are doomed.
	var produced sync.WaitGroup
	produced.Add(1)
	go func() {
		defer produced.Done()
		for n := 0; n < events; {
			keys := make([]string, 5)
			for i := range keys {
				keys[i] = fmt.Sprintf("k%d", rand.IntN(30))
			}
			if rand.IntN(60) == 0 { // a transaction of hundreds of rows of one key
				keys = make([]string, 200+rand.IntN(200))
				k := fmt.Sprintf("k%d", rand.IntN(30))
				for i := range keys {
					keys[i] = k
				}
			}
			if rand.IntN(8) == 0 {
				// A late batch: committed and streamed, invisible to other
				// sessions for 20-150 ms (its commit waits for the ghost
				// standby until the test cancels the wait), registered
				// before its commit so that handlers know its events.
				n += enqueueLate(t, pool, tbl, keys, func(ids []uuid.UUID, seqs []int64) {
					mu.Lock()
					defer mu.Unlock()
					for i, id := range ids {
						e := &ev{key: keys[i], seq: seqs[i], doomed: rand.IntN(25) == 0}
						byID[id.String()] = e
						byKey[keys[i]] = append(byKey[keys[i]], e)
					}
					late++
					note("late batch of %d", len(ids))
				}, func(missing map[string]bool) {
					// The crash came before the commit: not committed.
					mu.Lock()
					defer mu.Unlock()
					for id := range missing {
						e := byID[id]
						delete(byID, id)
						list := byKey[e.key][:0]
						for _, o := range byKey[e.key] {
							if o != e {
								list = append(list, o)
							}
						}
						byKey[e.key] = list
					}
					note("late batch lost to the crash: %d events", len(missing))
				})
				time.Sleep(2 * time.Millisecond)
				continue
			}
			mu.Lock()
			var ids []uuid.UUID
			var err error
			for attempt := 0; attempt < 100; attempt++ { // around the crash
				if ids, err = enqueueErr(pool, tbl, false, keys...); err == nil {
					break
				}
				time.Sleep(50 * time.Millisecond)
			}
			if err != nil {
				mu.Unlock()
				t.Error(err)
				return
			}
			seqs := map[uuid.UUID]int64{}
			retry("read the sequences", func() error {
				rows, err := pool.Query(ctx, `SELECT event_id, sequence FROM `+tbl.Sanitize()+` WHERE event_id = ANY($1)`, ids)
				if err != nil {
					return err
				}
				defer rows.Close()
				for rows.Next() {
					var id uuid.UUID
					var seq int64
					if err := rows.Scan(&id, &seq); err != nil {
						return err
					}
					seqs[id] = seq
				}
				return rows.Err()
			})
			for i, id := range ids {
				seq, ok := seqs[id]
				if !ok {
					mu.Unlock()
					t.Errorf("no sequence for %s", id)
					return
				}
				e := &ev{key: keys[i], seq: seq, doomed: rand.IntN(25) == 0}
				byID[id.String()] = e
				byKey[keys[i]] = append(byKey[keys[i]], e)
			}
			mu.Unlock()
			n += len(ids)
			time.Sleep(2 * time.Millisecond)
		}
	}()

	// The operator: replays or skips every held row.
	stop := make(chan struct{})
	opDone := make(chan struct{})
	go func() {
		defer close(opDone)
		for {
			select {
			case <-stop:
				return
			case <-time.After(50 * time.Millisecond):
			}
			held, err := runbook.New(pool, tbl).HeldKeys(ctx, 1000)
			if err != nil {
				continue // the crash; the next round reads again
			}
			for _, h := range held {
				if h.DeadAt == nil || h.SkipRequestedAt != nil {
					continue
				}
				id, err := uuid.Parse(h.EventID)
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				known := byID[h.EventID] != nil
				mu.Unlock()
				if !known {
					// A row the producers do not know: its commit succeeded
					// while the crash made the producer see an error and
					// write its batch again under new event ids. Its
					// handler refused it ("unknown event") until it went
					// dead; it is no part of the history: skip it.
					note("skip unknown key %s seq %d", h.Key, h.Sequence)
					retry("skip "+id.String(), func() error {
						_, err := runbook.New(pool, tbl).SkipEvent(ctx, id, false)
						return err
					})
					mu.Lock()
					unknown++
					mu.Unlock()
					continue
				}
				if rand.IntN(2) == 0 {
					mu.Lock()
					byID[h.EventID].doomed = false
					mu.Unlock()
					note("replay key %s seq %d", h.Key, h.Sequence)
					retry("replay "+id.String(), func() error {
						_, err := runbook.New(pool, tbl).ReplayEvent(ctx, id, runbook.ReplayOptions{})
						return err
					})
					mu.Lock()
					replay++
					mu.Unlock()
				} else {
					mu.Lock()
					byID[h.EventID].skipAt = time.Now()
					mu.Unlock()
					note("skip key %s seq %d", h.Key, h.Sequence)
					retry("skip "+id.String(), func() error {
						_, err := runbook.New(pool, tbl).SkipEvent(ctx, id, false)
						return err
					})
					mu.Lock()
					skips++
					mu.Unlock()
				}
			}
		}
	}()

	// Chaos while the producers run (at least 12 rounds): terminate
	// replication sessions, replace relays.
	producing := make(chan struct{})
	go func() { produced.Wait(); close(producing) }()
	finished := func() bool {
		select {
		case <-producing:
			return true
		default:
			return false
		}
	}
	clean, err := cleaner.New(pool, cleaner.Config{Table: tbl, Retention: time.Millisecond, BatchSize: 500}, nil)
	if err != nil {
		t.Fatal(err)
	}
	cleaned := 0
	for i := 0; i < 12 || !finished(); i++ {
		time.Sleep(150 * time.Millisecond)
		if i%4 == 1 {
			if _, _, err := clean.CleanOnce(ctx); err == nil {
				cleaned++
			}
		}
		if i == 7 {
			mu.Lock()
			crashed = true
			mu.Unlock()
			note("server crash")
			pg.Crash()
			continue
		}
		if i%3 == 2 {
			relaysMu.Lock()
			old := relays[0]
			relays = relays[1:]
			relaysMu.Unlock()
			_ = old.Close()
			relaysMu.Lock()
			oldName := names[old]
			relaysMu.Unlock()
			note("relay closed %s", oldName)
			start()
			continue
		}
		retry("terminate the sessions", func() error {
			_, err := pool.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_replication WHERE application_name = 'outbox-walrelay'`)
			return err
		})
		note("sessions terminated")
	}
	produced.Wait()

	// Settle: every event acked or skipped.
	deadline := time.Now().Add(liveness)
	for {
		mu.Lock()
		left := 0
		for _, e := range byID {
			if e.acks == 0 && e.skipAt.IsZero() {
				left++
			}
		}
		mu.Unlock()
		if left == 0 {
			break
		}
		if time.Now().After(deadline) {
			held, _ := runbook.New(pool, tbl).HeldKeys(ctx, 100)
			mu.Lock()
			shown := 0
			for id, e := range byID {
				if e.acks == 0 && e.skipAt.IsZero() && shown < 3 {
					shown++
					var dead, published bool
					var attempts int
					_ = pool.QueryRow(ctx, `SELECT dead_at IS NOT NULL, published_at IS NOT NULL, attempts FROM `+tbl.Sanitize()+` WHERE event_id = $1`, id).Scan(&dead, &published, &attempts)
					t.Logf("stuck: key %s seq %d doomed %v; row dead %v attempts %d", e.key, e.seq, e.doomed, dead, attempts)
				}
			}
			mu.Unlock()
			trace.dump(t, stuckKey(byID))
			if path := os.Getenv("WAL_HISTORY_TRACE"); path != "" {
				trace.mu.Lock()
				_ = os.WriteFile(path, []byte(strings.Join(trace.lines, "\n")), 0o600)
				trace.mu.Unlock()
			}
			t.Fatalf("rule 1: %d events neither acked nor skipped after %s; holds %+v", left, liveness, held)
		}
		time.Sleep(50 * time.Millisecond)
	}
	close(stop)
	<-opDone
	time.Sleep(200 * time.Millisecond) // late duplicates

	mu.Lock()
	defer mu.Unlock()
	violations := 0
	violatedKey := ""
	for _, o := range overlap {
		t.Errorf("rule 5: %s", o)
		violations++
		violatedKey = strings.Fields(o)[1]
	}
	if !crashed {
		t.Error("the server did not crash during the history")
	}
	for k, list := range byKey {
		var lastAck time.Time
		var lastSeq int64
		for _, e := range list {
			if !e.skipAt.IsZero() {
				// An event acked before its skip was requested is one whose
				// ack was lost with a relay, redelivered and failed for good
				// (at least once): only an ack after the skip breaks rule 2.
				// A copy handed over before the skip may be acked after it
				// (its handler was slow): only a hand-over after the skip
				// breaks the rule.
				if e.acks > 0 && e.lastHanded.After(e.skipAt) {
					t.Errorf("rule 2: key %s: skipped event seq %d was acked after the skip", k, e.seq)
					violations++
					violatedKey = k
				}
				done := e.skipAt
				if e.acks > 0 && e.firstAck.Before(done) {
					done = e.firstAck
				}
				lastAck = maxTime(lastAck, done)
				continue
			}
			if e.seq <= lastSeq {
				t.Errorf("key %s: sequences not increasing in the record (%d after %d)", k, e.seq, lastSeq)
			}
			lastSeq = e.seq
			if e.firstAck.Before(lastAck) {
				t.Errorf("rules 3-4: key %s: seq %d first acked at %s, before an earlier event of its key was acked or skipped (%s)",
					k, e.seq, e.firstAck.Format("15:04:05.000000"), lastAck.Format("15:04:05.000000"))
				violations++
				violatedKey = k
			}
			lastAck = maxTime(lastAck, e.firstAck)
		}
	}
	dups := 0
	for _, e := range byID {
		if e.acks > 1 {
			dups += e.acks - 1
		}
	}
	if violations > 0 {
		trace.dump(t, violatedKey)
		if path := os.Getenv("WAL_HISTORY_TRACE"); path != "" {
			trace.mu.Lock()
			_ = os.WriteFile(path, []byte(strings.Join(trace.lines, "\n")), 0o600)
			trace.mu.Unlock()
		}
	}
	spills := int64(0)
	relaysMu.Lock()
	for s := range names {
		spills += walrelay.Spilled(s)
	}
	relaysMu.Unlock()
	if spills == 0 {
		t.Error("no retrying key was spilled during the history")
	}
	unseenWaits := int64(0)
	relaysMu.Lock()
	for s := range names {
		unseenWaits += walrelay.Unseen(s)
	}
	relaysMu.Unlock()
	if late == 0 {
		t.Error("no late batch during the history")
	}
	t.Logf("%d late batches (streamed before visible); the relays put %d statements off until a transaction was visible", late, unseenWaits)
	if unknown > 0 {
		t.Logf("%d rows unknown to the producers (committed while the crash hid the commit) skipped", unknown)
	}
	t.Logf("%d events over %d keys; %d nacks, %d replays, %d skips, %d spills, %d duplicates, %d slow handlers, %d cleaner passes, 1 crash; %d violations",
		len(byID), len(byKey), nacks, replay, skips, spills, dups, slow, cleaned, violations)
}

// historyInFlight is TestWALHistory's MaxInFlight.
const historyInFlight = 32

// histEvent is one event of TestWALHistory.
type histEvent struct {
	key      string
	seq      int64
	doomed   bool // fails for good until replayed
	skipAt   time.Time
	firstAck time.Time
	lastAck  time.Time
	// lastHanded is when the latest acked copy was handed to its handler.
	lastHanded time.Time
	acks       int
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// lockedLog collects the relays' log and the test's notes.
type lockedLog struct {
	mu    sync.Mutex
	lines []string
	part  []byte
}

func (l *lockedLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.part = append(l.part, p...)
	for {
		i := bytes.IndexByte(l.part, '\n')
		if i < 0 {
			break
		}
		l.lines = append(l.lines, string(l.part[:i]))
		l.part = l.part[i+1:]
	}
	return len(p), nil
}

func (l *lockedLog) line(s string) {
	l.mu.Lock()
	l.lines = append(l.lines, s)
	l.mu.Unlock()
}

// dump logs the lines about key k (and the relays' lifecycle).
func (l *lockedLog) dump(t *testing.T, k string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, s := range l.lines {
		if strings.Contains(s, "key "+k+" ") || strings.Contains(s, "key="+k+" ") || strings.Contains(s, "relay ") ||
			strings.Contains(s, "terminated") || strings.Contains(s, "Stale copy") || strings.Contains(s, "WAL relay active") || strings.Contains(s, "stream ended") {
			t.Log(s)
		}
	}
}

func stuckKey(byID map[string]*histEvent) string {
	for _, e := range byID {
		if e.acks == 0 && e.skipAt.IsZero() {
			return e.key
		}
	}
	return ""
}

// enqueueLate writes one transaction of keyed events whose commit waits
// for the ghost standby (synchronous_commit on) until a canceller ends the
// wait 20-150 ms later: the transaction is committed and streamed before
// any other session can see it. registered gets the events (in sequence
// order) before the commit; lost gets the event ids that are not in the
// table after a commit that failed (the server crashed). It returns the
// number of events written and committed.
func enqueueLate(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, keys []string, registered func([]uuid.UUID, []int64), lost func(map[string]bool)) int {
	ctx := context.Background()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return 0 // the crash: the batch is not written
	}
	defer conn.Release()
	var pid int
	if err := conn.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		return 0
	}
	if _, err := conn.Exec(ctx, `SET synchronous_commit = on`); err != nil {
		return 0
	}
	defer func() { _, _ = conn.Exec(ctx, `RESET synchronous_commit`) }()
	tx, err := conn.Begin(ctx)
	if err != nil {
		return 0
	}
	ids := make([]uuid.UUID, len(keys))
	msgs := make([]publisher.Message, len(keys))
	for i, k := range keys {
		ids[i] = uuid.New()
		msgs[i] = publisher.Message{TenantID: uuid.New(), Topic: "org.wal.changed.v1", EventID: ids[i], Payload: json.RawMessage(`{"n":1}`), OrderingKey: k}
	}
	if _, err := publisher.EnqueueBatch(ctx, tx, tbl, msgs); err != nil {
		_ = tx.Rollback(ctx)
		return 0
	}
	seqs := make([]int64, len(ids))
	rows, err := tx.Query(ctx, `SELECT event_id, sequence FROM `+tbl.Sanitize()+` WHERE event_id = ANY($1)`, ids)
	if err != nil {
		_ = tx.Rollback(ctx)
		return 0
	}
	bySeq := map[uuid.UUID]int64{}
	for rows.Next() {
		var id uuid.UUID
		var seq int64
		if err := rows.Scan(&id, &seq); err != nil {
			rows.Close()
			_ = tx.Rollback(ctx)
			return 0
		}
		bySeq[id] = seq
	}
	rows.Close()
	if rows.Err() != nil || len(bySeq) != len(ids) {
		_ = tx.Rollback(ctx)
		return 0
	}
	for i, id := range ids {
		seqs[i] = bySeq[id]
	}
	registered(ids, seqs)
	done := make(chan struct{})
	go func() {
		// A cancel before the commit waits is ignored by an idle session:
		// cancel again until the commit returns.
		time.Sleep(time.Duration(20+rand.IntN(130)) * time.Millisecond)
		for {
			_, _ = pool.Exec(ctx, `SELECT pg_cancel_backend($1)`, pid)
			select {
			case <-done:
				return
			case <-time.After(20 * time.Millisecond):
			}
		}
	}()
	err = tx.Commit(ctx)
	close(done)
	if err == nil {
		return len(ids)
	}
	// The commit failed (the crash): which rows were committed?
	missing := map[string]bool{}
	for deadline := time.Now().Add(liveness); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		found := map[string]bool{}
		rows, err := pool.Query(ctx, `SELECT event_id::text FROM `+tbl.Sanitize()+` WHERE event_id = ANY($1)`, ids)
		if err != nil {
			continue
		}
		for rows.Next() {
			var id string
			if rows.Scan(&id) == nil {
				found[id] = true
			}
		}
		rows.Close()
		if rows.Err() != nil {
			continue
		}
		for _, id := range ids {
			if !found[id.String()] {
				missing[id.String()] = true
			}
		}
		if len(missing) > 0 {
			lost(missing)
		}
		return len(ids) - len(missing)
	}
	t.Error("late batch: could not read its rows after the crash")
	return 0
}
