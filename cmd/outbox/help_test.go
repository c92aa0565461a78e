package main

import (
	"regexp"
	"sort"
	"testing"
)

// subcommands are the commands whose first argument names a subcommand.
var subcommands = map[string][]string{
	"dead":   {"list", "replay", "skip"},
	"keys":   {"held"},
	"topics": {"list", "pause", "resume"},
}

// TestEveryHelpNamesTheDatabaseURL: `outbox <command> --help` (and -h),
// for every registered command and every subcommand, prints help on stdout,
// exits 0 without a database, and names OUTBOX_DATABASE_URL; the help of a
// command with subcommands lists each of them (`outbox dead --help` lists
// skip, `outbox keys --help` is help, not an error).
func TestEveryHelpNamesTheDatabaseURL(t *testing.T) {
	t.Parallel()
	names := make([]string, 0, len(commands))
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	if len(names) < 8 {
		t.Fatalf("%d commands registered; did registration change?", len(names))
	}
	dbURL := regexp.MustCompile(`(?m)^  OUTBOX_DATABASE_URL +`)
	for _, name := range names {
		lines := [][]string{{name}}
		for _, sub := range subcommands[name] {
			lines = append(lines, []string{name, sub})
		}
		for _, line := range lines {
			for _, h := range []string{"--help", "-h"} {
				args := append(append([]string{}, line...), h)
				r := rbRun(t, nil, args...)
				if r.code != 0 || r.stderr != "" {
					t.Errorf("outbox %v: exit %d, stderr %q; want help on stdout and exit 0\nstdout:\n%s", args, r.code, r.stderr, r.stdout)
					continue
				}
				if !dbURL.MatchString(r.stdout) {
					t.Errorf("outbox %v does not name OUTBOX_DATABASE_URL:\n%s", args, r.stdout)
				}
				if len(line) == 1 {
					for _, sub := range subcommands[name] {
						if !regexp.MustCompile(`(?m)^  ` + sub + ` `).MatchString(r.stdout) {
							t.Errorf("outbox %v does not list the subcommand %s:\n%s", args, sub, r.stdout)
						}
					}
				}
			}
		}
	}
}

// TestBadFlagPointsAtTheHelp: an unknown flag is a usage error (exit 2)
// that names the flag and the command's --help.
func TestBadFlagPointsAtTheHelp(t *testing.T) {
	t.Parallel()
	rbRun(t, nil, "dead", "list", "--bogus").expect(t, 2, nil, []string{"-bogus", "`outbox dead list --help`"})
	rbRun(t, nil, "migrate", "--bogus").expect(t, 2, nil, []string{"-bogus", "`outbox migrate --help`"})
}
