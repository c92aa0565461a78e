package main

// The runbook commands (docs/OPERATIONS.md), thin wrappers around package runbook:
//
//	outbox backlog     --table=T [--topic=X] [--limit=N] [--json]
//	outbox stats       --table=T [--json]
//	outbox dead list   --table=T [--topic=X] [--tenant=U] [--error=S] [--after=SEQ] [--limit=N] [--json]
//	outbox dead replay --table=T --event-id=E [--dry-run] [--confirm]
//	outbox dead replay --table=T (--topic=X | --all) [--tenant=U] [--error=S] [--after=SEQ] [--limit=N]
//	                   [--dry-run] [--confirm] [--force]
//
// A replay first prints the statement it will run and the number of rows it
// affects, and changes nothing unless --confirm is given. A bulk replay also
// needs --force unless OUTBOX_ENVIRONMENT=development marks the database as
// a development one.

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
)

// Environment variable that marks the database of OUTBOX_DATABASE_URL as a
// development database, on which a bulk replay runs without --force.
const (
	environmentVar         = "OUTBOX_ENVIRONMENT"
	environmentDevelopment = "development"
)

func init() {
	registerCommand("backlog", "list the pending rows of --table, oldest first", runBacklog)
	registerCommand("dead", "list dead rows (dead list), replay them (dead replay, needs --confirm) or skip one (dead skip, needs --confirm)", runDead)
	registerCommand("stats", "show the pending, locked and dead counts and the oldest pending age of --table", runStats)
}

// runbookFlags are the flags every runbook command has.
type runbookFlags struct {
	fs    *flag.FlagSet
	table string
	json  bool
	// vars are the variables the command reads besides
	// OUTBOX_DATABASE_URL, for its help.
	vars []helpVar
}

func newRunbookFlags(name string, env Env, stderr io.Writer) (*runbookFlags, error) {
	f := &runbookFlags{fs: flag.NewFlagSet(name, flag.ContinueOnError)}
	f.fs.SetOutput(stderr)
	f.fs.StringVar(&f.table, "table", "", "outbox table, such as public.org_outbox (required)")
	f.fs.BoolVar(&f.json, "json", false, "print JSON for scripts instead of a table for people")
	return f, nil
}

// parse parses args and returns the table of --table.
func (f *runbookFlags) parse(args []string) (schema.Table, error) {
	if err := parseFlags(f.fs, args, "outbox "+f.fs.Name()+" --table=T [flags]", f.vars...); err != nil {
		return schema.Table{}, err
	}
	if f.fs.NArg() > 0 {
		return schema.Table{}, fmt.Errorf("%w: unexpected argument %q; every option is a flag, such as --table=public.org_outbox", errUsage, f.fs.Arg(0))
	}
	if f.table == "" {
		return schema.Table{}, fmt.Errorf("%w: --table is required, such as --table=public.org_outbox", errUsage)
	}
	t, err := schema.ParseTable(f.table)
	if err != nil {
		return schema.Table{}, fmt.Errorf("%w: --table: %w", errUsage, err)
	}
	return t, nil
}

// openRunbookDB connects to OUTBOX_DATABASE_URL.
func openRunbookDB(ctx context.Context, env Env) (*pgxpool.Pool, error) {
	url, err := env.Required("OUTBOX_DATABASE_URL", "postgres://user:password@host:5432/db")
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errUsage, err)
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("%w: OUTBOX_DATABASE_URL is not a valid PostgreSQL URL or DSN: %s", errUsage, parseProblem(err))
	}
	cfg.MaxConns = 2
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to OUTBOX_DATABASE_URL: %w", err)
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		if hint, ok := unhealable(err); ok {
			return nil, fmt.Errorf("connect to OUTBOX_DATABASE_URL: %s: %w", hint, err)
		}
		return nil, fmt.Errorf("connect to OUTBOX_DATABASE_URL (is the database up and the URL right?): %w", err)
	}
	return pool, nil
}

func runBacklog(ctx context.Context, env Env, args []string, stdout, stderr io.Writer) error {
	f, err := newRunbookFlags("backlog", env, stderr)
	if err != nil {
		return err
	}
	limit := f.fs.Int("limit", runbook.DefaultLimit, "maximum number of rows to list")
	topic := f.fs.String("topic", "", "list only the rows of this topic")
	t, err := f.parse(args)
	if err != nil {
		return err
	}
	if *limit < 1 {
		return fmt.Errorf("%w: --limit=%d must be at least 1", errUsage, *limit)
	}
	pool, err := openRunbookDB(ctx, env)
	if err != nil {
		return err
	}
	defer pool.Close()
	rows, err := runbook.New(pool, t).Backlog(ctx, runbook.BacklogOptions{Limit: *limit, Topic: *topic})
	if err != nil {
		return err
	}
	if f.json {
		return writeJSON(stdout, struct {
			Table string        `json:"table"`
			Rows  []runbook.Row `json:"rows"`
		}{t.String(), rows})
	}
	if len(rows) == 0 {
		fmt.Fprintf(stdout, "No pending rows in %s.\n", t)
		return nil
	}
	if err := writeRows(stdout, rows); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "\n%s of %s, oldest first (the relay's claim order).\n", plural(int64(len(rows)), "pending row"), t)
	if len(rows) == *limit {
		fmt.Fprintf(stdout, "More may exist: raise --limit (now %d), or see the totals with `outbox stats --table=%s`.\n", *limit, t)
	}
	return nil
}

func runStats(ctx context.Context, env Env, args []string, stdout, stderr io.Writer) error {
	f, err := newRunbookFlags("stats", env, stderr)
	if err != nil {
		return err
	}
	t, err := f.parse(args)
	if err != nil {
		return err
	}
	pool, err := openRunbookDB(ctx, env)
	if err != nil {
		return err
	}
	defer pool.Close()
	s, err := runbook.New(pool, t).Stats(ctx)
	if err != nil {
		return err
	}
	if f.json {
		return writeJSON(stdout, s)
	}
	oldest := "-"
	if s.OldestPendingCreatedAt != nil {
		oldest = fmt.Sprintf("%s (created %s)", s.OldestPendingAge().Round(time.Second), formatTime(s.OldestPendingCreatedAt))
	}
	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "table\t%s\n", t)
	inferred := ""
	if s.ModeInferred {
		inferred = " (inferred: none recorded; `outbox migrate --mode=` records it, as does a relay when it starts)"
	}
	fmt.Fprintf(tw, "mode\t%s\tdocs/OPERATIONS.md says what each number means in each mode%s\n", s.Mode, inferred)
	fmt.Fprintf(tw, "pending\t%d\tnot delivered, not dead (%d waiting behind a held key)\n", s.Pending, s.WaitingBehindHeldKeys)
	fmt.Fprintf(tw, "retrying\t%d\tpending, last attempt failed\n", s.Retrying)
	fmt.Fprintf(tw, "locked\t%d\tleased by a relay\n", s.Locked)
	fmt.Fprintf(tw, "dead\t%d\tsee `outbox dead list --table=%s`\n", s.Dead, t)
	if s.Mode != schema.ModeDefault {
		fmt.Fprintf(tw, "held keys\t%d\t%d by a dead row; see `outbox keys held --table=%s`\n", s.HeldKeys, s.DeadHeldKeys, t)
	}
	if s.Mode == schema.ModeWAL {
		fmt.Fprintf(tw, "streamed\t%d\tdelivered by the WAL relay (no published_at)\n", s.StreamedUnpublished)
	}
	if s.PausedTopics > 0 {
		fmt.Fprintf(tw, "paused topics\t%d\ttheir rows stay pending; see `outbox topics --table=%s`\n", s.PausedTopics, t)
	}
	fmt.Fprintf(tw, "oldest pending age\t%s\n", oldest)
	note := ""
	if !s.DeliveryTimesKnown {
		note = "\trows with published_at only: this mode records no delivery time for keyed (ordered) or streamed (WAL) rows"
	}
	fmt.Fprintf(tw, "published last hour\t%d%s\n", s.PublishedLastHour, note)
	return tw.Flush()
}

func runDead(ctx context.Context, env Env, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		return fmt.Errorf("%w: dead needs a subcommand: `outbox dead list --table=T`, `outbox dead replay --table=T ...` or `outbox dead skip --table=T --event-id=E`", errUsage)
	}
	switch args[0] {
	case "list":
		return runDeadList(ctx, env, args[1:], stdout, stderr)
	case "replay":
		return runDeadReplay(ctx, env, args[1:], stdout, stderr)
	case "skip":
		return runDeadSkip(ctx, env, args[1:], stdout, stderr)
	}
	if isHelpArg(args[0]) {
		return helpFor("outbox dead list --table=T [flags]\n   or: outbox dead replay --table=T (--event-id=E | --topic=X | --all) [flags]\n   or: outbox dead skip --table=T --event-id=E [--confirm]",
			"  list     list the dead rows of the table\n  replay   deliver dead rows again: one event (--event-id) or in bulk (--topic, --all); previews unless --confirm\n  skip     set a row aside: never delivered unless replayed; previews unless --confirm\n\nRun `outbox dead list --help`, `outbox dead replay --help` or `outbox dead skip --help` for the flags.", nil)
	}
	return fmt.Errorf("%w: unknown subcommand %q of dead; use list, replay or skip", errUsage, args[0])
}

// deadFilterFlags are the flags that select dead rows.
type deadFilterFlags struct {
	topic, tenant, errorText string
	after                    int64
	limit                    int
}

func (d *deadFilterFlags) register(fs *flag.FlagSet, defLimit int, limitHelp string) {
	fs.StringVar(&d.topic, "topic", "", "only rows of this topic")
	fs.StringVar(&d.tenant, "tenant", "", "only rows of this tenant_id (a UUID)")
	fs.StringVar(&d.errorText, "error", "", "only rows whose last_error contains this text (case-insensitive)")
	fs.Int64Var(&d.after, "after", 0, "only rows whose sequence is greater (the next page starts after the last sequence shown)")
	fs.IntVar(&d.limit, "limit", defLimit, limitHelp)
}

func (d *deadFilterFlags) filter(lockTTL time.Duration) (runbook.DeadFilter, error) {
	f := runbook.DeadFilter{Topic: d.topic, ErrorContains: d.errorText, AfterSequence: d.after, Limit: d.limit,
		LockTTL: lockTTL}
	if d.tenant != "" {
		id, err := uuid.Parse(d.tenant)
		if err != nil {
			return runbook.DeadFilter{}, fmt.Errorf("%w: --tenant=%q is not a UUID", errUsage, d.tenant)
		}
		f.TenantID = id
	}
	if d.after < 0 {
		return runbook.DeadFilter{}, fmt.Errorf("%w: --after=%d is negative; use 0 to start from the first row", errUsage, d.after)
	}
	return f, nil
}

func runDeadList(ctx context.Context, env Env, args []string, stdout, stderr io.Writer) error {
	f, err := newRunbookFlags("dead list", env, stderr)
	if err != nil {
		return err
	}
	var d deadFilterFlags
	d.register(f.fs, runbook.DefaultLimit, "maximum number of rows to list")
	t, err := f.parse(args)
	if err != nil {
		return err
	}
	if d.limit < 1 {
		return fmt.Errorf("%w: --limit=%d must be at least 1", errUsage, d.limit)
	}
	filter, err := d.filter(0)
	if err != nil {
		return err
	}
	pool, err := openRunbookDB(ctx, env)
	if err != nil {
		return err
	}
	defer pool.Close()
	rows, err := runbook.New(pool, t).Dead(ctx, filter)
	if err != nil {
		return err
	}
	var next int64
	if len(rows) == d.limit {
		next = rows[len(rows)-1].Sequence
	}
	// In ordered mode a dead keyed row lives in its key's hold, not in the
	// rows listed above: count them so that they are not missed.
	heldDead, err := deadHolds(ctx, pool, t)
	if err != nil {
		return err
	}
	if f.json {
		return writeJSON(stdout, struct {
			Table        string        `json:"table"`
			Rows         []runbook.Row `json:"rows"`
			NextAfter    int64         `json:"next_after,omitempty"`
			DeadHeldKeys int           `json:"dead_held_keys,omitempty"`
		}{t.String(), rows, next, heldDead})
	}
	if heldDead > 0 {
		defer fmt.Fprintf(stdout, "Keyed rows: %s held by a dead row (listed with the dead rows they hold; replay or skip them, see `outbox keys held --table=%s`).\n",
			plural(int64(heldDead), "key"), t)
	}
	if len(rows) == 0 {
		fmt.Fprintf(stdout, "No dead rows in %s match (%s).\n", t, describeFilter(filter, false))
		return nil
	}
	if err := writeRows(stdout, rows); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "\n%s of %s (%s).\n", plural(int64(len(rows)), "dead row"), t, describeFilter(filter, false))
	if next > 0 {
		fmt.Fprintf(stdout, "Next page: add --after=%d.\n", next)
	}
	fmt.Fprintf(stdout, "Replay one: outbox dead replay --table=%s --event-id=<event_id> --confirm\n", t)
	return nil
}

// replayReport is what dead replay prints with --json.
type replayReport struct {
	Table     string       `json:"table"`
	EventID   string       `json:"event_id,omitempty"`
	Filter    string       `json:"filter,omitempty"`
	Row       *runbook.Row `json:"row,omitempty"`
	Statement string       `json:"statement"`
	Args      []any        `json:"args"`
	Rows      int64        `json:"rows"`
	Changed   int64        `json:"changed"`
	DryRun    bool         `json:"dry_run"`
	Applied   bool         `json:"applied"`
	Refused   string       `json:"refused,omitempty"`
	// Expect is the --expect value that replays exactly the previewed rows.
	Expect string `json:"expect,omitempty"`
	// LeftAlone counts the matching dead rows a single replay refuses now
	// (ordered tables): the bulk replay leaves them alone.
	LeftAlone int64 `json:"left_alone,omitempty"`
}

func runDeadReplay(ctx context.Context, env Env, args []string, stdout, stderr io.Writer) error {
	f, err := newRunbookFlags("dead replay", env, stderr)
	if err != nil {
		return err
	}
	f.vars = []helpVar{
		{"OUTBOX_RELAY_LOCK_TTL", "(recorded)", "a lower bound on the relays' lease length: replay judges leases by the larger of it and the LockTTL the table's relays recorded at start (60s when none is)"},
		{environmentVar, "(none)", environmentDevelopment + ": a bulk replay needs no --force"},
	}
	// Unset: the relays' recorded LockTTL alone judges leases (runbook.ReplayOptions.LockTTL).
	lockTTL, err := env.Duration("OUTBOX_RELAY_LOCK_TTL", 0, false)
	if err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	var d deadFilterFlags
	d.register(f.fs, 0, "replay at most this many rows, oldest sequence first (default: every matching row)")
	eventID := f.fs.String("event-id", "", "replay the one row with this event_id (a UUID), if it is dead or failed")
	all := f.fs.Bool("all", false, "bulk replay dead rows of every topic (instead of --topic)")
	dryRun := f.fs.Bool("dry-run", false, "print what would change and exit 0 without changing anything")
	confirm := f.fs.Bool("confirm", false, "change the rows; without it the command only previews and exits 2")
	force := f.fs.Bool("force", false, "allow a bulk replay on a database not marked "+environmentVar+"="+environmentDevelopment)
	expect := f.fs.String("expect", "", "bulk replay only the rows of an earlier preview: the ROWS:MAX_SEQUENCE:DIGEST it printed; refused if the dead rows changed since")
	t, err := f.parse(args)
	if err != nil {
		return err
	}
	if *eventID != "" {
		var extra []string
		f.fs.Visit(func(fl *flag.Flag) {
			switch fl.Name {
			case "topic", "tenant", "error", "after", "limit", "all":
				extra = append(extra, "--"+fl.Name)
			}
		})
		if len(extra) > 0 {
			return fmt.Errorf("%w: --event-id replays one event; drop %s, which select rows for a bulk replay", errUsage, strings.Join(extra, ", "))
		}
		id, err := uuid.Parse(*eventID)
		if err != nil || id == uuid.Nil {
			return fmt.Errorf("%w: --event-id=%q is not an event_id (a non-nil UUID)", errUsage, *eventID)
		}
		return replayOne(ctx, env, t, id, runbook.ReplayOptions{LockTTL: lockTTL},
			replayMode{json: f.json, dryRun: *dryRun, confirm: *confirm}, stdout)
	}
	switch {
	case d.topic == "" && !*all:
		return fmt.Errorf("%w: name what to replay: --event-id=E for one event, --topic=X for the dead rows of a topic, or --all for the dead rows of every topic", errUsage)
	case d.topic != "" && *all:
		return fmt.Errorf("%w: --topic and --all exclude each other; keep one", errUsage)
	case d.limit < 0:
		return fmt.Errorf("%w: --limit=%d is negative; omit it to replay every matching row", errUsage, d.limit)
	}
	filter, err := d.filter(lockTTL)
	if err != nil {
		return err
	}
	filter.AllTopics = *all
	if *expect != "" {
		snap, err := parseSnapshot(*expect)
		if err != nil {
			return err
		}
		filter.Expect = &snap
	}
	development := strings.EqualFold(env.String(environmentVar, ""), environmentDevelopment)
	return replayBulk(ctx, env, t, filter, replayMode{json: f.json, dryRun: *dryRun, confirm: *confirm, force: *force, development: development}, stdout)
}

// formatSnapshot renders a preview's snapshot as the value of --expect.
func formatSnapshot(s runbook.ReplaySnapshot) string {
	return fmt.Sprintf("%d:%d:%s", s.Rows, s.MaxSequence, s.Digest)
}

func parseSnapshot(v string) (runbook.ReplaySnapshot, error) {
	parts := strings.Split(v, ":")
	bad := fmt.Errorf("%w: --expect=%q is not a preview's ROWS:MAX_SEQUENCE:DIGEST; copy it from the preview's output", errUsage, v)
	if len(parts) != 3 {
		return runbook.ReplaySnapshot{}, bad
	}
	rows, err1 := strconv.ParseInt(parts[0], 10, 64)
	maxSeq, err2 := strconv.ParseInt(parts[1], 10, 64)
	if err1 != nil || err2 != nil || rows < 0 || maxSeq < 0 {
		return runbook.ReplaySnapshot{}, bad
	}
	return runbook.ReplaySnapshot{Rows: rows, MaxSequence: maxSeq, Digest: parts[2]}, nil
}

type replayMode struct {
	json, dryRun, confirm, force, development bool
}

func replayOne(ctx context.Context, env Env, t schema.Table, id uuid.UUID, opts runbook.ReplayOptions, mode replayMode, stdout io.Writer) error {
	pool, err := openRunbookDB(ctx, env)
	if err != nil {
		return err
	}
	defer pool.Close()
	rb := runbook.New(pool, t)
	preview := opts
	preview.DryRun = true
	p, err := rb.ReplayEvent(ctx, id, preview)
	if err != nil {
		return err
	}
	rep := replayReport{Table: t.String(), EventID: id.String(), Row: &p.Row, Statement: p.Statement.SQL,
		Args: p.Statement.Args, Rows: 1, DryRun: mode.dryRun}
	if !mode.json {
		state := fmt.Sprintf("failed (%d attempts, retrying)", p.Row.Attempts)
		if p.Dead {
			state = fmt.Sprintf("dead (%d attempts, dead since %s)", p.Row.Attempts, formatTime(p.Row.DeadAt))
		}
		fmt.Fprintf(stdout, "Replay one event of %s\n", t)
		tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
		fmt.Fprintf(tw, "  event_id\t%s\n  sequence\t%d\n  topic\t%s\n  tenant_id\t%s\n  state\t%s\n  last_error\t%s\n",
			p.Row.EventID, p.Row.Sequence, cell(p.Row.Topic, 0), p.Row.TenantID, state, lastError(p.Row.LastError, 200))
		if err := tw.Flush(); err != nil {
			return err
		}
		printStatement(stdout, p.Statement, 1)
	}
	switch {
	case mode.dryRun:
		return finishPreview(stdout, mode, rep, "Dry run: nothing changed.")
	case !mode.confirm:
		rep.Refused = "not confirmed"
		if err := finishPreview(stdout, mode, rep, ""); err != nil {
			return err
		}
		return fmt.Errorf("%w: nothing changed: this was a preview; add --confirm to replay event %s of %s", errUsage, id, t)
	}
	res, err := rb.ReplayEvent(ctx, id, opts)
	if err != nil {
		return err
	}
	rep.Changed, rep.Applied = res.Changed, true
	if mode.json {
		return writeJSON(stdout, rep)
	}
	fmt.Fprintf(stdout, "Replayed %d row: event %s of %s is due now; the relay delivers it again.\n", res.Changed, id, t)
	return nil
}

func replayBulk(ctx context.Context, env Env, t schema.Table, filter runbook.DeadFilter, mode replayMode, stdout io.Writer) error {
	pool, err := openRunbookDB(ctx, env)
	if err != nil {
		return err
	}
	defer pool.Close()
	rb := runbook.New(pool, t)
	expect := filter.Expect
	filter.Expect = nil
	p, err := rb.ReplayDead(ctx, filter, true)
	if err != nil {
		return err
	}
	judged := filter
	judged.LockTTL = p.LockTTL // the lease length the preview judged by
	desc := describeFilter(judged, true)
	rep := replayReport{Table: t.String(), Filter: desc, Statement: p.Statement.SQL, Args: p.Statement.Args,
		Rows: p.Rows, DryRun: mode.dryRun, Expect: formatSnapshot(p.Snapshot), LeftAlone: p.LeftAlone}
	if !mode.json {
		fmt.Fprintf(stdout, "Replay dead rows of %s\n  filter  %s\n", t, desc)
		printStatement(stdout, p.Statement, p.Rows)
		if p.LeftAlone > 0 {
			fmt.Fprintf(stdout, "Left alone: %s matching the filter, which a single replay refuses now (`outbox dead replay --event-id=E --dry-run` says why).\n",
				plural(p.LeftAlone, "dead row"))
		}
		fmt.Fprintf(stdout, "Snapshot: --expect=%s replays exactly these rows, or nothing if they change.\n", rep.Expect)
	}
	// The rows to replay: the earlier preview's named by --expect (the rows
	// that died after it are left for the next replay; the replay itself
	// refuses if the previewed ones changed), else the preview just made.
	snap := p.Snapshot
	if expect != nil {
		snap = *expect
		rep.Rows, rep.Expect = snap.Rows, formatSnapshot(snap)
		if !mode.json {
			fmt.Fprintf(stdout, "Expected: --expect=%s holds the replay to the %s of that preview, up to sequence %d; rows that died since are left for the next replay.\n",
				rep.Expect, plural(snap.Rows, "row"), snap.MaxSequence)
		}
	}
	if snap.Rows == 0 {
		return finishPreview(stdout, mode, rep, "Nothing to replay: no dead row matches.")
	}
	if mode.dryRun {
		return finishPreview(stdout, mode, rep, "Dry run: nothing changed.")
	}
	var missing []string
	if !mode.confirm {
		missing = append(missing, fmt.Sprintf("add --confirm to replay %s of %s", plural(snap.Rows, "row"), t))
	}
	if !mode.development && !mode.force {
		missing = append(missing, fmt.Sprintf("this database is not marked as development (%s is not %q), so a bulk replay also needs --force",
			environmentVar, environmentDevelopment))
	}
	if len(missing) > 0 {
		rep.Refused = strings.Join(missing, "; ")
		if err := finishPreview(stdout, mode, rep, ""); err != nil {
			return err
		}
		return fmt.Errorf("%w: nothing changed: %s", errUsage, rep.Refused)
	}
	// Exactly the previewed rows, or none.
	filter.Expect = &snap
	res, err := rb.ReplayDead(ctx, filter, false)
	if err != nil {
		return err
	}
	rep.Changed, rep.Applied = res.Rows, true
	if mode.json {
		return writeJSON(stdout, rep)
	}
	fmt.Fprintf(stdout, "Replayed %s of %s, exactly those previewed; they are due now and the relay delivers them again.\n", plural(res.Rows, "row"), t)
	return nil
}

// finishPreview ends a replay that changes nothing: the JSON report, or the
// closing line for people.
func finishPreview(stdout io.Writer, mode replayMode, rep replayReport, line string) error {
	if mode.json {
		return writeJSON(stdout, rep)
	}
	if line != "" {
		fmt.Fprintln(stdout, line)
	}
	return nil
}

func printStatement(w io.Writer, st runbook.Statement, rows int64) {
	fmt.Fprintln(w, "Statement:")
	for _, line := range strings.Split(st.String(), "\n") {
		fmt.Fprintf(w, "  %s\n", line)
	}
	fmt.Fprintf(w, "Rows it changes: %d\n", rows)
}

// deadHolds counts the ordering keys held by a dead row (0 for a table
// without ordered mode), up to heldDeadScan.
func deadHolds(ctx context.Context, pool *pgxpool.Pool, t schema.Table) (int, error) {
	held, err := runbook.New(pool, t).HeldKeys(ctx, heldDeadScan)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, h := range held {
		if h.DeadAt != nil {
			n++
		}
	}
	return n, nil
}

// heldDeadScan bounds the held keys dead list looks at.
const heldDeadScan = 10000

// describeFilter renders a dead filter for people.
func describeFilter(f runbook.DeadFilter, replay bool) string {
	var parts []string
	switch {
	case f.Topic != "":
		parts = append(parts, "topic = "+strconv.Quote(f.Topic))
	case f.AllTopics:
		parts = append(parts, "every topic (--all)")
	}
	if f.TenantID != uuid.Nil {
		parts = append(parts, "tenant_id = "+f.TenantID.String())
	}
	if f.ErrorContains != "" {
		parts = append(parts, "last_error contains "+strconv.Quote(f.ErrorContains))
	}
	if f.AfterSequence > 0 {
		parts = append(parts, "sequence > "+strconv.FormatInt(f.AfterSequence, 10))
	}
	if replay && f.Limit > 0 {
		parts = append(parts, "at most "+strconv.Itoa(f.Limit)+" rows")
	}
	parts = append(parts, "dead_at set")
	if replay {
		parts = append(parts, "skipping rows leased in the last "+f.LockTTL.String())
	}
	return strings.Join(parts, ", ")
}

// plural renders "1 row" or "3 rows".
func plural(n int64, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return strconv.FormatInt(n, 10) + " " + noun + "s"
}

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return fmt.Errorf("write JSON: %w", err)
	}
	return nil
}

func writeRows(w io.Writer, rows []runbook.Row) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "SEQUENCE\tEVENT_ID\tTOPIC\tTENANT_ID\tATTEMPTS\tCREATED_AT\tAVAILABLE_AT\tLOCKED_AT\tDEAD_AT\tLAST_ERROR")
	for _, r := range rows {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%s\t%s\t%s\t%s\t%s\n", r.Sequence, r.EventID, cell(r.Topic, 0), r.TenantID, r.Attempts,
			formatTime(&r.CreatedAt), formatTime(r.AvailableAt), formatTime(r.LockedAt), formatTime(r.DeadAt), lastError(r.LastError, 120))
	}
	if err := tw.Flush(); err != nil {
		return fmt.Errorf("write table: %w", err)
	}
	return nil
}

func formatTime(t *time.Time) string {
	if t == nil {
		return "-"
	}
	return t.UTC().Format(time.RFC3339)
}

func lastError(s *string, maxRunes int) string {
	if s == nil {
		return "-"
	}
	return cell(*s, maxRunes)
}

// cell makes s fit one table cell: control characters become spaces and,
// when maxRunes > 0, its middle is cut so that it has maxRunes runes.
func cell(s string, maxRunes int) string {
	s = strings.Map(func(r rune) rune {
		if unicode.IsControl(r) {
			return ' '
		}
		return r
	}, s)
	if r := []rune(s); maxRunes > 0 && len(r) > maxRunes {
		// Keep the head (what failed) and the tail (the cause, which wrapped
		// errors put last), and cut the middle.
		head := (maxRunes - 5) / 3
		return string(r[:head]) + " ... " + string(r[len(r)-(maxRunes-5-head):])
	}
	return s
}
