package schema

import (
	"strconv"
	"strings"

	"github.com/outboxkit/watermill-outbox/internal/pgmeta"
)

// Statements of the WAL relay (package walrelay): its publication, its
// logical replication slot and the few row writes it makes (a dead row, a
// progress record). Rows are still written by package publisher.

// WALSlotName is the default name of the logical replication slot (and of
// the publication) of table t: "outbox_" followed by the schema and table
// names, lower-cased, every other character than a-z, 0-9 and _ replaced by
// _, cut to 54 bytes and followed by 8 hex digits of the table's key, so
// that two tables never share a slot. Slot names allow at most 63 bytes of
// [a-z0-9_].
func WALSlotName(t Table) string {
	var b strings.Builder
	for _, r := range strings.ToLower(t.Qualified()) {
		if (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9') || r == '_' {
			b.WriteRune(r)
		} else {
			b.WriteByte('_')
		}
	}
	base := "outbox_" + b.String()
	if len(base) > 54 {
		base = base[:54]
	}
	return base + "_" + strconv.FormatUint(uint64(pgmeta.WALSlot(t.Qualified())), 16)
}

// WALProgressTable names the WAL relay's progress table of t (same schema,
// name plus "_wal"): per slot, the confirmed position and the transaction
// horizon below which every row was settled (docs/WAL.md, "Retention").
func (t Table) WALProgressTable() string { return t.companion("_wal") }
