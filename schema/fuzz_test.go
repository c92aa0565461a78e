package schema_test

import (
	"context"
	"errors"
	"regexp"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
)

var identifierPart = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

// FuzzParseTable asserts that ParseTable accepts only "table" or
// "schema.table" of lowercase identifiers within PostgreSQL's 63 bytes,
// refuses everything else with ErrInvalidTable, and that an accepted
// name round-trips: ParseTable(t.String()) is t, and PostgreSQL parses
// t.Sanitize() back into exactly its parts (parse_ident, on the real
// database), so no input can reach SQL as anything but an identifier. Its
// seed corpus holds hostile names (quotes, semicolons, comments, NUL,
// Unicode, three parts).
func FuzzParseTable(f *testing.F) {
	for _, s := range []string{"org_outbox", "public.org_outbox", "_x.a1", "", ".", "a.", ".a", "a.b.c", `org"; DROP TABLE x; --`, "org outbox",
		"Org_Outbox", `"org_outbox"`, "1org", "org-outbox", "é_outbox", "a\x00b", "a/*x*/b", "a\nb", "pg_catalog.pg_class", strings.Repeat("a", 63),
		strings.Repeat("b", 64) + ".t", "ﬀ", "a\u0131"} {
		f.Add(s)
	}
	pool := testdb.Pool(f)
	ctx := context.Background()
	f.Fuzz(func(t *testing.T, s string) {
		tbl, err := schema.ParseTable(s)
		parts := strings.Split(s, ".")
		wellFormed := len(parts) <= 2
		for _, p := range parts {
			wellFormed = wellFormed && identifierPart.MatchString(p)
		}
		if err != nil {
			if !errors.Is(err, schema.ErrInvalidTable) {
				t.Fatalf("ParseTable(%q): an error that is not ErrInvalidTable: %v", s, err)
			}
			if wellFormed && len(parts[len(parts)-1]) < 40 {
				t.Fatalf("ParseTable(%q) refused a well-formed short name: %v", s, err)
			}
			return
		}
		if !wellFormed {
			t.Fatalf("ParseTable(%q) accepted a name that is not one or two lowercase identifiers", s)
		}
		if tbl.String() != s {
			t.Fatalf("ParseTable(%q).String() = %q", s, tbl.String())
		}
		again, err := schema.ParseTable(tbl.String())
		if err != nil || again != tbl {
			t.Fatalf("ParseTable(%q) does not round-trip: %v", s, err)
		}
		var got []string
		if err := pool.QueryRow(ctx, `SELECT parse_ident($1)`, tbl.Sanitize()).Scan(&got); err != nil {
			t.Fatalf("PostgreSQL cannot parse %s: %v", tbl.Sanitize(), err)
		}
		if len(got) != len(parts) {
			t.Fatalf("parse_ident(%s) = %q, want %q", tbl.Sanitize(), got, parts)
		}
		for i := range got {
			if got[i] != parts[i] {
				t.Fatalf("parse_ident(%s) = %q, want %q", tbl.Sanitize(), got, parts)
			}
		}
	})
}

// TestStatementStringKeepsArgumentsOnOneLine: a string argument holding a
// newline, a carriage return, a control character or bytes that are not
// UTF-8 is shown as one escape string literal, never over several lines
// (issue 46); a plain one stays a plain literal.
func TestStatementStringKeepsArgumentsOnOneLine(t *testing.T) {
	t.Parallel()
	st := sqlq.Statement{SQL: "SELECT $1, $2, $3, $4", Args: []any{"it's plain", "a\nDROP TABLE x; --'\\", "bell\a nel\u0085 ls\u2028", "bad\xff"}}
	want := "SELECT $1, $2, $3, $4\n-- $1 = 'it''s plain'\n-- $2 = E'a\\nDROP TABLE x; --''\\\\'\n-- $3 = E'bell\\u0007 nel\\u0085 ls\\u2028'\n-- $4 = E'bad\\xff'"
	if got := st.String(); got != want {
		t.Fatalf("Statement.String()\n = %s\nwant %s", got, want)
	}
}

// FuzzStatementString asserts that a string argument of a runbook
// statement is shown on one line (no line break of any kind) and that the
// literal shown is SQL meaning exactly the argument: PostgreSQL reads it
// back as the same string (for text it can hold: UTF-8 without NUL).
func FuzzStatementString(f *testing.F) {
	for _, s := range []string{"org.cli.alpha.v1", "it's", "timeout\nDROP TABLE students; --", "a\r\n\tb", `back\slash`, "nel\u0085ls\u2028ps\u2029", "bad\xff", "\x00", "\u00e9\U0001F600"} {
		f.Add(s)
	}
	pool := testdb.Pool(f)
	ctx := context.Background()
	f.Fuzz(func(t *testing.T, arg string) {
		out := sqlq.Statement{SQL: "SELECT $1", Args: []any{arg}}.String()
		lit, ok := strings.CutPrefix(out, "SELECT $1\n-- $1 = ")
		if !ok || strings.ContainsAny(lit, "\n\r\v\f\u0085\u2028\u2029") {
			t.Fatalf("argument %q shown over several lines:\n%s", arg, out)
		}
		if !utf8.ValidString(arg) || strings.ContainsRune(arg, 0) {
			return
		}
		// The extended protocol runs one statement at most: a literal that
		// failed to contain its argument errs, it cannot run a second one.
		var got string
		if err := pool.QueryRow(ctx, "SELECT "+lit).Scan(&got); err != nil || got != arg {
			t.Fatalf("PostgreSQL reads %s as %q (%v), want %q", lit, got, err, arg)
		}
	})
}
