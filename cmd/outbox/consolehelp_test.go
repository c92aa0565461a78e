package main

import (
	"os"
	"regexp"
	"sort"
	"strings"
	"testing"
)

// TestConsoleHelpListsItsVariables: `outbox console -h` exits 0 and lists,
// beside its flag, every environment variable the console's code reads
// (each OUTBOX_* name in console.go) and the database URL.
func TestConsoleHelpListsItsVariables(t *testing.T) {
	t.Parallel()
	src, err := os.ReadFile("console.go")
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{"OUTBOX_DATABASE_URL": true}
	for _, m := range regexp.MustCompile(`"(OUTBOX_[A-Z_]*[A-Z])"`).FindAllStringSubmatch(string(src), -1) {
		names[m[1]] = true
	}
	if len(names) < 10 {
		t.Fatalf("found %d variables in console.go; did its layout change?", len(names))
	}
	for _, flag := range []string{"-h", "--help"} {
		r := rbRun(t, nil, "console", flag)
		if r.code != 0 {
			t.Fatalf("outbox console %s: exit %d, want 0\nstdout:\n%s\nstderr:\n%s", flag, r.code, r.stdout, r.stderr)
		}
		var missing []string
		for name := range names {
			if !regexp.MustCompile(`(?m)^  ` + name + ` `).MatchString(r.stdout) {
				missing = append(missing, name)
			}
		}
		sort.Strings(missing)
		if len(missing) > 0 || !strings.Contains(r.stdout, "-read-only") {
			t.Fatalf("outbox console %s does not list %v (or its -read-only flag):\n%s", flag, missing, r.stdout)
		}
	}
}
