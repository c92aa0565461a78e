package doccheck

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// root is the repository root seen from this package's directory.
const root = "../.."

// documents are the user's manual: README.md and docs/*.md, by path from
// the repository root.
func documents(t *testing.T) map[string]string {
	t.Helper()
	names, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	names = append(names, filepath.Join(root, "README.md"), filepath.Join(root, "CHANGELOG.md"))
	docs := map[string]string{}
	for _, name := range names {
		b, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		rel, err := filepath.Rel(root, name)
		if err != nil {
			t.Fatal(err)
		}
		docs[filepath.ToSlash(rel)] = string(b)
	}
	if len(docs) < 5 {
		t.Fatalf("found %d documents; has the layout changed?", len(docs))
	}
	return docs
}

var (
	fence     = regexp.MustCompile("(?ms)^ *```.*?^ *```")
	codeSpan  = regexp.MustCompile("`[^`\n]*`")
	mdLink    = regexp.MustCompile(`!?\[[^\]]*\]\(([^)\s]+)\)`)
	heading   = regexp.MustCompile(`(?m)^#{1,6} +(.+?) *$`)
	notAnchor = regexp.MustCompile(`[^\p{L}\p{N} _-]`)
	testName  = regexp.MustCompile(`\b(?:Test|Fuzz|Benchmark)[A-Z][A-Za-z0-9_]*`)
	funcDecl  = regexp.MustCompile(`(?m)^func ((?:Test|Fuzz|Benchmark)[A-Za-z0-9_]*)\(`)
)

// anchors are the link targets GitHub makes of a document's headings.
func anchors(doc string) map[string]bool {
	seen := map[string]int{}
	out := map[string]bool{}
	for _, m := range heading.FindAllStringSubmatch(fence.ReplaceAllString(doc, ""), -1) {
		a := strings.ToLower(strings.ReplaceAll(m[1], "`", ""))
		a = strings.ReplaceAll(notAnchor.ReplaceAllString(a, ""), " ", "-")
		if n := seen[a]; n > 0 {
			out[a+"-"+strconv.Itoa(n)] = true
		} else {
			out[a] = true
		}
		seen[a]++
	}
	return out
}

// TestDocLinks: every relative link of README.md, CHANGELOG.md and docs/*.md
// names a file or directory of the repository, and every #anchor names a
// heading of the document it points into.
func TestDocLinks(t *testing.T) {
	t.Parallel()
	docs := documents(t)
	for name, doc := range docs {
		text := codeSpan.ReplaceAllString(fence.ReplaceAllString(doc, ""), "")
		for _, m := range mdLink.FindAllStringSubmatch(text, -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			file, anchor, _ := strings.Cut(target, "#")
			path := name
			if file != "" {
				path = filepath.ToSlash(filepath.Join(filepath.Dir(name), file))
				if _, err := os.Stat(filepath.Join(root, path)); err != nil {
					t.Errorf("%s: link %q: %v", name, target, err)
					continue
				}
			}
			if anchor == "" {
				continue
			}
			into, ok := docs[path]
			if !ok {
				t.Errorf("%s: link %q has an anchor into a file that is not a checked document", name, target)
				continue
			}
			if !anchors(into)[anchor] {
				t.Errorf("%s: link %q: %s has no heading with anchor #%s", name, target, path, anchor)
			}
		}
	}
}

// TestDocsCiteExistingTests: every test, fuzz target or benchmark that
// README.md, CHANGELOG.md or docs/*.md names as the proof of a promise is a
// function of some _test.go file of the module (a name may stand for the
// tests it begins, as in go test -run).
func TestDocsCiteExistingTests(t *testing.T) {
	t.Parallel()
	var funcs []string
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (strings.HasPrefix(d.Name(), ".") && path != root || d.Name() == "testdata") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range funcDecl.FindAllStringSubmatch(string(b), -1) {
			funcs = append(funcs, m[1])
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(funcs) < 100 {
		t.Fatalf("found %d test functions; has the layout changed?", len(funcs))
	}
	exists := func(name string) bool {
		for _, f := range funcs {
			if strings.HasPrefix(f, name) {
				return true
			}
		}
		return false
	}
	for name, doc := range documents(t) {
		reported := map[string]bool{}
		for _, cited := range testName.FindAllString(doc, -1) {
			if strings.HasSuffix(cited, "Xxx") {
				continue // a placeholder: "every FuzzXxx target"
			}
			if !reported[cited] && !exists(cited) {
				reported[cited] = true
				t.Errorf("%s cites %s, which no _test.go file of the module declares", name, cited)
			}
		}
	}
}
