// Package termcheck holds the keyed relays to the term core (package
// internal/term): their architecture tests parse the relay's source and
// fail when it stops handing messages out through the core or keeps a
// record of stale copies of its own.
package termcheck

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// Import is the term core's import path.
const Import = "github.com/outboxkit/watermill-outbox/internal/term"

// Violations parses the Go sources (file name to text) of one relay and
// returns every rule they break:
//
//   - the relay imports the term core;
//   - it begins terms (a call of a method Begin) and hands messages out
//     through them: every send on a channel named out is in a function
//     that calls a method Hand, and nothing else reaches the consumer;
//   - it keeps no stale-copy records of its own: no struct field or
//     package variable whose name contains "stale", and no call of
//     context.AfterFunc (a message's context is tied to its term by the
//     core alone).
func Violations(files map[string][]byte) ([]string, error) {
	var out []string
	fset := token.NewFileSet()
	imported, begins := false, false
	for name, src := range files {
		f, err := parser.ParseFile(fset, name, src, parser.SkipObjectResolution)
		if err != nil {
			return nil, fmt.Errorf("termcheck: parse %s: %w", name, err)
		}
		ctxName := ""
		for _, imp := range f.Imports {
			path, _ := strconv.Unquote(imp.Path.Value)
			switch path {
			case Import:
				imported = true
			case "context":
				ctxName = "context"
				if imp.Name != nil {
					ctxName = imp.Name.Name
				}
			}
		}
		ast.Inspect(f, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.StructType:
				for _, fld := range n.Fields.List {
					for _, id := range fld.Names {
						if strings.Contains(strings.ToLower(id.Name), "stale") {
							out = append(out, fmt.Sprintf("%s: field %s: stale copies are the term ledger's (term.Ledger.Stale), not the relay's", fset.Position(id.Pos()), id.Name))
						}
					}
				}
			case *ast.GenDecl:
				if n.Tok == token.VAR {
					for _, sp := range n.Specs {
						for _, id := range sp.(*ast.ValueSpec).Names {
							if strings.Contains(strings.ToLower(id.Name), "stale") {
								out = append(out, fmt.Sprintf("%s: variable %s: stale copies are the term ledger's", fset.Position(id.Pos()), id.Name))
							}
						}
					}
				}
			case *ast.CallExpr:
				if sel, ok := n.Fun.(*ast.SelectorExpr); ok {
					if x, ok := sel.X.(*ast.Ident); ok && ctxName != "" && x.Name == ctxName && sel.Sel.Name == "AfterFunc" {
						out = append(out, fmt.Sprintf("%s: context.AfterFunc: a message's context ends with its term through term.Term.Hand only", fset.Position(n.Pos())))
					}
					if sel.Sel.Name == "Begin" {
						begins = true
					}
				}
			case *ast.FuncDecl:
				if n.Body == nil {
					return false
				}
				hands := false
				var sends []*ast.SendStmt
				ast.Inspect(n.Body, func(m ast.Node) bool {
					switch m := m.(type) {
					case *ast.CallExpr:
						if sel, ok := m.Fun.(*ast.SelectorExpr); ok && sel.Sel.Name == "Hand" {
							hands = true
						}
					case *ast.SendStmt:
						if channelName(m.Chan) == "out" {
							sends = append(sends, m)
						}
					}
					return true
				})
				if !hands {
					for _, s := range sends {
						out = append(out, fmt.Sprintf("%s: %s sends to the consumer without term.Term.Hand", fset.Position(s.Pos()), n.Name.Name))
					}
				}
			}
			return true
		})
	}
	if !imported {
		out = append(out, "the relay does not import "+Import)
	}
	if !begins {
		out = append(out, "the relay begins no term (term.Ledger.Begin)")
	}
	return out, nil
}

// channelName is the last name of a channel expression: out for r.sub.out.
func channelName(e ast.Expr) string {
	switch e := e.(type) {
	case *ast.Ident:
		return e.Name
	case *ast.SelectorExpr:
		return e.Sel.Name
	}
	return ""
}

// Expect fails t for every rule the named files of dir break (Violations).
func Expect(t *testing.T, dir string, names ...string) {
	t.Helper()
	files := map[string][]byte{}
	for _, n := range names {
		b, err := os.ReadFile(filepath.Join(dir, n)) //nolint:gosec // a path the calling test gives
		if err != nil {
			t.Fatal(err)
		}
		files[n] = b
	}
	v, err := Violations(files)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range v {
		t.Errorf("the relay does not keep to the term core (docs/ARCHITECTURE.md, \"The term core\"): %s", s)
	}
}
