package main

import (
	"context"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/google/uuid"

	"github.com/outboxkit/watermill-outbox/runbook"
)

func init() {
	registerCommand("keys", "list the ordering keys held back by a failing or dead row, with each hold's state and the actions it allows (keys held; ordered mode and the WAL relay)", runKeys)
}

func runKeys(ctx context.Context, env Env, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && isHelpArg(args[0]) {
		return helpFor("outbox keys held --table=T [--limit=N] [--resolved] [--json]",
			"  held     the ordering keys held back by a failing or dead row (ordered mode and the WAL relay), with each hold's state and the actions it allows\n\nRun `outbox keys held --help` for the flags.", nil)
	}
	if len(args) == 0 || args[0] != "held" {
		return fmt.Errorf("%w: keys needs the subcommand held: `outbox keys held --table=T` (see `outbox keys --help`)", errUsage)
	}
	f, err := newRunbookFlags("keys held", env, stderr)
	if err != nil {
		return err
	}
	limit := f.fs.Int("limit", runbook.DefaultLimit, "show at most this many held keys, oldest hold first")
	resolved := f.fs.Bool("resolved", false, "also list resolved holds (tombstones kept until the relay's progress passes them; they hold nothing)")
	t, err := f.parse(args[1:])
	if err != nil {
		return err
	}
	pool, err := openRunbookDB(ctx, env)
	if err != nil {
		return err
	}
	defer pool.Close()
	held, err := runbook.New(pool, t).ListHolds(ctx, runbook.HoldsFilter{Limit: *limit, Resolved: *resolved})
	if err != nil {
		return err
	}
	if f.json {
		if held == nil {
			held = []runbook.HeldKey{}
		}
		return writeJSON(stdout, held)
	}
	if len(held) == 0 {
		fmt.Fprintf(stdout, "No held key in %s.\n", t)
		return nil
	}
	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "ORDERING_KEY\tSEQUENCE\tEVENT_ID\tTOPIC\tSTATE\tACTIONS\tATTEMPTS\tLAST_ERROR")
	for _, h := range held {
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%s\t%d\t%s\n", cell(h.Key, 40), h.Sequence, h.EventID, cell(h.Topic, 0), h.State, holdActions(h), h.Attempts, lastError(h.LastError, 80))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(stdout, "ACTIONS are what the hold's state allows (docs/OPERATIONS.md, \"Hold states\"): replay the row with `outbox dead replay --event-id=E --confirm`, or drop it from its key's order with `outbox dead skip --event-id=E --confirm`.")
	return nil
}

// holdActions lists the actions h's state allows, "-" when none (or the
// row is gone from the table).
func holdActions(h runbook.HeldKey) string {
	var out []string
	if h.CanReplay() {
		out = append(out, runbook.OpReplay.String())
	}
	if h.CanSkip() {
		out = append(out, runbook.OpSkip.String())
	}
	if len(out) == 0 {
		return "-"
	}
	return strings.Join(out, ",")
}

// runDeadSkip is `outbox dead skip`: the row is set aside, in every mode
// (runbook.Runbook.SkipEvent): at once for a row that holds no key, by
// the relay that owns its key for a held row. A confirmed skip prints an
// audit line (operator and reason) on stderr.
func runDeadSkip(ctx context.Context, env Env, args []string, stdout, stderr io.Writer) error {
	f, err := newRunbookFlags("dead skip", env, stderr)
	if err != nil {
		return err
	}
	eventID := f.fs.String("event-id", "", "skip the row with this event_id (a UUID): a dead, failed or pending row, or the row a held key waits for (its key continues with its next row); it is never delivered unless replayed")
	reason := f.fs.String("reason", "", "why, for the audit line (one line)")
	operator := f.fs.String("operator", "", "who, for the audit line (defaults to OUTBOX_OPERATOR, else USER)")
	confirm := f.fs.Bool("confirm", false, "record the skip; without it the command only previews and exits 2")
	t, err := f.parse(args)
	if err != nil {
		return err
	}
	id, err := uuid.Parse(*eventID)
	if err != nil || id == uuid.Nil {
		return fmt.Errorf("%w: --event-id=%q is not an event_id (a non-nil UUID)", errUsage, *eventID)
	}
	if strings.ContainsAny(*reason, "\r\n") {
		return fmt.Errorf("%w: --reason must be one line", errUsage)
	}
	who := *operator
	if who == "" {
		who = env.String("OUTBOX_OPERATOR", env.String("USER", "unknown"))
	}
	pool, err := openRunbookDB(ctx, env)
	if err != nil {
		return err
	}
	defer pool.Close()
	res, err := runbook.New(pool, t).SkipEvent(ctx, id, !*confirm)
	if err != nil {
		return err
	}
	if *confirm {
		fmt.Fprintf(stderr, "audit: action=skip table=%s event_id=%s operator=%q reason=%q applied=%t\n", t, id, who, *reason, res.Applied)
	}
	if f.json {
		return writeJSON(stdout, res)
	}
	held := ""
	if !res.Applied && res.Key != "" {
		held = fmt.Sprintf(": key %q waits for it", res.Key)
	}
	if !*confirm {
		fmt.Fprintf(stdout, "Skip event %s of %s (sequence %d)%s.\n", id, t, res.Sequence, held)
		printStatement(stdout, res.Statement, 1)
		return fmt.Errorf("%w: nothing changed: this was a preview; add --confirm to skip event %s of %s", errUsage, id, t)
	}
	if res.Applied {
		fmt.Fprintf(stdout, "Skipped event %s of %s: the row stays in the table, marked skipped (skipped_at), not dead and never delivered unless replayed (`outbox dead replay --event-id=%s --confirm`).\n", id, t, id)
		return nil
	}
	fmt.Fprintf(stdout, "Skipped event %s of %s: key %q continues with its next row; the row stays in the table, marked skipped (skipped_at) once the relay applies the skip.\n", id, t, res.Key)
	return nil
}
