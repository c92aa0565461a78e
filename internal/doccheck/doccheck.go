// Package doccheck helps tests hold docs/ARCHITECTURE.md (and the other
// documents) to the code: a package's test builds, from its own constants,
// the statements the document must make, so that changing a constant
// without the document fails. Expect checks the constants of a statement
// (its code names and its figures), not its wording, so that the prose
// around them can be edited freely; ExpectIn checks text the code renders
// (a table) exactly.
package doccheck

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

var space = regexp.MustCompile(`\s+`)

// Architecture is docs/ARCHITECTURE.md with every run of white space made
// one space (the document's lines wrap anywhere). dir is the calling test's
// path to the repository root, such as "..".
func Architecture(t *testing.T, dir string) string {
	t.Helper()
	return Doc(t, dir, "ARCHITECTURE.md")
}

// Doc is docs/<name> with every run of white space made one space.
func Doc(t *testing.T, dir, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "docs", name)) //nolint:gosec // a path the calling test gives
	if err != nil {
		t.Fatal(err)
	}
	return Normalize(string(b))
}

// Normalize makes every run of white space in s one space, as Doc does,
// for a fragment that spans lines (a table).
func Normalize(s string) string { return space.ReplaceAllString(s, " ") }

// Expect fails t for every statement docs/ARCHITECTURE.md (doc) does not
// make. A statement is checked by its constants, not its words: its code
// spans (`name`) and its figures (numbers, with their unit when one
// follows: "1 ms", "4,096", "10 minutes") must appear in the document in
// the same order, each within window bytes of the one before. So
// "A woken relay waits 1 ms (`wakeCoalesce`: ...)" is made as well by
// "`wakeCoalesce`: after a wake-up the relay waits 1 ms", but not by a
// document that gives `wakeCoalesce` another value.
func Expect(t *testing.T, doc string, statements ...string) {
	t.Helper()
	for _, s := range statements {
		if !Makes(doc, s) {
			t.Errorf("docs/ARCHITECTURE.md does not state %s (from %q): update the document (or the code) so that they agree", strings.Join(Constants(s), " ... "), s)
		}
	}
}

// window is how far apart two constants of one statement may be in the
// document.
const window = 160

var constant = regexp.MustCompile("`[^`]+`|[0-9][0-9,.]*[0-9]( ?(ms|µs|s|minutes?|MiB)\\b)?|[0-9]( ?(ms|µs|s|minutes?|MiB)\\b)?")

// Constants are the code spans and figures of statement, in order.
func Constants(statement string) []string {
	var out []string
	for _, c := range constant.FindAllString(Normalize(statement), -1) {
		out = append(out, strings.TrimRight(c, ",."))
	}
	return out
}

// Makes reports whether doc (normalised) gives the constants of statement
// in order, each within window bytes of the end of the one before. A figure
// matches only as a whole number ("20" is not found in "200" or "2,048").
func Makes(doc, statement string) bool {
	cs := Constants(statement)
	if len(cs) == 0 {
		return strings.Contains(doc, Normalize(statement))
	}
	var from func(i, pos, limit int) bool
	from = func(i, pos, limit int) bool {
		if i == len(cs) {
			return true
		}
		for p := pos; p < len(doc); {
			j := strings.Index(doc[p:], cs[i])
			if j < 0 {
				return false
			}
			at := p + j
			if limit >= 0 && at > limit {
				return false
			}
			end := at + len(cs[i])
			if whole(doc, cs[i], at, end) && from(i+1, end, end+window) {
				return true
			}
			p = at + 1
		}
		return false
	}
	return from(0, 0, -1)
}

// whole reports whether the match of c at doc[at:end] is not part of a
// longer figure.
func whole(doc, c string, at, end int) bool {
	if strings.HasPrefix(c, "`") {
		return true
	}
	digit := func(b byte) bool { return b >= '0' && b <= '9' }
	if at > 0 && (digit(doc[at-1]) || (at > 1 && (doc[at-1] == ',' || doc[at-1] == '.') && digit(doc[at-2]))) {
		return false
	}
	if end < len(doc) && (digit(doc[end]) || (end+1 < len(doc) && (doc[end] == ',' || doc[end] == '.') && digit(doc[end+1]))) {
		return false
	}
	return true
}

// ExpectIn fails t for every fragment doc, the text of docs/<name>, does
// not contain.
func ExpectIn(t *testing.T, name, doc string, fragments ...string) {
	t.Helper()
	for _, f := range fragments {
		if !strings.Contains(doc, f) {
			t.Errorf("docs/%s does not say %q: update the document (or the code) so that they agree", name, f)
		}
	}
}

// Duration writes d as the document does: "1 ms", "3 µs", "60 s".
func Duration(d time.Duration) string {
	switch {
	case d%time.Second == 0:
		return fmt.Sprintf("%d s", d/time.Second)
	case d%time.Millisecond == 0:
		return fmt.Sprintf("%d ms", d/time.Millisecond)
	default:
		return fmt.Sprintf("%d µs", d/time.Microsecond)
	}
}

// Count writes n with thousands separators, as the document does: "4,096".
func Count(n int) string {
	s := fmt.Sprint(n)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}
