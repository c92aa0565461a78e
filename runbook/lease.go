package runbook

import (
	"time"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/state"
)

// leaseTTL is the lease duration by which one operation judges whether a
// relay holds a row (leased less than it ago: a copy may be in a
// handler), read once per operation with the table's state reader r: the
// larger of the LockTTL the table relays recorded (schema.ModeRecord.LockTTL,
// written by the default or ordered relay that started last) and given,
// the caller's own (0: none). So no surface judges a lease shorter than
// the relays do, whatever it was configured with. With neither, it is
// sqlq.LockTTLDefault, the relays' default.
func leaseTTL(r state.Reader, given time.Duration) time.Duration {
	var recorded time.Duration
	if r.Record != nil {
		recorded = r.Record.LockTTL
	}
	if recorded == 0 && given == 0 {
		return sqlq.LockTTLDefault
	}
	return max(recorded, given)
}
