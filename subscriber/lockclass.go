package subscriber

import (
	"context"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/schema"
)

// lockClasses are the classes of the writers' per-key locks that the
// ordered relay's cut watches.
type lockClasses struct {
	// class is the table's OID (sqlq.LookupOrderingLockClass), which
	// writers derive from the table as they name it, so that a writer
	// naming it through its search_path and a relay naming it with its
	// schema agree; 0 until resolved.
	class int32
	// legacy is the class of writers of earlier versions
	// (sqlq.LegacyOrderingLockClass), watched beside class.
	legacy int32
}

// resolve looks the class up on the relay's first cut; it stays for the
// relay's life. Only the relay's loop calls it.
func (c *lockClasses) resolve(ctx context.Context, db schema.Querier, t schema.Table) error {
	if c.class != 0 {
		return nil
	}
	class, err := sqlq.LookupOrderingLockClass(ctx, db, t)
	if err != nil {
		return err
	}
	c.class = class
	return nil
}
