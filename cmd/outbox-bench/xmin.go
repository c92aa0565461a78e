package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
	"github.com/outboxkit/watermill-outbox/walrelay"
)

// xminOptions are the flags of the xmin suite (issue 36).
type xminOptions struct {
	rate           int
	phase, hold    time.Duration
	modes          string
	handlers       int
	handlerTime    time.Duration
	readers        int
	readerSnapshot time.Duration
	vacuumEvery    time.Duration
	keys           int
	drain          time.Duration
}

func (o *xminOptions) register() {
	flag.IntVar(&o.rate, "xmin-rate", 400, "xmin suite: offered events/s (one event per transaction); the load phase offers 1.5x")
	flag.DurationVar(&o.phase, "xmin-phase", 30*time.Second, "xmin suite: length of the clean, readers, load and recovery phases")
	flag.DurationVar(&o.hold, "xmin-hold", 45*time.Second, "xmin suite: how long a session holds an xid open (idle in transaction) in the pinned phase")
	flag.StringVar(&o.modes, "xmin-modes", "unbounded,default,ordered,wal", "xmin suite: modes to run, in order (default, ordered, wal; wal needs wal_level = logical, else it is skipped with a note; unbounded: the default mode with DisableBoundedClaim, the claim of earlier versions, as the baseline)")
	flag.IntVar(&o.handlers, "xmin-handlers", 32, "xmin suite: concurrent handlers")
	flag.DurationVar(&o.handlerTime, "xmin-handler-time", time.Millisecond, "xmin suite: how long each handler works on a message")
	flag.IntVar(&o.readers, "xmin-readers", 4, "xmin suite: REPEATABLE READ readers scanning the table in the readers phase")
	flag.DurationVar(&o.readerSnapshot, "xmin-reader-snapshot", 5*time.Second, "xmin suite: how long a reader keeps one snapshot (it scans the table again and again inside it)")
	flag.DurationVar(&o.vacuumEvery, "xmin-vacuum", 10*time.Second, "xmin suite: when the server's autovacuum is off, VACUUM the mode's tables this often in its stead (0: never)")
	flag.IntVar(&o.keys, "xmin-keys", 1000, "xmin suite: ordering keys of the ordered and WAL modes' rows")
	flag.DurationVar(&o.drain, "xmin-drain", 60*time.Second, "xmin suite: how long to wait after the last phase for the events still undelivered")
}

// xminPhase is one phase of the suite: what runs beside the offered load.
type xminPhase struct {
	name string
	d    time.Duration
	load float64 // times the offered rate
	// side starts what the phase adds (a pinned xid, readers) and returns
	// its stop.
	side func(ctx context.Context) (func(), error)
}

// xminEvent is one offered event: when it committed and when a handler got
// it (zero until then).
type xminEvent struct {
	phase     int
	committed time.Time
	commitDur time.Duration // how long COMMIT took: the part of the latency no relay can remove
	delivered atomic.Int64  // unix nanoseconds
}

// xminPhaseResult is what one phase of one mode measured.
type xminPhaseResult struct {
	name                 string
	d                    time.Duration
	offered, committed   int
	completed            int64 // handler completions during the phase
	behindEnd            int64 // committed and not yet completed, at the phase's end
	delivered, late      int   // of the phase's events: delivered in the end; delivered after the phase ended
	undelivered          int
	p50, p95, p99, pmax  time.Duration
	commitP95, commitP99 time.Duration // the producers' COMMIT alone
	maxDead, deadEnd     int64
	sizeEnd              int64
	oldestXminAge        int64 // the server's oldest backend xmin age, max over the phase
}

// xminSuite runs the pinned-xmin scenarios of issue 36 against each relay
// mode in one run: clean; a session holding an xid for -xmin-hold while the
// offered rate continues; REPEATABLE READ readers scanning the table; 1.5x
// load; recovery. Each mode relays its own table; per phase it prints the
// commit-to-delivery percentiles, completions against the offered rate, the
// dead tuples and the size of the mode's tables.
func xminSuite(ctx context.Context, _ *pgxpool.Pool, schemaName string, o options) error {
	xo := o.xmin
	pool, err := newPool(ctx, o, int32(xo.readers+xo.handlers/4+24), nil)
	if err != nil {
		return err
	}
	defer pool.Close()
	var level, autovacuum string
	if err := pool.QueryRow(ctx, `SELECT current_setting('wal_level'), current_setting('autovacuum')`).Scan(&level, &autovacuum); err != nil {
		return err
	}
	vacuumEvery := time.Duration(0)
	if autovacuum != "on" {
		vacuumEvery = xo.vacuumEvery
	}
	fmt.Printf("xmin suite (issue 36): %s\n", strings.Join(os.Args, " "))
	fmt.Printf("  machine: %d cores (GOMAXPROCS %d), load average at start %s; PostgreSQL %s, wal_level=%s, autovacuum=%s",
		runtime.NumCPU(), runtime.GOMAXPROCS(0), loadAverage(), serverVersion(ctx, pool), level, autovacuum)
	if vacuumEvery > 0 {
		fmt.Printf(" (the suite runs VACUUM on the mode's tables every %s in its stead)", vacuumEvery)
	}
	fmt.Println()
	fmt.Printf("  offered %d events/s, one per transaction (1.5x in the load phase); %d handlers of %s; phases %s, pinned xid %s, %d REPEATABLE READ readers with %s snapshots\n",
		xo.rate, xo.handlers, xo.handlerTime, xo.phase, xo.hold, xo.readers, xo.readerSnapshot)
	fmt.Println("  COMMIT p95/p99: the producers' COMMIT alone (its WAL flush), part of every event's latency whatever the relay does")
	fmt.Println("  latency: from just before COMMIT to a handler receiving the event; completed/s: handlers done during the phase; behind: committed and not completed at the phase's end")
	fmt.Println("  dead tuples and size: the mode's table and its companion tables (pg_stat_user_tables.n_dead_tup, pg_total_relation_size); max dead: sampled every second")
	fmt.Println("  goal (issue 36): every mode, every phase: completions keep the offered rate, p95 < 10 ms, p99 < 20 ms")
	fmt.Println()

	var modes []string
	for _, m := range strings.Split(xo.modes, ",") {
		m = strings.TrimSpace(m)
		switch m {
		case "default", "ordered", "unbounded":
		case "wal":
			if level != "logical" {
				fmt.Printf("xmin: WAL relay skipped: wal_level = %s; run it on a private logical server: BENCH_WAL_AUTOVACUUM=on scripts/bench-wal.sh -suite xmin\n\n", level)
				continue
			}
		case "":
			continue
		default:
			return fmt.Errorf("-xmin-modes: unknown mode %q (default, unbounded, ordered, wal)", m)
		}
		modes = append(modes, m)
	}
	results := map[string][]xminPhaseResult{}
	for _, mode := range modes {
		r, err := xminMode(ctx, pool, schemaName, xo, mode, vacuumEvery)
		if err != nil {
			return fmt.Errorf("%s mode: %w", mode, err)
		}
		results[mode] = r
		printXminMode(mode, r)
	}
	if len(modes) > 1 {
		printXminSummary(modes, results)
	}
	fmt.Printf("  load average at end %s (2 shared cores: producers, relay, handlers, readers and PostgreSQL compete; compare rows of one run)\n\n", loadAverage())
	return nil
}

func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], " ")
}

// xminRelay is one mode's relay: a message channel and its stop.
type xminRelay struct {
	ch    <-chan *message.Message
	close func()
}

// xminMode runs every phase against one mode and returns its results.
func xminMode(ctx context.Context, pool *pgxpool.Pool, schemaName string, xo xminOptions, mode string, vacuumEvery time.Duration) ([]xminPhaseResult, error) {
	t := schema.MustParseTable(schemaName + ".xmin_" + mode)
	keyed := mode == "ordered" || mode == "wal"
	var opts []schema.MigrateOption
	if keyed {
		opts = append(opts, schema.WithOrderingKeyColumn())
	}
	if err := schema.Migrate(ctx, pool, t, opts...); err != nil {
		return nil, err
	}
	relations := []string{t.Sanitize(), t.PartitionsTable(), t.RelaysTable(), t.HoldsTable(), t.WALProgressTable()}
	enq, err := publisher.NewEnqueuer(publisher.EnqueuerConfig{DisableNotify: mode == "wal"})
	if err != nil {
		return nil, err
	}
	relayCtx, stopRelay := context.WithCancel(ctx)
	defer stopRelay()
	var relay xminRelay
	switch mode {
	case "wal":
		if _, err := walrelay.Setup(ctx, pool, t, walrelay.Names{}); err != nil {
			return nil, err
		}
		defer func() { _ = walrelay.Teardown(context.Background(), pool, t, walrelay.Names{}) }()
		s, err := walrelay.New(ctx, pool, walrelay.Config{Table: t, StatusInterval: 100 * time.Millisecond}, watermill.NopLogger{})
		if err != nil {
			return nil, err
		}
		ch, err := s.Subscribe(relayCtx, subscriber.AllTopics)
		if err != nil {
			_ = s.Close()
			return nil, err
		}
		relay = xminRelay{ch, func() { _ = s.Close() }}
	default:
		// unbounded: the default mode with the claim of the versions before
		// the bounded claim (docs/XMIN.md), the baseline.
		s, err := subscriber.New(ctx, pool, subscriber.Config{Table: t, Ordered: mode == "ordered", DisableBoundedClaim: mode == "unbounded"}, watermill.NopLogger{})
		if err != nil {
			return nil, err
		}
		ch, err := s.Subscribe(relayCtx, subscriber.AllTopics)
		if err != nil {
			_ = s.Close()
			return nil, err
		}
		relay = xminRelay{ch, func() { _ = s.Close() }}
	}

	// The events, by id; the handlers.
	var (
		events    sync.Map // event_id -> *xminEvent
		completed atomic.Int64
		committed atomic.Int64
		handlers  sync.WaitGroup
	)
	for range xo.handlers {
		handlers.Add(1)
		go func() {
			defer handlers.Done()
			for m := range relay.ch {
				now := time.Now().UnixNano()
				if v, ok := events.Load(m.UUID); ok {
					v.(*xminEvent).delivered.CompareAndSwap(0, now)
				}
				time.Sleep(xo.handlerTime)
				m.Ack()
				completed.Add(1)
			}
		}()
	}
	defer func() {
		stopRelay()
		relay.close()
		handlers.Wait()
	}()
	time.Sleep(time.Second) // leadership, partitions or the replication session taken

	// Samplers: dead tuples every second, VACUUM in autovacuum's stead.
	var (
		sampleMu sync.Mutex
		maxDead  int64
		maxAge   int64
	)
	sampleCtx, stopSampling := context.WithCancel(ctx)
	defer stopSampling()
	var samplers sync.WaitGroup
	samplers.Add(1)
	go func() {
		defer samplers.Done()
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		for {
			select {
			case <-sampleCtx.Done():
				return
			case <-tick.C:
			}
			dead, _, err := xminTableStats(sampleCtx, pool, relations)
			age := xminOldestAge(sampleCtx, pool)
			if err == nil {
				sampleMu.Lock()
				maxDead, maxAge = max(maxDead, dead), max(maxAge, age)
				sampleMu.Unlock()
			}
		}
	}()
	if vacuumEvery > 0 {
		samplers.Add(1)
		go func() {
			defer samplers.Done()
			tick := time.NewTicker(vacuumEvery)
			defer tick.Stop()
			for {
				select {
				case <-sampleCtx.Done():
					return
				case <-tick.C:
				}
				for _, r := range relations {
					var exists bool
					if err := pool.QueryRow(sampleCtx, `SELECT to_regclass($1) IS NOT NULL`, r).Scan(&exists); err != nil || !exists {
						continue
					}
					_, _ = pool.Exec(sampleCtx, `VACUUM `+r)
				}
			}
		}()
	}
	defer func() { stopSampling(); samplers.Wait() }()

	pin := func(ctx context.Context) (func(), error) {
		tx, err := pool.BeginTx(ctx, pgx.TxOptions{})
		if err != nil {
			return nil, err
		}
		var xid int64
		if err := tx.QueryRow(ctx, `SELECT txid_current()`).Scan(&xid); err != nil {
			_ = tx.Rollback(ctx)
			return nil, err
		}
		return func() { _ = tx.Rollback(context.Background()) }, nil
	}
	readers := func(ctx context.Context) (func(), error) {
		rctx, cancel := context.WithCancel(ctx)
		var wg sync.WaitGroup
		for i := range xo.readers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				// Staggered, so that some snapshot is always old.
				select {
				case <-time.After(time.Duration(i) * xo.readerSnapshot / time.Duration(max(1, xo.readers))):
				case <-rctx.Done():
					return
				}
				for rctx.Err() == nil {
					_ = pgx.BeginTxFunc(rctx, pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
						end := time.Now().Add(xo.readerSnapshot)
						for time.Now().Before(end) {
							var n, s int64
							if err := tx.QueryRow(rctx, `SELECT count(*), COALESCE(sum(length(payload::text)), 0) FROM `+t.Sanitize()).Scan(&n, &s); err != nil {
								return err
							}
							select {
							case <-time.After(200 * time.Millisecond):
							case <-rctx.Done():
								return rctx.Err()
							}
						}
						return nil
					})
				}
			}()
		}
		return func() { cancel(); wg.Wait() }, nil
	}
	phases := []xminPhase{
		{name: "clean", d: xo.phase, load: 1},
		{name: fmt.Sprintf("pinned xid %s", xo.hold), d: xo.hold, load: 1, side: pin},
		{name: fmt.Sprintf("%d RR readers", xo.readers), d: xo.phase, load: 1, side: readers},
		{name: "1.5x load", d: xo.phase, load: 1.5},
		{name: "recovery", d: xo.phase, load: 1},
	}
	tenant := uuid.New()
	var seq atomic.Int64
	results := make([]xminPhaseResult, len(phases))
	phaseEnds := make([]time.Time, len(phases))
	for i, ph := range phases {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		stopSide := func() {}
		if ph.side != nil {
			if stopSide, err = ph.side(ctx); err != nil {
				return nil, fmt.Errorf("phase %s: %w", ph.name, err)
			}
		}
		sampleMu.Lock()
		maxDead, maxAge = 0, 0
		sampleMu.Unlock()
		rate := int(float64(xo.rate) * ph.load)
		done0 := completed.Load()
		phaseStart := time.Now()
		n := 0
		var nmu sync.Mutex
		offerSteadyN(ctx, rate, ph.d, max(4, rate/100), func() (string, time.Time, error) {
			id := uuid.New()
			k := int(seq.Add(1))
			msg := publisher.Message{TenantID: tenant, Topic: "org.organization.updated.v1", EventID: id, Payload: benchPayload}
			if keyed {
				msg.OrderingKey = "org-" + strconv.Itoa(k%xo.keys)
			}
			tx, err := pool.Begin(ctx)
			if err != nil {
				return "", time.Time{}, err
			}
			if _, err := enq.Enqueue(ctx, tx, t, msg); err != nil {
				_ = tx.Rollback(ctx)
				return "", time.Time{}, err
			}
			ev := &xminEvent{phase: i}
			events.Store(id.String(), ev)
			ev.committed = time.Now()
			if err := tx.Commit(ctx); err != nil {
				events.Delete(id.String())
				return "", time.Time{}, err
			}
			ev.commitDur = time.Since(ev.committed)
			committed.Add(1)
			nmu.Lock()
			n++
			nmu.Unlock()
			return id.String(), ev.committed, nil
		})
		elapsed := time.Since(phaseStart)
		phaseEnds[i] = time.Now()
		stopSide()
		dead, size, err := xminTableStats(ctx, pool, relations)
		if err != nil {
			return nil, err
		}
		sampleMu.Lock()
		results[i] = xminPhaseResult{name: ph.name, d: elapsed, offered: int(float64(rate) * ph.d.Seconds()), committed: n,
			completed: completed.Load() - done0, behindEnd: committed.Load() - completed.Load(),
			maxDead: max(maxDead, dead), deadEnd: dead, sizeEnd: size, oldestXminAge: maxAge}
		sampleMu.Unlock()
	}
	// Wait for the stragglers, then compute each phase's latencies.
	deadline := time.Now().Add(xo.drain)
	for completed.Load() < committed.Load() && time.Now().Before(deadline) && ctx.Err() == nil {
		time.Sleep(50 * time.Millisecond)
	}
	lat := make([][]time.Duration, len(phases))
	commits := make([][]time.Duration, len(phases))
	events.Range(func(_, v any) bool {
		ev := v.(*xminEvent)
		r := &results[ev.phase]
		commits[ev.phase] = append(commits[ev.phase], ev.commitDur)
		at := ev.delivered.Load()
		if at == 0 {
			r.undelivered++
			return true
		}
		r.delivered++
		if time.Unix(0, at).After(phaseEnds[ev.phase]) {
			r.late++
		}
		lat[ev.phase] = append(lat[ev.phase], time.Unix(0, at).Sub(ev.committed))
		return true
	})
	for i := range results {
		l := lat[i]
		sortDurations(l)
		results[i].p50, results[i].p95, results[i].p99 = percentile(l, 50), percentile(l, 95), percentile(l, 99)
		sortDurations(commits[i])
		results[i].commitP95, results[i].commitP99 = percentile(commits[i], 95), percentile(commits[i], 99)
		if len(l) > 0 {
			results[i].pmax = l[len(l)-1]
		}
	}
	return results, nil
}

// xminTableStats sums the dead tuples and total size of relations (those
// that exist).
func xminTableStats(ctx context.Context, pool *pgxpool.Pool, relations []string) (dead, size int64, err error) {
	err = pool.QueryRow(ctx, `SELECT COALESCE(sum(s.n_dead_tup), 0)::bigint, COALESCE(sum(pg_total_relation_size(c.oid)), 0)::bigint
FROM unnest($1::text[]) AS r(name) JOIN pg_class AS c ON c.oid = to_regclass(r.name)
LEFT JOIN pg_stat_user_tables AS s ON s.relid = c.oid`, relations).Scan(&dead, &size)
	return dead, size, err
}

// xminOldestAge is the age in transactions of the oldest xmin or xid a
// backend holds: how far the horizon is pinned.
func xminOldestAge(ctx context.Context, pool *pgxpool.Pool) int64 {
	var age int64
	_ = pool.QueryRow(ctx, `SELECT COALESCE(max(GREATEST(age(backend_xmin), age(backend_xid))), 0)::bigint FROM pg_stat_activity`).Scan(&age)
	return age
}

func sortDurations(d []time.Duration) { sort.Slice(d, func(i, j int) bool { return d[i] < d[j] }) }

func printXminMode(mode string, rs []xminPhaseResult) {
	fmt.Printf("xmin: %s mode\n", mode)
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "phase\tlength\toffered/s\tcommitted/s\tcompleted/s\tbehind at end\tp50 ms\tp95 ms\tp99 ms\tmax ms\tCOMMIT p95/p99 ms\tp95 vs clean\tlate\tundelivered\tmax dead tup\tdead tup at end\tsize at end\tmax xmin age\t")
	for _, r := range rs {
		sec := r.d.Seconds()
		cmp := "baseline"
		if r.name != rs[0].name && rs[0].p95 > 0 {
			cmp = fmt.Sprintf("%.1fx", float64(r.p95)/float64(rs[0].p95))
		}
		fmt.Fprintf(w, "%s\t%s\t%.0f\t%.0f\t%.0f\t%d\t%.2f\t%.2f\t%.2f\t%.1f\t%.2f / %.2f\t%s\t%d\t%d\t%d\t%d\t%s\t%d\t\n",
			r.name, r.d.Round(time.Second), float64(r.offered)/sec, float64(r.committed)/sec, float64(r.completed)/sec, r.behindEnd,
			ms(r.p50), ms(r.p95), ms(r.p99), ms(r.pmax), ms(r.commitP95), ms(r.commitP99), cmp, r.late, r.undelivered, r.maxDead, r.deadEnd, mib(r.sizeEnd), r.oldestXminAge)
	}
	_ = w.Flush()
	fmt.Println()
}

func printXminSummary(modes []string, res map[string][]xminPhaseResult) {
	fmt.Println("xmin: p95 / p99 by phase and mode, ms; ratios: a mode's p95 over the default mode's, measured in this run")
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprint(w, "phase\t")
	for _, m := range modes {
		fmt.Fprintf(w, "%s p95\t%s p99\t", m, m)
	}
	for _, m := range modes {
		if m != "default" && res["default"] != nil {
			fmt.Fprintf(w, "%s vs default\t", m)
		}
	}
	fmt.Fprintln(w)
	first := res[modes[0]]
	for i := range first {
		fmt.Fprintf(w, "%s\t", first[i].name)
		for _, m := range modes {
			fmt.Fprintf(w, "%.2f\t%.2f\t", ms(res[m][i].p95), ms(res[m][i].p99))
		}
		for _, m := range modes {
			if d := res["default"]; m != "default" && d != nil {
				if d[i].p95 > 0 {
					fmt.Fprintf(w, "%.2fx\t", float64(res[m][i].p95)/float64(d[i].p95))
				} else {
					fmt.Fprint(w, "-\t")
				}
			}
		}
		fmt.Fprintln(w)
	}
	_ = w.Flush()
	fmt.Println()
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func mib(b int64) string { return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20)) }
