package keyed

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// keyedSources are the files of the keyed relays' sources: ordered mode's
// and the WAL relay's.
var keyedSources = map[string][]string{
	"../../subscriber": {"ordered.go", "ordered_keys.go", "ordered_lease.go", "ordered_scan.go"},
	"../../walrelay":   nil, // every file
}

// TestKeyedRelaysShape: no non-test Go file of subscriber, walrelay or
// this package is over 1,000 lines, and no type there has more than 30
// methods (docs/ARCHITECTURE.md, "The keyed core").
func TestKeyedRelaysShape(t *testing.T) {
	t.Parallel()
	for _, dir := range []string{"../../subscriber", "../../walrelay", "."} {
		files, err := filepath.Glob(filepath.Join(dir, "*.go"))
		if err != nil {
			t.Fatal(err)
		}
		methods := map[string]int{}
		for _, f := range files {
			if strings.HasSuffix(f, "_test.go") {
				continue
			}
			src, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			if n := strings.Count(string(src), "\n"); n > 1000 {
				t.Errorf("%s has %d lines; the limit is 1,000", f, n)
			}
			file, err := parser.ParseFile(token.NewFileSet(), f, src, 0)
			if err != nil {
				t.Fatal(err)
			}
			for _, d := range file.Decls {
				if fd, ok := d.(*ast.FuncDecl); ok && fd.Recv != nil {
					methods[receiverName(fd.Recv.List[0].Type)]++
				}
			}
		}
		for typ, n := range methods {
			if n > 30 {
				t.Errorf("%s: type %s has %d methods; the limit is 30", dir, typ, n)
			}
		}
	}
}

// TestKeyedRelaysStartKeysThroughTheEngine: the keyed relays' sources
// start keys through Engine.Start and give their slots back through
// Engine.Finish; none reserves a slot itself or keeps its own waiting
// line (the default relay's claim loop, which reserves batches, is not a
// keyed source).
func TestKeyedRelaysStartKeysThroughTheEngine(t *testing.T) {
	t.Parallel()
	for dir, names := range keyedSources {
		if names == nil {
			files, err := filepath.Glob(filepath.Join(dir, "*.go"))
			if err != nil {
				t.Fatal(err)
			}
			for _, f := range files {
				if !strings.HasSuffix(f, "_test.go") {
					names = append(names, filepath.Base(f))
				}
			}
		}
		var all strings.Builder
		for _, n := range names {
			src, err := os.ReadFile(filepath.Join(dir, n))
			if err != nil {
				t.Fatal(err)
			}
			all.Write(src)
		}
		src := all.String()
		for _, want := range []string{"keyed.NewEngine(", ".keyed.Start(", ".keyed.Finish(", ".keyed.Ready("} {
			if want == "keyed.NewEngine(" && dir == "../../subscriber" {
				continue // the subscription builds the ordered relay's engine over its slots (subscriber.go)
			}
			if !strings.Contains(src, want) {
				t.Errorf("%s: the keyed source does not call %s", dir, want)
			}
		}
		for _, banned := range []string{".Reserve(", ".Unreserve(", "keyed.Waiters", "Waiters{"} {
			if strings.Contains(src, banned) {
				t.Errorf("%s: the keyed source calls %s itself instead of going through keyed.Engine", dir, banned)
			}
		}
	}
}

func receiverName(e ast.Expr) string {
	switch x := e.(type) {
	case *ast.StarExpr:
		return receiverName(x.X)
	case *ast.IndexExpr:
		return receiverName(x.X)
	case *ast.IndexListExpr:
		return receiverName(x.X)
	case *ast.Ident:
		return x.Name
	}
	return "?"
}
