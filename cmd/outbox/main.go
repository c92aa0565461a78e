// Command outbox is the relay daemon and runbook CLI of watermill-outbox.
//
//	outbox relay                 relay and clean the tables of OUTBOX_RELAY_TABLES
//	outbox migrate --table=T     create an outbox table (--print shows the SQL; --ordered for ordered mode)
//	outbox backlog --table=T     pending rows, oldest first
//	outbox dead list --table=T   dead rows (filters: --topic, --tenant, --error, --after)
//	outbox dead replay ...       replay one event (--event-id) or dead rows in bulk (--confirm)
//	outbox dead skip ...         ordered mode: drop a held row from its key's order (--event-id, --confirm)
//	outbox keys held --table=T   ordered and WAL modes: held ordering keys, each hold's state and allowed actions
//	outbox stats --table=T       pending, locked, dead, oldest pending age
//
// Configuration comes from the environment (outbox relay --help lists it); a bad value stops
// the command at start with the variable's name. Run `outbox help` for the
// list of commands.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sort"
	"syscall"
)

// command is one subcommand: run gets the arguments after the name.
type command struct {
	summary string
	run     func(ctx context.Context, env Env, args []string, stdout, stderr io.Writer) error
}

var commands = map[string]command{}

// registerCommand adds a subcommand; files of this package call it from init.
func registerCommand(name, summary string, run func(ctx context.Context, env Env, args []string, stdout, stderr io.Writer) error) {
	if _, dup := commands[name]; dup {
		panic("outbox: command registered twice: " + name)
	}
	commands[name] = command{summary: summary, run: run}
}

// errUsage marks an error whose message is a usage problem (exit code 2).
var errUsage = errors.New("usage")

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run executes one command line and returns the exit code.
func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		usage(stderr)
		return 2
	}
	if args[0] == "help" || args[0] == "-h" || args[0] == "--help" {
		usage(stdout)
		return 0
	}
	cmd, ok := commands[args[0]]
	if !ok {
		fmt.Fprintf(stderr, "outbox: unknown command %q\n\n", args[0])
		usage(stderr)
		return 2
	}
	env := Env{getenv: getenv}
	if err := cmd.run(ctx, env, args[1:], stdout, stderr); err != nil {
		var help *helpText
		if errors.As(err, &help) {
			fmt.Fprint(stdout, help.text)
			return 0
		}
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		fmt.Fprintf(stderr, "outbox %s: %v\n", args[0], err)
		if errors.Is(err, errUsage) {
			return 2
		}
		return 1
	}
	return 0
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "usage: outbox <command> [flags]\n\ncommands:")
	names := make([]string, 0, len(commands))
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(w, "  %-14s %s\n", n, commands[n].summary)
	}
	fmt.Fprintln(w, "\nConfiguration is read from OUTBOX_* environment variables; see `outbox relay --help` and docs/OPERATIONS.md.")
}
