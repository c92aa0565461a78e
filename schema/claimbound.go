package schema

import (
	"context"
	"fmt"

	"github.com/outboxkit/watermill-outbox/internal/pgmeta"
)

// The default relay's bounded claim (docs/XMIN.md, option c) starts its
// index scan at a bound instead of at the oldest entry, so that the dead
// entries a pinned xmin horizon leaves behind are not walked by every
// claim. Its cut relies on every new row's available_at being taken after
// its writer holds the table's RowExclusiveLock: the column's default is
// clock_timestamp() (the time the row is formed) from migration 000009 on.
// The default of older tables, now(), is the writer's transaction start: a
// transaction that does its business work first and writes the outbox last
// would put its row below a bound taken meanwhile.

// availableAtStatement sets the default of available_at to
// pgmeta.ClaimBoundDefault: a change of the catalog only (no rewrite, no scan),
// under a short ACCESS EXCLUSIVE lock of the table.
func availableAtStatement(t Table) string {
	return `ALTER TABLE ` + t.Sanitize() + ` ALTER COLUMN available_at SET DEFAULT ` + pgmeta.ClaimBoundDefault
}

// AvailableAtUpSQL returns the DDL that makes available_at default to
// clock_timestamp() (migration 000009), which the default relay's bounded
// claim needs.
func availableAtUpSQL(t Table) string { return availableAtStatement(t) + ";\n" }

// AvailableAtDownSQL reverts AvailableAtUpSQL: relays then claim without a
// bound.
func availableAtDownSQL(t Table) string {
	return `ALTER TABLE ` + t.Sanitize() + ` ALTER COLUMN available_at SET DEFAULT now();` + "\n"
}

// availableAtDefaultOf returns the default expression of t's available_at
// column as PostgreSQL prints it ("now()", "clock_timestamp()").
func availableAtDefaultOf(ctx context.Context, q Querier, t Table) (string, error) {
	def, err := pgmeta.ColumnDefault(ctx, q, t.Sanitize(), "available_at")
	if err != nil {
		return "", fmt.Errorf("read the default of %s.available_at: %w", t, err)
	}
	return def, nil
}
