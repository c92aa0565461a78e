package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/outboxkit/watermill-outbox/runbook"
)

func init() {
	registerCommand("topics", "list the backlog of --table by topic with the paused topics (topics), pause or resume relaying one topic (topics pause|resume --topic=X)", runTopics)
}

func runTopics(ctx context.Context, env Env, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && isHelpArg(args[0]) {
		return helpFor("outbox topics [list] --table=T [--limit=N] [--json]\n   or: outbox topics pause --table=T --topic=X [--reason=TEXT] [--dry-run]\n   or: outbox topics resume --table=T --topic=X [--dry-run]",
			"  list     the backlog of the table by topic, with the paused topics (the default)\n  pause    stop relaying one topic; its rows wait\n  resume   relay a paused topic again\n\nRun `outbox topics list --help`, `outbox topics pause --help` or `outbox topics resume --help` for the flags.", nil)
	}
	sub := "list"
	if len(args) > 0 && len(args[0]) > 0 && args[0][0] != '-' {
		sub, args = args[0], args[1:]
	}
	switch sub {
	case "list":
		return runTopicsList(ctx, env, args, stdout, stderr)
	case "pause", "resume":
		return runTopicsPause(ctx, env, sub, args, stdout, stderr)
	}
	return fmt.Errorf("%w: unknown subcommand %q of topics; use list, pause or resume", errUsage, sub)
}

func runTopicsList(ctx context.Context, env Env, args []string, stdout, stderr io.Writer) error {
	f, err := newRunbookFlags("topics", env, stderr)
	if err != nil {
		return err
	}
	limit := f.fs.Int("limit", runbook.DefaultLimit, "show at most this many topics, the largest backlog first")
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
	rb := runbook.New(pool, t)
	topics, err := rb.Topics(ctx, *limit)
	if err != nil {
		return err
	}
	paused, err := rb.PausedTopics(ctx)
	if err != nil {
		return err
	}
	if f.json {
		if topics == nil {
			topics = []runbook.TopicBacklog{}
		}
		return writeJSON(stdout, topics)
	}
	if len(topics) == 0 {
		fmt.Fprintf(stdout, "No pending, dead or paused topic in %s.\n", t)
		return nil
	}
	since := map[string]runbook.PausedTopic{}
	for _, p := range paused {
		since[p.Topic] = p
	}
	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "TOPIC\tPENDING\tRETRYING\tDEAD\tOLDEST_PENDING\tPAUSED\tREASON")
	for _, b := range topics {
		state, reason := "-", "-"
		if b.Paused {
			state = "PAUSED"
			if p, ok := since[b.Topic]; ok {
				state = "PAUSED since " + formatTime(&p.PausedAt)
				if p.Reason != "" {
					reason = cell(p.Reason, 60)
				}
			}
		}
		oldest := "-"
		if b.Pending > 0 {
			oldest = (time.Duration(b.OldestPendingAgeSeconds * float64(time.Second))).Round(time.Second).String()
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%s\t%s\t%s\n", cell(b.Topic, 0), b.Pending, b.Retrying, b.Dead, oldest, state, reason)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(paused) > 0 {
		fmt.Fprintf(stdout, "%d topic(s) paused: their rows stay pending; resume one with `outbox topics resume --table=%s --topic=X`.\n", len(paused), t)
	}
	return nil
}

func runTopicsPause(ctx context.Context, env Env, op string, args []string, stdout, stderr io.Writer) error {
	f, err := newRunbookFlags("topics "+op, env, stderr)
	if err != nil {
		return err
	}
	topic := f.fs.String("topic", "", "the topic to "+op+" (the rows' topic column)")
	var reason *string
	if op == "pause" {
		reason = f.fs.String("reason", "", "why, for the other operators (one line, at most 200 bytes; shown by `outbox topics` and the console)")
	}
	dryRun := f.fs.Bool("dry-run", false, "check and show what would change, change nothing")
	t, err := f.parse(args)
	if err != nil {
		return err
	}
	if *topic == "" {
		return fmt.Errorf("%w: --topic is required, such as --topic=org.organization.created.v1 (list them with `outbox topics --table=%s`)", errUsage, t)
	}
	pool, err := openRunbookDB(ctx, env)
	if err != nil {
		return err
	}
	defer pool.Close()
	rb := runbook.New(pool, t)
	var res runbook.TopicPause
	if op == "pause" {
		res, err = rb.PauseTopic(ctx, *topic, *reason, *dryRun)
	} else {
		res, err = rb.ResumeTopic(ctx, *topic, *dryRun)
	}
	if errors.Is(err, runbook.ErrBadTopic) {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	if err != nil {
		return err
	}
	if f.json {
		return writeJSON(stdout, res)
	}
	switch {
	case res.DryRun:
		fmt.Fprintf(stdout, "Dry run: would %s topic %q of %s; nothing changed.\n", op, res.Topic, t)
		printStatement(stdout, res.Statement, 1)
	case op == "pause" && res.Changed == 0:
		fmt.Fprintf(stdout, "Topic %q of %s was paused already (since %s); nothing changed.\n", res.Topic, t, formatTime(res.PausedAt))
	case op == "pause":
		fmt.Fprintf(stdout, "Paused topic %q of %s: the relays stop taking its rows at their next wake-up (sent now); rows in flight finish. Resume with `outbox topics resume --table=%s --topic=%s`.\n",
			res.Topic, t, t, res.Topic)
	default:
		fmt.Fprintf(stdout, "Resumed topic %q of %s (paused since %s): the relays take its rows again at their next wake-up (sent now).\n", res.Topic, t, formatTime(res.PausedAt))
	}
	return nil
}
