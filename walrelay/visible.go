package walrelay

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Streamed is not yet visible. The walsender sends a transaction once its
// commit record is flushed; the transaction becomes visible to other
// sessions when its backend leaves the process array, a moment later under
// load, and only once a synchronous standby confirmed it when the writer
// waits for one. A statement of the relay about a streamed row (its dead
// verdict, the read of a held key's parked rows, the read of a replayed row
// whose payload the UPDATE left out) must not run before the row's
// transaction is visible: it would find no row (or the row before the
// replay) and the relay would take "nothing there" for "settled" (a dead
// write waits for its row to be visible; docs/WAL.md "A streamed row may not be visible yet").
//
// The stream keeps the transaction ids of the transactions it read rows of
// (unseen) until a snapshot shows them visible: every progress record
// prunes them with its horizon candidate (the oldest transaction running),
// and visible prunes them with a snapshot of its own.

// visibleRetry is the first wait before a statement that waited for
// visibility is tried again; it doubles up to visibleRetryMax.
const (
	visibleRetry    = 5 * time.Millisecond
	visibleRetryMax = time.Second
)

// visibleDelay is the wait before the n-th retry (n from 0).
func visibleDelay(n int) time.Duration {
	d := visibleRetry
	for ; n > 0 && d < visibleRetryMax; n-- {
		d *= 2
	}
	return min(d, visibleRetryMax)
}

// snapshot is a transaction snapshot: transactions below xmin are finished,
// those from xmax on and those in xip are running.
type snapshot struct {
	xmin, xmax uint64
	xip        map[uint64]bool
}

// parseSnapshot parses pg_current_snapshot()::text ("xmin:xmax:xip,...").
func parseSnapshot(s string) (snapshot, error) {
	parts := strings.Split(s, ":")
	if len(parts) != 3 {
		return snapshot{}, fmt.Errorf("walrelay: unexpected snapshot %q", s)
	}
	var snap snapshot
	var err error
	if snap.xmin, err = strconv.ParseUint(parts[0], 10, 64); err != nil {
		return snapshot{}, fmt.Errorf("walrelay: snapshot xmin: %w", err)
	}
	if snap.xmax, err = strconv.ParseUint(parts[1], 10, 64); err != nil {
		return snapshot{}, fmt.Errorf("walrelay: snapshot xmax: %w", err)
	}
	if parts[2] != "" {
		snap.xip = map[uint64]bool{}
		for _, x := range strings.Split(parts[2], ",") {
			v, err := strconv.ParseUint(x, 10, 64)
			if err != nil {
				return snapshot{}, fmt.Errorf("walrelay: snapshot xip: %w", err)
			}
			snap.xip[v] = true
		}
	}
	return snap, nil
}

// full widens a 32-bit transaction id of the stream to the 64-bit id
// within 2^31 of ref (a transaction the stream read is that recent). A
// transaction that committed may still come after a snapshot's xmax (xmax
// is the newest transaction that ended, plus one).
func full(xid uint32, ref uint64) uint64 {
	x := int64(ref) + int64(int32(xid-uint32(ref))) //nolint:gosec // modular distance of transaction ids
	return uint64(max(x, 0))
}

// sees reports whether a transaction that committed, xid, is visible in
// snap.
func (snap snapshot) sees(xid uint32) bool {
	x := full(xid, snap.xmax)
	return x < snap.xmin || (x < snap.xmax && !snap.xip[x])
}

// precedes reports whether xid is older than the 64-bit id ref (both
// within 2^31 of each other).
func precedes(xid uint32, ref uint64) bool {
	return int32(xid-uint32(ref)) < 0 //nolint:gosec // modular comparison of transaction ids
}

// visibility tells whether the transactions a session read rows of are
// visible to a new snapshot: the stream reads a transaction's rows once it
// commits, a moment before its commit is visible to other sessions, and a
// statement about its rows (a dead write, a drain's read) waits for that.
// The session loop owns it.
type visibility struct {
	pool *pgxpool.Pool
	// unseen are the transactions the stream read rows of that a snapshot
	// has not shown visible yet, oldest first.
	unseen []uint32
	waits  *atomic.Int64 // the relay's count of waits (tests)
}

// saw records that the stream read rows of transaction xid.
func (v *visibility) saw(xid uint32) {
	if n := len(v.unseen); n > 0 && v.unseen[n-1] == xid {
		return
	}
	v.unseen = append(v.unseen, xid)
}

// holdsBack reports whether tx parked a row behind a hold and is not
// known visible yet: the stream does not confirm it until it is, so that a
// session that ends before leaves it to the next session's stream, whose
// own drain then waits for it to be visible. A drain reads parked rows from
// the table, and a session's drain waits only for the transactions its own
// stream read (TestWALDrainInANewSessionWaitsForRowsParkedInvisible).
func (v *visibility) holdsBack(tx *txn) bool {
	if !tx.parked {
		return false
	}
	for _, x := range v.unseen {
		if x == tx.xid {
			return true
		}
	}
	return false
}

// heldBackVisible, at a status tick, asks whether the oldest unconfirmed
// transaction of txns, settled but held back (holdsBack), is visible now:
// true when the stream may confirm it.
func (v *visibility) heldBackVisible(ctx context.Context, txns []*txn, logger watermill.LoggerAdapter) bool {
	if len(txns) == 0 || !txns[0].committed || txns[0].pending > 0 || !v.holdsBack(txns[0]) {
		return false
	}
	ok, err := v.visible(ctx, txns[0].xid)
	if err != nil {
		logger.Error("Could not tell whether a transaction with parked rows is visible; asking again at the next tick", err, nil)
	}
	return err == nil && ok
}

// pruneBefore drops the unseen transactions older than xmin, the oldest
// transaction running in a snapshot: they are visible.
func (v *visibility) pruneBefore(xmin uint64) {
	kept := v.unseen[:0]
	for _, x := range v.unseen {
		if !precedes(x, xmin) {
			kept = append(kept, x)
		}
	}
	v.unseen = kept
}

// visible reports whether the transactions xids are visible to a new
// snapshot, or, with none given, every transaction the stream read rows
// of. It prunes the unseen transactions the snapshot shows visible; asked
// about none with none unseen, it asks the server nothing.
func (v *visibility) visible(ctx context.Context, xids ...uint32) (bool, error) {
	if len(xids) == 0 && len(v.unseen) == 0 {
		return true, nil
	}
	var text string
	if err := v.pool.QueryRow(ctx, `SELECT pg_current_snapshot()::text`).Scan(&text); err != nil {
		return false, fmt.Errorf("read a snapshot: %w", err)
	}
	snap, err := parseSnapshot(text)
	if err != nil {
		return false, err
	}
	kept := v.unseen[:0]
	for _, x := range v.unseen {
		if !snap.sees(x) {
			kept = append(kept, x)
		}
	}
	v.unseen = kept
	if len(xids) == 0 {
		return len(v.unseen) == 0, nil
	}
	for _, x := range xids {
		if !snap.sees(x) {
			return false, nil
		}
	}
	return true, nil
}

// waitVisible waits until transaction xid is visible, for a statement that
// the loop cannot put off (the read of a replayed row). It gives up with
// ctx.
func (v *visibility) waitVisible(ctx context.Context, xid uint32) error {
	for n := 0; ; n++ {
		ok, err := v.visible(ctx, xid)
		if err != nil || ok {
			return err
		}
		v.waits.Add(1)
		t := time.NewTimer(visibleDelay(n))
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("wait for a streamed transaction to be visible: %w", ctx.Err())
		case <-t.C:
		}
	}
}
