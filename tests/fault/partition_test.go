//go:build fault

package fault

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/kafkatest"
	"github.com/outboxkit/watermill-outbox/internal/pgtest"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
)

// TestFaultPartition is the promise "a partitioned leader loses the table
// within LeaderTimeout": a private PostgreSQL cluster and an in-process Kafka
// cluster listen on an address of this host; relay A runs in network
// namespace a and leads, relay B stands by in namespace b, each behind its
// own veth pair. While events are enqueued, A's link goes silent (frames to
// and from A are sent to a MAC address nobody has: no error, no reset, as a
// host cut off by a dead switch). The server must end A's session within
// LeaderTimeout*7/6 (17.5 s with the default LeaderTimeout; the test allows
// 10 s more for its own look at the lock, every 100 ms, on a loaded
// machine), B must take over and publish within a minute (its election,
// its claim and Kafka; without the keepalive the server would notice after
// minutes), A must step down, and every event must reach Kafka. It needs root and iproute2;
// it fails, never skips, when it cannot build the namespaces. It touches no
// shared service: the cluster, the namespaces, the veth pairs and the
// address it adds to lo are removed at the end, even on failure.
func TestFaultPartition(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Fatal("TestFaultPartition needs root: it creates network namespaces and veth pairs (CI runs `make test` as root)")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Fatal("TestFaultPartition needs iproute2 (`ip`): " + err.Error())
	}
	ctx := context.Background()
	const lockTTL = 15 * time.Second // only how soon A's orphaned leases come back, not the takeover

	n := newPartitionNet(t, os.Getpid()%250+1)
	pg := pgtest.Start(t, pgtest.Options{Listen: []string{n.svc}, Trust: []string{n.subnet}})
	kc, err := kafkatest.StartOn(n.svc, 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Close)
	bin := filepath.Join(t.TempDir(), "outbox")
	run(t, "go", "build", "-o", bin, "../../cmd/outbox")

	pool, err := pgxpool.New(ctx, pg.URL("", ""))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	tbl := schema.MustParseTable("public.partition_outbox")
	if err := schema.Migrate(ctx, pool, tbl); err != nil {
		t.Fatal(err)
	}
	topic := "partition" + strings.ReplaceAll(uuid.NewString()[:8], "-", "") + ".event.happened.v1"

	// The consumer: every event_id received, and when B first published.
	sub, err := kc.NewSubscriber("partition-test", watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	subCtx, stopSub := context.WithCancel(ctx)
	defer stopSub()
	msgs, err := sub.Subscribe(subCtx, topic)
	if err != nil {
		t.Fatal(err)
	}
	var (
		recvMu   sync.Mutex
		recv     = map[string]int{}
		firstBy  = map[string]time.Time{} // relay id -> first publish
		lastBy   = map[string]time.Time{}
		received atomic.Int64
	)
	consumerDone := make(chan struct{})
	go func() {
		defer close(consumerDone)
		for m := range msgs {
			at := time.Now()
			if ns, err := strconv.ParseInt(m.Metadata.Get("outbox_relayed_at"), 10, 64); err == nil {
				at = time.Unix(0, ns)
			}
			relay := m.Metadata.Get("outbox_relay_id")
			recvMu.Lock()
			recv[m.UUID]++
			if _, ok := firstBy[relay]; !ok {
				firstBy[relay] = at
			}
			if at.After(lastBy[relay]) {
				lastBy[relay] = at
			}
			recvMu.Unlock()
			received.Add(1)
			m.Ack()
		}
	}()

	logDir := t.TempDir()
	env := append(os.Environ(),
		"OUTBOX_DATABASE_URL="+pg.URL("", ""),
		"OUTBOX_RELAY_TABLES="+tbl.String(),
		"OUTBOX_BACKEND=kafka",
		"OUTBOX_KAFKA_BROKERS="+strings.Join(kc.Brokers(), ","),
		"OUTBOX_RELAY_LOCK_TTL="+lockTTL.String(),
		"OUTBOX_RELAY_POLL_INTERVAL=200ms",
		"OUTBOX_RELAY_DISPATCH_TIMEOUT=5s",
		"OUTBOX_CLEANER_ENABLED=false",
		// OUTBOX_RELAY_LEADER_TIMEOUT stays at its default (15s).
	)
	holder := func() string {
		var addr string
		qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		_ = pool.QueryRow(qctx, `SELECT coalesce((SELECT host(a.client_addr) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
			WHERE l.locktype = 'advisory' AND l.granted AND ((l.classid::bigint << 32) | l.objid::bigint) = $1), '')`, sqlq.LockKey(tbl)).Scan(&addr)
		return addr
	}
	a := startRelayIn(t, n.links[0].ns, bin, env, filepath.Join(logDir, "relay-a.log"))
	waitUntil(t, "relay A to take the lock", 30*time.Second, func() bool { return holder() == n.links[0].nsIP })
	b := startRelayIn(t, n.links[1].ns, bin, env, filepath.Join(logDir, "relay-b.log"))
	waitUntil(t, "relay B to start", 30*time.Second, func() bool { return strings.Contains(b.tail(), "relaying 1 table(s)") })
	host, _ := os.Hostname()
	idA, idB := fmt.Sprintf("%s:%d", host, a.cmd.Process.Pid), fmt.Sprintf("%s:%d", host, b.cmd.Process.Pid)

	// Producer: 5 events every 50 ms (100/s) until stopped.
	var (
		committed  sync.Map
		nCommitted atomic.Int64
		stopProd   = make(chan struct{})
		prodDone   = make(chan struct{})
		tenant     = uuid.New()
	)
	go func() {
		defer close(prodDone)
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stopProd:
				return
			case <-tick.C:
			}
			batch := make([]publisher.Message, 5)
			for i := range batch {
				batch[i] = publisher.Message{TenantID: tenant, Topic: topic, EventID: uuid.New(), Payload: json.RawMessage(`{"partition":true}`)}
			}
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				_, err := publisher.EnqueueBatch(ctx, tx, tbl, batch)
				return err
			})
			if err == nil {
				for _, m := range batch {
					committed.Store(m.EventID.String(), struct{}{})
				}
				nCommitted.Add(int64(len(batch)))
			}
		}
	}()
	waitUntil(t, "relay A to publish", 30*time.Second, func() bool {
		recvMu.Lock()
		defer recvMu.Unlock()
		return !firstBy[idA].IsZero()
	})
	time.Sleep(3 * time.Second)
	recvMu.Lock()
	if !firstBy[idB].IsZero() {
		t.Errorf("standby B published before the partition (single-active broken)")
	}
	recvMu.Unlock()

	// The partition.
	n.cut(t, 0)
	cut := time.Now()
	t.Logf("%s relay A's link cut (silent drop both ways)", cut.Format("15:04:05.000"))
	var released, steppedDown time.Duration
	deadline := cut.Add(90 * time.Second)
	for time.Now().Before(deadline) {
		if released == 0 && holder() != n.links[0].nsIP {
			released = time.Since(cut)
		}
		if steppedDown == 0 && strings.Contains(a.tail(), "stepping down") {
			steppedDown = time.Since(cut)
		}
		recvMu.Lock()
		byB := firstBy[idB]
		recvMu.Unlock()
		if released > 0 && steppedDown > 0 && !byB.IsZero() {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	recvMu.Lock()
	firstB := firstBy[idB]
	lastA := lastBy[idA]
	recvMu.Unlock()
	var takeover time.Duration
	if firstB.IsZero() {
		t.Errorf("standby B never published within 90 s of the partition; relay B's log ends:\n%s", b.tail())
	} else {
		takeover = firstB.Sub(cut)
	}
	// Keep producing while B leads, then heal the link and drain.
	time.Sleep(5 * time.Second)
	close(stopProd)
	<-prodDone
	n.heal(t, 0)
	healed := time.Now()

	rows := waitDrained(ctx, t, pool, tbl, &recvMu, recv, time.Now().Add(lockTTL+90*time.Second))
	aLeadsAgain := holder() == n.links[0].nsIP
	for _, p := range []*relayProc{a, b} {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
	}
	for name, p := range map[string]*relayProc{"A": a, "B": b} {
		select {
		case err := <-p.done:
			if err != nil {
				t.Errorf("relay %s exited with %v after SIGTERM; its log ends:\n%s", name, err, p.tail())
			}
		case <-time.After(60 * time.Second):
			_ = p.cmd.Process.Kill()
			t.Errorf("relay %s did not stop on SIGTERM", name)
		}
	}
	stopSub()
	_ = sub.Close()
	<-consumerDone

	recvMu.Lock()
	defer recvMu.Unlock()
	var lost, duplicates, unpublished int
	committed.Range(func(k, _ any) bool {
		if recv[k.(string)] == 0 {
			lost++
		}
		return true
	})
	for _, id := range rows {
		if recv[id] > 1 {
			duplicates += recv[id] - 1
		}
	}
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM `+tbl.Sanitize()+` WHERE published_at IS NULL`).Scan(&unpublished)
	var sb strings.Builder
	w := tabwriter.NewWriter(&sb, 0, 0, 2, ' ', 0)
	fmt.Fprintf(w, "events committed\t%d\n", nCommitted.Load())
	fmt.Fprintf(w, "leader timeout / lock TTL\t15s (default) / %s\n", lockTTL)
	fmt.Fprintf(w, "A stepped down after the cut\t%.1f s\n", steppedDown.Seconds())
	fmt.Fprintf(w, "server ended A's session (lock free) after the cut\t%.1f s\n", released.Seconds())
	fmt.Fprintf(w, "takeover: B's first publish after the cut\t%.1f s\n", takeover.Seconds())
	fmt.Fprintf(w, "A's last publish relative to the cut\t%.1f s\n", lastA.Sub(cut).Seconds())
	fmt.Fprintf(w, "link healed after the cut\t%.1f s\n", healed.Sub(cut).Seconds())
	fmt.Fprintf(w, "lost (committed, never received)\t%d\n", lost)
	fmt.Fprintf(w, "rows left unpublished\t%d\n", unpublished)
	fmt.Fprintf(w, "duplicates received\t%d (%.2f%%)\n", duplicates, 100*float64(duplicates)/float64(max(1, len(rows))))
	_ = w.Flush()
	t.Logf("partition summary:\n%s", sb.String())
	if f := os.Getenv("FAULT_PARTITION_SUMMARY_FILE"); f != "" {
		_ = os.WriteFile(f, []byte(sb.String()), 0o644)
	}
	const leaderTimeout = 15 * time.Second // OUTBOX_RELAY_LEADER_TIMEOUT's default
	if limit := leaderTimeout*7/6 + 10*time.Second; released <= 0 || released > limit {
		t.Errorf("the server ended A's session %s after the partition, want within %s (LeaderTimeout*7/6 and 10 s for a loaded machine)", released, limit)
	}
	if takeover <= 0 || takeover >= time.Minute {
		t.Errorf("takeover after the partition took %s, want under a minute", takeover)
	}
	if steppedDown == 0 {
		t.Errorf("relay A never logged stepping down; its log ends:\n%s", a.tail())
	}
	if lost != 0 || unpublished != 0 {
		t.Errorf("%d events lost, %d rows unpublished (relay logs in %s)", lost, unpublished, logDir)
	}
	if aLeadsAgain {
		t.Errorf("relay A holds the lock again after the link healed, although B was leading")
	}
}

// startRelayIn runs `outbox relay` in network namespace ns (`ip netns exec`
// execs the binary, so the pid is the relay's).
func startRelayIn(t *testing.T, ns, bin string, env []string, logPath string) *relayProc {
	t.Helper()
	f, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("ip", "netns", "exec", ns, bin, "relay")
	cmd.Env = env
	cmd.Stdout, cmd.Stderr = f, f
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &relayProc{cmd: cmd, done: make(chan error, 1), log: logPath}
	exited := make(chan struct{})
	go func() { p.done <- cmd.Wait(); _ = f.Close(); close(exited) }()
	t.Cleanup(func() {
		// A relay still running (the test failed early) must not keep its
		// namespace alive.
		_ = cmd.Process.Kill()
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
		}
	})
	return p
}

func waitUntil(t *testing.T, what string, timeout time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// partitionNet is this host's side of the test network: a service address
// on lo (where PostgreSQL and Kafka listen) and one namespace per relay,
// linked to the host by a veth pair and routed to the service address.
type partitionNet struct {
	svc    string // 10.231.K.1
	subnet string // 10.231.K.0/24
	links  []nsLink
}

type nsLink struct {
	ns, hostIf, nsIf, hostIP, nsIP string
}

// blackholeMAC is a locally administered address that no interface has:
// frames sent to it are dropped by the receiver without a word.
const blackholeMAC = "02:00:5e:00:de:ad"

func ipCmd(t *testing.T, args ...string) {
	t.Helper()
	out, err := exec.Command("ip", args...).CombinedOutput()
	if err != nil {
		t.Fatalf("ip %s: %v\n%s\n(TestFaultPartition needs root and network namespaces: run it as root on a host or a privileged container)", strings.Join(args, " "), err, out)
	}
}

func ipQuiet(args ...string) { _ = exec.Command("ip", args...).Run() }

func newPartitionNet(t *testing.T, k int) *partitionNet {
	t.Helper()
	n := &partitionNet{svc: fmt.Sprintf("10.231.%d.1", k), subnet: fmt.Sprintf("10.231.%d.0/24", k)}
	for i, name := range []string{"a", "b"} {
		n.links = append(n.links, nsLink{
			ns:     fmt.Sprintf("obx%d%s", k, name),
			hostIf: fmt.Sprintf("obx%d%sh", k, name),
			nsIf:   fmt.Sprintf("obx%d%sn", k, name),
			hostIP: fmt.Sprintf("10.231.%d.%d", k, 4*i+5),
			nsIP:   fmt.Sprintf("10.231.%d.%d", k, 4*i+6),
		})
	}
	cleanup := func() {
		for _, l := range n.links {
			ipQuiet("netns", "del", l.ns)
			ipQuiet("link", "del", l.hostIf)
		}
		ipQuiet("addr", "del", n.svc+"/32", "dev", "lo")
	}
	cleanup() // leftovers of a run that was killed
	t.Cleanup(cleanup)
	ipCmd(t, "addr", "add", n.svc+"/32", "dev", "lo")
	for _, l := range n.links {
		ipCmd(t, "netns", "add", l.ns)
		ipCmd(t, "link", "add", l.hostIf, "type", "veth", "peer", "name", l.nsIf)
		ipCmd(t, "link", "set", l.nsIf, "netns", l.ns)
		ipCmd(t, "addr", "add", l.hostIP+"/30", "dev", l.hostIf)
		ipCmd(t, "link", "set", l.hostIf, "up")
		ipCmd(t, "-n", l.ns, "link", "set", "lo", "up")
		ipCmd(t, "-n", l.ns, "addr", "add", l.nsIP+"/30", "dev", l.nsIf)
		ipCmd(t, "-n", l.ns, "link", "set", l.nsIf, "up")
		ipCmd(t, "-n", l.ns, "route", "add", "default", "via", l.hostIP)
	}
	return n
}

// cut makes link i silent both ways: each side resolves the other to a MAC
// address nobody has, so frames are dropped without an error or a reset.
func (n *partitionNet) cut(t *testing.T, i int) {
	t.Helper()
	l := n.links[i]
	ipCmd(t, "neigh", "replace", l.nsIP, "lladdr", blackholeMAC, "dev", l.hostIf, "nud", "permanent")
	ipCmd(t, "-n", l.ns, "neigh", "replace", l.hostIP, "lladdr", blackholeMAC, "dev", l.nsIf, "nud", "permanent")
}

// heal restores link i.
func (n *partitionNet) heal(t *testing.T, i int) {
	t.Helper()
	l := n.links[i]
	ipCmd(t, "neigh", "del", l.nsIP, "dev", l.hostIf)
	ipCmd(t, "-n", l.ns, "neigh", "del", l.hostIP, "dev", l.nsIf)
}
