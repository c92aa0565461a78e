package schema_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"regexp"
	"strings"
	"testing"
)

// TestPublicAPIIsTheTableContract: package schema exports the table contract
// only (under 80 identifiers: constants, variables, functions, types and
// methods), and no exported constant or variable is SQL text; the statements
// the relays run live in internal/sqlq.
func TestPublicAPIIsTheTableContract(t *testing.T) {
	t.Parallel()
	fset := token.NewFileSet()
	entries, err := os.ReadDir(".")
	if err != nil {
		t.Fatal(err)
	}
	var files []*ast.File
	for _, e := range entries {
		if !strings.HasSuffix(e.Name(), ".go") || strings.HasSuffix(e.Name(), "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, e.Name(), nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
	}
	sqlText := regexp.MustCompile(`(?i)\b(SELECT|INSERT INTO|UPDATE|DELETE FROM|ALTER TABLE|CREATE TABLE)\b`)
	var names []string
	for _, f := range files {
		for _, d := range f.Decls {
			switch d := d.(type) {
			case *ast.FuncDecl:
				if d.Name.IsExported() && (d.Recv == nil || receiverExported(d.Recv)) {
					names = append(names, d.Name.Name)
				}
			case *ast.GenDecl:
				for _, s := range d.Specs {
					switch s := s.(type) {
					case *ast.TypeSpec:
						if s.Name.IsExported() {
							names = append(names, s.Name.Name)
						}
					case *ast.ValueSpec:
						for i, n := range s.Names {
							if !n.IsExported() {
								continue
							}
							names = append(names, n.Name)
							if i < len(s.Values) {
								if lit, ok := s.Values[i].(*ast.BasicLit); ok && sqlText.MatchString(lit.Value) {
									t.Errorf("%s is SQL text; statements belong in internal/sqlq", n.Name)
								}
							}
						}
					}
				}
			}
		}
	}
	if len(names) >= 80 {
		t.Errorf("package schema exports %d identifiers, want under 80: %v", len(names), names)
	}
}

func receiverExported(r *ast.FieldList) bool {
	e := r.List[0].Type
	if s, ok := e.(*ast.StarExpr); ok {
		e = s.X
	}
	id, ok := e.(*ast.Ident)
	return ok && id.IsExported()
}
