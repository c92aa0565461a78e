package publisher_test

import (
	"bufio"
	"errors"
	"go/ast"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"io"
	"os"
	"os/exec"
	"strings"
	"testing"
)

// txOnlyProgram calls every entry point that takes a publisher.Tx, once with
// something that is not a transaction (marked "// refused") and once with a
// transaction (marked "// accepted").
const txOnlyProgram = `package p

import (
	"context"
	"database/sql"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
)

func f(ctx context.Context, pool *pgxpool.Pool, pconn *pgxpool.Conn, conn *pgx.Conn, db *sql.DB, sconn *sql.Conn,
	tx pgx.Tx, stx *sql.Tx, enq *publisher.Enqueuer, t schema.Table, m publisher.Message) {
	publisher.Enqueue(ctx, pool, t, m)                           // refused
	publisher.Enqueue(ctx, pconn, t, m)                          // refused
	publisher.Enqueue(ctx, conn, t, m)                           // refused
	publisher.EnqueueBatch(ctx, pool, t, nil)                    // refused
	publisher.EnqueueBatch(ctx, conn, t, nil)                    // refused
	enq.Enqueue(ctx, pool, t, m)                                 // refused
	enq.EnqueueBatch(ctx, pool, t, nil)                          // refused
	publisher.NewTxPublisher(pool, publisher.TxPublisherConfig{}) // refused
	publisher.NewTxPublisher(conn, publisher.TxPublisherConfig{}) // refused
	publisher.StdlibTx(db)                                       // refused
	publisher.StdlibTx(sconn)                                    // refused

	publisher.Enqueue(ctx, tx, t, m)                                        // accepted
	publisher.EnqueueBatch(ctx, tx, t, nil)                                 // accepted
	enq.Enqueue(ctx, tx, t, m)                                              // accepted
	enq.EnqueueBatch(ctx, publisher.StdlibTx(stx), t, nil)                  // accepted
	publisher.NewTxPublisher(tx, publisher.TxPublisherConfig{})             // accepted
	publisher.NewTxPublisher(publisher.StdlibTx(stx), publisher.TxPublisherConfig{}) // accepted
	publisher.Enqueue(ctx, publisher.StdlibTx(stx), t, m)                   // accepted
}
`

// TestOnlyATransactionCompiles type-checks a program against the compiled
// publisher package: a pool or a connection (pgx or database/sql) passed
// where a transaction is meant is a compile error on its line, and a
// transaction compiles. Before publisher.Tx asked for Commit and Rollback, a
// *pgxpool.Pool compiled and its event committed on its own.
func TestOnlyATransactionCompiles(t *testing.T) {
	t.Parallel()
	// The export data of the packages the program imports, built (or taken
	// from the build cache) by the go command.
	cmd := exec.Command("go", "list", "-export", "-deps", "-f", "{{.ImportPath}}={{.Export}}",
		"context", "database/sql", "github.com/jackc/pgx/v5", "github.com/jackc/pgx/v5/pgxpool",
		"github.com/outboxkit/watermill-outbox/publisher", "github.com/outboxkit/watermill-outbox/schema")
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list -export: %v", err)
	}
	exports := map[string]string{}
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() {
		if path, file, ok := strings.Cut(sc.Text(), "="); ok && file != "" {
			exports[path] = file
		}
	}

	fset := token.NewFileSet()
	file, err := parser.ParseFile(fset, "p.go", txOnlyProgram, parser.ParseComments)
	if err != nil {
		t.Fatal(err)
	}
	want := map[int]string{} // line -> "refused" or "accepted"
	for _, cg := range file.Comments {
		for _, c := range cg.List {
			if v := strings.TrimSpace(strings.TrimPrefix(c.Text, "//")); v == "refused" || v == "accepted" {
				want[fset.Position(c.Pos()).Line] = v
			}
		}
	}
	errs := map[int][]string{}
	conf := types.Config{
		Importer: importer.ForCompiler(fset, "gc", func(path string) (io.ReadCloser, error) {
			return os.Open(exports[path])
		}),
		Error: func(err error) {
			var te types.Error
			if !errors.As(err, &te) {
				errs[0] = append(errs[0], err.Error())
				return
			}
			line := fset.Position(te.Pos).Line
			errs[line] = append(errs[line], te.Msg)
		},
	}
	_, _ = conf.Check("p", fset, []*ast.File{file}, nil)

	lines := strings.Split(txOnlyProgram, "\n")
	refused := 0
	for line, v := range want {
		code := strings.TrimSpace(strings.Split(lines[line-1], "//")[0])
		switch {
		case v == "accepted" && len(errs[line]) > 0:
			t.Errorf("line %d %q: want it to compile, got %v", line, code, errs[line])
		case v == "refused" && len(errs[line]) == 0:
			t.Errorf("line %d %q: compiles; want a compile error (not a transaction)", line, code)
		case v == "refused":
			refused++
			// The error names what is missing, so a reader knows why.
			msg := strings.Join(errs[line], "; ")
			if !strings.Contains(msg, "missing method Commit") && !strings.Contains(msg, "cannot use") {
				t.Errorf("line %d %q: error %q does not say why", line, code, msg)
			}
		}
		delete(errs, line)
	}
	for line, e := range errs {
		t.Errorf("unexpected error on line %d: %v", line, e)
	}
	if refused != 11 {
		t.Errorf("%d lines refused, want 11", refused)
	}
}
