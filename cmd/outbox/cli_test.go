package main

import (
	"os"
	"regexp"
	"strings"
	"testing"
)

// TestBareCommandIsAUsageError: `outbox` alone prints the usage on stderr
// and exits 2; `outbox help` prints it on stdout and exits 0.
func TestBareCommandIsAUsageError(t *testing.T) {
	t.Parallel()
	r := rbRun(t, nil)
	r.expect(t, 2, nil, []string{"usage: outbox <command>", "relay"})
	r = rbRun(t, nil, "help")
	r.expect(t, 0, []string{"usage: outbox <command>"}, nil)
}

// TestRelayHelpListsTheDocumentedVariables: `outbox relay --help` lists
// every variable of the configuration table of docs/OPERATIONS.md ("The
// daemon's configuration") with its default, and no other.
func TestRelayHelpListsTheDocumentedVariables(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile("../../docs/OPERATIONS.md")
	if err != nil {
		t.Fatal(err)
	}
	section := string(doc)
	start := strings.Index(section, "\n## The daemon's configuration\n")
	if start < 0 {
		t.Fatal(`docs/OPERATIONS.md has no section "## The daemon's configuration"; did its layout change?`)
	}
	section = section[start+1:]
	if end := strings.Index(section, "\n## "); end >= 0 {
		section = section[:end]
	}
	row := regexp.MustCompile("(?m)^\\| `((?:OUTBOX|PROMETHEUS|OTEL)_[A-Z_]+)` \\| *([^|]*?) *\\|")
	rows := row.FindAllStringSubmatch(section, -1)
	if len(rows) < 20 {
		t.Fatalf("found %d variables in the configuration table of docs/OPERATIONS.md; did its layout change?", len(rows))
	}
	r := rbRun(t, nil, "relay", "--help")
	r.expect(t, 0, []string{"VARIABLE", "DEFAULT"}, nil)
	inHelp := map[string]bool{}
	for _, v := range relayVars {
		inHelp[v[0]] = true
	}
	for _, m := range rows {
		name, def := m[1], strings.ReplaceAll(m[2], "`", "")
		if !inHelp[name] {
			t.Errorf("documented variable %s is not in outbox relay --help", name)
			continue
		}
		if !regexp.MustCompile(`(?m)^  ` + name + ` +` + regexp.QuoteMeta(helpDefault(name)) + ` `).MatchString(r.stdout) {
			t.Errorf("help line of %s is missing or malformed:\n%s", name, r.stdout)
		}
		if def != "" && !strings.HasPrefix(def, "(") && !strings.HasPrefix(def, "the ") && !strings.HasPrefix(helpDefault(name), strings.Fields(def)[0]) {
			t.Errorf("%s: documented default %q, help default %q", name, def, helpDefault(name))
		}
		delete(inHelp, name)
	}
	for name := range inHelp {
		t.Errorf("outbox relay --help lists %s, which the table of docs/OPERATIONS.md does not", name)
	}
}

func helpDefault(name string) string {
	for _, v := range relayVars {
		if v[0] == name {
			if v[1] == "" {
				return "-"
			}
			return v[1]
		}
	}
	return ""
}

// TestCellKeepsTheCause: a long last_error keeps its head and its cause
// (wrapped errors put the cause last) in `dead list`.
func TestCellKeepsTheCause(t *testing.T) {
	t.Parallel()
	long := "publish event 6f1c to \"org.organization.created.v1\": amqp backend: " + strings.Repeat("channel pool wait, ", 20) + "cause: NOT_FOUND - no exchange"
	got := cell(long, 120)
	if n := len([]rune(got)); n != 120 {
		t.Fatalf("cell has %d runes, want 120: %q", n, got)
	}
	if !strings.HasPrefix(got, "publish event 6f1c") || !strings.HasSuffix(got, "cause: NOT_FOUND - no exchange") || !strings.Contains(got, " ... ") {
		t.Fatalf("cell lost the head or the cause: %q", got)
	}
	if cell("short\nerror", 120) != "short error" {
		t.Fatal("short values are kept, control characters become spaces")
	}
}
