package subscriber

import (
	"context"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
)

// lockClass resolves, on the relay's first cut, the class of the writers'
// per-key locks: the table's OID (sqlq.LookupOrderingLockClass),
// which writers derive from the table as they name it, so that a writer
// naming it through its search_path and a relay naming it with its schema
// agree. The class stays for the relay's life (0 is no OID: not resolved).
// Only the relay's loop calls it.
func (r *orderedRelay) lockClass(ctx context.Context) error {
	if r.class != 0 {
		return nil
	}
	class, err := sqlq.LookupOrderingLockClass(ctx, r.s.pool, r.s.cfg.Table)
	if err != nil {
		return err
	}
	r.class = class
	return nil
}
