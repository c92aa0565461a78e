package inbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/inbox"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
)

// TestTxBehavesAsPgx: the inbox transaction, whose BEGIN goes out with the
// record in one round trip, behaves as a pgx transaction for the handler: a
// nested Begin is a savepoint (its rollback undoes only its writes), large
// objects work and commit with the rest, and the whole commits once.
func TestTxBehavesAsPgx(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ib := e.newInbox(t, inbox.Config{})
	var oid uint32
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx, _ := inbox.Tx(ctx)
		if _, err := tx.Exec(ctx, `INSERT INTO `+e.effects+` (consumer, key) VALUES ('kept', $1)`, msg.UUID); err != nil {
			return nil, err
		}
		sp, err := tx.Begin(ctx)
		if err != nil {
			return nil, err
		}
		if _, err := sp.Exec(ctx, `INSERT INTO `+e.effects+` (consumer, key) VALUES ('undone', $1)`, msg.UUID); err != nil {
			return nil, err
		}
		if err := sp.Rollback(ctx); err != nil {
			return nil, err
		}
		if _, err := sp.Exec(ctx, `SELECT 1`); !errors.Is(err, pgx.ErrTxClosed) {
			return nil, errors.New("savepoint usable after its rollback")
		}
		sp2, err := tx.Begin(ctx)
		if err != nil {
			return nil, err
		}
		if _, err := sp2.Exec(ctx, `INSERT INTO `+e.effects+` (consumer, key) VALUES ('released', $1)`, msg.UUID); err != nil {
			return nil, err
		}
		if err := sp2.Commit(ctx); err != nil {
			return nil, err
		}
		lo := tx.LargeObjects()
		oid, err = lo.Create(ctx, 0)
		if err != nil {
			return nil, err
		}
		obj, err := lo.Open(ctx, oid, pgx.LargeObjectModeWrite)
		if err != nil {
			return nil, err
		}
		if _, err := obj.Write([]byte("blob")); err != nil {
			return nil, err
		}
		return nil, obj.Close()
	})
	msg := newMsg()
	if _, err := h(msg); err != nil {
		t.Fatal(err)
	}
	for consumer, want := range map[string]int{"kept": 1, "undone": 0, "released": 1} {
		if got := e.effectsOf(t, consumer); got != want {
			t.Errorf("%s rows: %d, want %d", consumer, got, want)
		}
	}
	var blob []byte
	err := pgx.BeginFunc(context.Background(), e.pool, func(tx pgx.Tx) error {
		lo := tx.LargeObjects()
		obj, err := lo.Open(context.Background(), oid, pgx.LargeObjectModeRead)
		if err != nil {
			return err
		}
		blob = make([]byte, 4)
		_, err = obj.Read(blob)
		return err
	})
	if err != nil || string(blob) != "blob" {
		t.Fatalf("large object after commit: %q, %v", blob, err)
	}
	_, _ = e.pool.Exec(context.Background(), `SELECT lo_unlink($1)`, oid)
	if got := e.records(t, "billing"); got != 1 {
		t.Fatalf("inbox records %d, want 1", got)
	}
}

// TestTxAbortedCommitNacks: a handler that swallows a failed statement
// leaves the transaction aborted; the commit then reports the server's
// rollback (pgx.ErrTxCommitRollback), the message is nacked, neither the
// record nor any effect is kept, and the next delivery does the work.
func TestTxAbortedCommitNacks(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ib := e.newInbox(t, inbox.Config{})
	swallow := true
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx, _ := inbox.Tx(ctx)
		if _, err := tx.Exec(ctx, `INSERT INTO `+e.effects+` (consumer, key) VALUES ('billing', $1)`, msg.UUID); err != nil {
			return nil, err
		}
		if swallow {
			_, _ = tx.Exec(ctx, `SELECT 1/0`) // error ignored: the transaction is aborted
		}
		return nil, nil
	})
	msg := newMsg()
	if _, err := h(copyOf(msg)); !errors.Is(err, pgx.ErrTxCommitRollback) {
		t.Fatalf("commit of an aborted transaction: %v, want pgx.ErrTxCommitRollback", err)
	}
	if e.effectsOf(t, "billing") != 0 || e.records(t, "billing") != 0 {
		t.Fatal("an aborted transaction kept rows")
	}
	swallow = false
	if _, err := h(copyOf(msg)); err != nil {
		t.Fatal(err)
	}
	if e.effectsOf(t, "billing") != 1 || e.records(t, "billing") != 1 {
		t.Fatal("the redelivery did not do the work once")
	}
}

// TestTxConnectionsGoBack: every path (processed, duplicate, handler error,
// panic, FailFast refusal) gives its connection back to the pool idle, out
// of any transaction; a pool of 2 connections serves 50 messages of each.
func TestTxConnectionsGoBack(t *testing.T) {
	t.Parallel()
	e := setup(t)
	pool := testdb.NewPool(t, func(c *pgxpool.Config) { c.MaxConns = 2 })
	for _, mode := range []inbox.Concurrency{inbox.Wait, inbox.FailFast} {
		ib, err := inbox.New(pool, inbox.Config{Table: e.table, Consumer: "pool-" + mode.String(), Concurrency: mode})
		if err != nil {
			t.Fatal(err)
		}
		fail := errors.New("handler failed")
		ok := ib.Middleware(e.effect("pool", 0, nil))
		bad := ib.Middleware(e.effect("pool", 0, fail))
		panicking := ib.Middleware(func(*message.Message) ([]*message.Message, error) { panic("boom") })
		for range 50 {
			m := newMsg()
			if _, err := ok(copyOf(m)); err != nil {
				t.Fatal(err)
			}
			if _, err := ok(copyOf(m)); err != nil { // duplicate
				t.Fatal(err)
			}
			if _, err := bad(newMsg()); !errors.Is(err, fail) {
				t.Fatalf("handler error: %v", err)
			}
			func() {
				defer func() { _ = recover() }()
				_, _ = panicking(newMsg())
			}()
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		var held []*pgxpool.Conn
		for range 2 {
			c, err := pool.Acquire(ctx)
			if err != nil {
				cancel()
				t.Fatalf("%s: a connection was not given back: %v", mode, err)
			}
			if s := c.Conn().PgConn().TxStatus(); s != 'I' {
				t.Errorf("%s: a connection came back in transaction status %q", mode, s)
			}
			held = append(held, c)
		}
		for _, c := range held {
			c.Release()
		}
		cancel()
		_ = ib.Close()
	}
	if got := e.effectsOf(t, "pool"); got != 100 {
		t.Fatalf("effects %d, want 100 (50 per mode, duplicates skipped, failures rolled back)", got)
	}
}
