// Package doccheck helps tests hold docs/ARCHITECTURE.md (and the other
// documents) to the code: a
// package's test builds the sentences the document must contain from its
// own constants, so that changing a constant without the document fails.
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

// Expect fails t for every fragment docs/ARCHITECTURE.md (doc) does not
// contain.
func Expect(t *testing.T, doc string, fragments ...string) {
	t.Helper()
	ExpectIn(t, "ARCHITECTURE.md", doc, fragments...)
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
