//go:build fault

package fault

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/pgtest"
	"github.com/outboxkit/watermill-outbox/internal/rmqtest"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/router/amqpbackend"
	"github.com/outboxkit/watermill-outbox/schema"
)

// amqpURL is the shared RabbitMQ node, for the tests that restart no service.
const amqpURL = "amqp://guest:guest@127.0.0.1:5672/"

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

// relayProc is one `outbox relay` process.
type relayProc struct {
	cmd  *exec.Cmd
	done chan error
	log  string
}

// tail returns the end of the relay's log.
func (p *relayProc) tail() string {
	b, _ := os.ReadFile(p.log)
	if len(b) > 3000 {
		b = b[len(b)-3000:]
	}
	return string(b)
}

type harness struct {
	t         *testing.T
	bin       string
	env       []string
	logDir    string
	mu        sync.Mutex
	relays    []*relayProc
	kills     atomic.Int64
	startsSeq atomic.Int64
}

func (h *harness) start(singleActive bool) *relayProc {
	h.t.Helper()
	n := h.startsSeq.Add(1)
	f, err := os.Create(filepath.Join(h.logDir, fmt.Sprintf("relay-%d.log", n)))
	if err != nil {
		h.t.Fatal(err)
	}
	cmd := exec.Command(h.bin, "relay")
	cmd.Env = append(append([]string{}, h.env...), "OUTBOX_RELAY_SINGLE_ACTIVE="+strconv.FormatBool(singleActive))
	cmd.Stdout, cmd.Stderr = f, f
	if err := cmd.Start(); err != nil {
		h.t.Fatal(err)
	}
	p := &relayProc{cmd: cmd, done: make(chan error, 1), log: f.Name()}
	go func() { p.done <- cmd.Wait(); _ = f.Close() }()
	h.mu.Lock()
	h.relays = append(h.relays, p)
	h.mu.Unlock()
	return p
}

// killRandom SIGKILLs one running relay and starts a replacement.
func (h *harness) killRandom(singleActive bool) {
	h.mu.Lock()
	i := rand.IntN(len(h.relays))
	p := h.relays[i]
	h.relays = append(h.relays[:i], h.relays[i+1:]...)
	h.mu.Unlock()
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	if err := <-p.done; err == nil {
		h.t.Logf("relay pid %d exited cleanly before SIGKILL reached it", p.cmd.Process.Pid)
	}
	h.kills.Add(1)
	h.t.Logf("%s SIGKILL relay pid %d", time.Now().Format("15:04:05.000"), p.cmd.Process.Pid)
	h.start(singleActive)
}

// stopAll sends SIGTERM to every relay and waits.
func (h *harness) stopAll() {
	h.mu.Lock()
	relays := h.relays
	h.relays = nil
	h.mu.Unlock()
	for _, p := range relays {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
	}
	for _, p := range relays {
		select {
		case err := <-p.done:
			// A relay SIGTERMed before the Go runtime installed its handler
			// (it had not printed a line yet) dies of the signal: it never
			// started, so it had nothing to drain.
			neverStarted := err != nil && strings.Contains(err.Error(), "signal: terminated") && p.tail() == ""
			if err != nil && !neverStarted {
				h.t.Errorf("relay exited with %v after SIGTERM, want a clean exit; its log ends:\n%s", err, p.tail())
			}
		case <-time.After(60 * time.Second):
			_ = p.cmd.Process.Kill()
			h.t.Errorf("relay did not stop on SIGTERM")
		}
	}
}

func run(t *testing.T, name string, args ...string) {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %v: %v\n%s", name, args, err, out)
	}
}

type received struct {
	at    time.Time
	relay string
}

// TestFaultInjection is the promise "nothing committed is ever lost", under
// relay crashes, a PostgreSQL restart, a broker outage and concurrent relays.
// The database and the broker it restarts are its own: a private PostgreSQL
// cluster (internal/pgtest) and a private RabbitMQ node (internal/rmqtest),
// so the shared services other tests and developers use stay up.
func TestFaultInjection(t *testing.T) {
	events := envInt("FAULT_EVENTS", 6000)
	kills := envInt("FAULT_KILLS", 6)
	ctx := context.Background()

	bin := filepath.Join(t.TempDir(), "outbox")
	run(t, "go", "build", "-o", bin, "../../cmd/outbox")

	pg := pgtest.Start(t, pgtest.Options{})
	broker := rmqtest.Start(t)
	pool, err := pgxpool.New(ctx, pg.URL("", ""))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	tbl := schema.MustParseTable("public.fault_outbox")
	if err := schema.Migrate(ctx, pool, tbl); err != nil {
		t.Fatal(err)
	}
	topic := "fault" + strings.ReplaceAll(uuid.NewString()[:8], "-", "") + ".event.happened.v1"
	logDir := t.TempDir()
	h := &harness{t: t, bin: bin, logDir: logDir, env: append(os.Environ(),
		"OUTBOX_DATABASE_URL="+pg.URL("", ""),
		"OUTBOX_RELAY_TABLES="+tbl.String(),
		"OUTBOX_BACKEND=amqp",
		"OUTBOX_AMQP_URL="+broker.URL(),
		"OUTBOX_RELAY_LOCK_TTL=3s",
		"OUTBOX_RELAY_POLL_INTERVAL=200ms",
		"OUTBOX_RELAY_DISPATCH_TIMEOUT=5s",
		"OUTBOX_CLEANER_ENABLED=false",
	)}

	// The consumer: every event_id received, with the relay that sent it.
	sub, err := amqp.NewSubscriber(amqpbackend.WatermillConfig(amqpbackend.Config{URL: broker.URL()}), watermill.NopLogger{})
	if err != nil {
		t.Fatalf("the private RabbitMQ node does not answer: %v", err)
	}
	subCtx, stopSub := context.WithCancel(ctx)
	defer stopSub()
	msgs, err := sub.Subscribe(subCtx, topic)
	if err != nil {
		t.Fatal(err)
	}
	var (
		recvMu sync.Mutex
		recv   = map[string]int{}
		order  []received
	)
	consumerDone := make(chan struct{})
	go func() {
		defer close(consumerDone)
		for m := range msgs {
			recvMu.Lock()
			recv[m.UUID]++
			at := time.Now()
			if ns, err := strconv.ParseInt(m.Metadata.Get("outbox_relayed_at"), 10, 64); err == nil {
				at = time.Unix(0, ns) // when the relay published it: broker delays do not blur the order
			}
			order = append(order, received{at, m.Metadata.Get("outbox_relay_id")})
			recvMu.Unlock()
			m.Ack()
		}
	}()

	// Producers: commit events in small transactions until `events` are
	// committed; a commit whose outcome is unknown (PostgreSQL restarting)
	// is settled against the table at the end.
	var (
		committed   sync.Map // event_id -> struct{}
		nCommitted  atomic.Int64
		uncertain   sync.Map
		producersWg sync.WaitGroup
		tenant      = uuid.New()
	)
	// Spread production over the whole chaos schedule, so every fault hits
	// a relay with work in flight.
	spread := time.Duration(kills)*1500*time.Millisecond + 20*time.Second
	perBatch := spread / time.Duration(events/10) * 4 // 4 producers
	for range 4 {
		producersWg.Add(1)
		go func() {
			defer producersWg.Done()
			next := time.Now()
			for nCommitted.Load() < int64(events) {
				time.Sleep(time.Until(next))
				next = next.Add(perBatch)
				batch := make([]publisher.Message, 10)
				for i := range batch {
					batch[i] = publisher.Message{TenantID: tenant, Topic: topic, EventID: uuid.New(), Payload: json.RawMessage(`{"fault":true}`)}
				}
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					_, err := publisher.EnqueueBatch(ctx, tx, tbl, batch)
					return err
				})
				for _, m := range batch {
					if err == nil {
						committed.Store(m.EventID.String(), struct{}{})
					} else {
						uncertain.Store(m.EventID.String(), struct{}{})
					}
				}
				if err == nil {
					nCommitted.Add(int64(len(batch)))
				} else {
					time.Sleep(100 * time.Millisecond)
				}
			}
		}()
	}

	// Phase 1: two relays, single-active on; kills, one PostgreSQL restart,
	// one broker outage.
	h.start(true)
	h.start(true)
	phase1Kills := kills/2 + kills%2
	pgRestartAt, brokerOutageAt := phase1Kills/3, 2*phase1Kills/3
	var pgRestarts, brokerOutages int
	for k := range phase1Kills {
		time.Sleep(time.Duration(300+rand.IntN(1200)) * time.Millisecond)
		h.killRandom(true)
		if k == pgRestartAt {
			pg.Restart()
			pgRestarts++
		}
		if k == brokerOutageAt {
			broker.Stop()
			time.Sleep(10 * time.Second)
			broker.Start()
			brokerOutages++
		}
	}
	phase1End := time.Now()

	t.Logf("%s phase 1 done at %d committed events", time.Now().Format("15:04:05.000"), nCommitted.Load())
	// Phase 2: three relays, single-active off, sharing the table through
	// SKIP LOCKED; more kills.
	h.stopAll()
	h.start(false)
	h.start(false)
	h.start(false)
	for range kills - phase1Kills {
		time.Sleep(time.Duration(300+rand.IntN(1200)) * time.Millisecond)
		h.killRandom(false)
	}
	producersWg.Wait()

	// Drain: every row of the table published, every one received.
	rows := waitDrained(ctx, t, pool, tbl, &recvMu, recv, time.Now().Add(3*time.Minute))
	h.stopAll()
	stopSub()
	_ = sub.Close()
	<-consumerDone

	recvMu.Lock()
	defer recvMu.Unlock()
	inTable := make(map[string]bool, len(rows))
	for _, id := range rows {
		inTable[id] = true
	}
	var lostCommitted, lostInTable, duplicates, unpublished, uncertainCommitted int
	committed.Range(func(k, _ any) bool {
		if !inTable[k.(string)] || recv[k.(string)] == 0 {
			lostCommitted++
		}
		return true
	})
	uncertain.Range(func(k, _ any) bool {
		if inTable[k.(string)] {
			uncertainCommitted++
		}
		return true
	})
	for _, id := range rows {
		if recv[id] == 0 {
			lostInTable++
		}
		if recv[id] > 1 {
			duplicates += recv[id] - 1
		}
	}
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM `+tbl.Sanitize()+` WHERE published_at IS NULL`).Scan(&unpublished)

	// Single-active overlap detector: in phase 1, messages ordered by the
	// time their relay published them switch from one relay to another only
	// when leadership changed (a kill or the PostgreSQL restart);
	// interleaving would show many more switches.
	sort.Slice(order, func(i, j int) bool { return order[i].at.Before(order[j].at) })
	switches, last, unnamed, relaysSeen, phase1Relays := 0, "", 0, map[string]bool{}, map[string]bool{}
	for _, r := range order {
		if r.relay == "" {
			unnamed++
		}
		relaysSeen[r.relay] = true
		if r.at.After(phase1End) {
			continue
		}
		phase1Relays[r.relay] = true
		if last != "" && r.relay != last {
			switches++
		}
		last = r.relay
	}
	allowedSwitches := phase1Kills + 2*pgRestarts + 1
	if os.Getenv("FAULT_DEBUG") != "" {
		last := ""
		for _, r := range order {
			if r.relay != last {
				t.Logf("%s now from %s", r.at.Format("15:04:05.000"), r.relay)
				last = r.relay
			}
		}
	}

	var b strings.Builder
	w := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintf(w, "events committed (producer saw COMMIT succeed)\t%d\n", nCommitted.Load())
	fmt.Fprintf(w, "commits with unknown outcome that did commit\t%d\n", uncertainCommitted)
	fmt.Fprintf(w, "rows in the table\t%d\n", len(rows))
	fmt.Fprintf(w, "relay SIGKILLs\t%d\n", h.kills.Load())
	fmt.Fprintf(w, "PostgreSQL restarts\t%d\n", pgRestarts)
	fmt.Fprintf(w, "broker outages (RabbitMQ node stopped 10s)\t%d\n", brokerOutages)
	fmt.Fprintf(w, "relays: phase 1 single-active on / phase 2 off\t2 / 3\n")
	fmt.Fprintf(w, "lost (committed, never received)\t%d\n", lostCommitted)
	fmt.Fprintf(w, "lost (in table, never received)\t%d\n", lostInTable)
	fmt.Fprintf(w, "rows left unpublished\t%d\n", unpublished)
	fmt.Fprintf(w, "duplicates received\t%d (%.2f%%)\n", duplicates, 100*float64(duplicates)/float64(max(1, len(rows))))
	fmt.Fprintf(w, "relay processes seen by the consumer: phase 1 / all\t%d / %d\n", len(phase1Relays), len(relaysSeen))
	fmt.Fprintf(w, "single-active relay switches in phase 1 (allowed)\t%d (%d)\n", switches, allowedSwitches)
	_ = w.Flush()
	t.Logf("fault-injection summary:\n%s", b.String())
	if f := os.Getenv("FAULT_SUMMARY_FILE"); f != "" {
		_ = os.WriteFile(f, []byte(b.String()), 0o644)
	}
	if lostCommitted != 0 || lostInTable != 0 || unpublished != 0 {
		t.Errorf("events lost: %d committed, %d in table; %d unpublished (relay logs in %s)", lostCommitted, lostInTable, unpublished, logDir)
	}
	if nCommitted.Load() < int64(events) {
		t.Errorf("only %d events committed", nCommitted.Load())
	}
	if unnamed > 0 {
		t.Errorf("%d messages without the outbox_relay_id header", unnamed)
	}
	if switches > allowedSwitches {
		t.Errorf("single-active: %d relay switches in phase 1, at most %d expected: relays dispatched at the same time", switches, allowedSwitches)
	}
}
