package schema

import (
	"errors"

	"github.com/jackc/pgx/v5"
)

// OrderingPartitions is the number of partitions the keyed rows of an
// ordered table are spread over (ordering_partition = hashtext(key) & 63).
// Relays own partitions by lease; a partition is the unit of handover.
const OrderingPartitions = 64

// MaxOrderingKeyBytes is the longest ordering key accepted, in bytes.
const MaxOrderingKeyBytes = 256

// Suffixes of the objects ordered mode adds; each fits within longestSuffix
// so that every name stays within PostgreSQL's identifier limit.
const (
	suffixKeyedByPartition = "_keyed_by_part"
	suffixKeyedByKey       = "_keyed_by_key"
	suffixPendingUnkeyed   = "_pending_unkeyed"
	suffixKeyLengthCheck   = "_ordering_key_len"
	suffixPartitions       = "_partitions"
	suffixRelays           = "_relays"
	suffixHolds            = "_holds"
	suffixHoldsByPartition = "_holds_by_part"
)

// companion names a companion table of t (same schema, name plus suffix).
func (t Table) companion(suffix string) string {
	if t.schema == "" {
		return pgx.Identifier{t.name + suffix}.Sanitize()
	}
	return pgx.Identifier{t.schema, t.name + suffix}.Sanitize()
}

// PartitionsTable names the table of partition leases and floors of ordered
// mode, sanitized for SQL (as do RelaysTable and HoldsTable for theirs).
func (t Table) PartitionsTable() string { return t.companion(suffixPartitions) }

// RelaysTable names the membership table of ordered relays.
func (t Table) RelaysTable() string { return t.companion(suffixRelays) }

// HoldsTable names the table of held keys (a failing, dead or skipped row
// that holds back its key).
func (t Table) HoldsTable() string { return t.companion(suffixHolds) }

// orderedColumnStatements add the ordering columns and their indexes to t.
func orderedColumnStatements(t Table) []string {
	tbl := t.Sanitize()
	return []string{
		`ALTER TABLE ` + tbl + ` ADD COLUMN IF NOT EXISTS ordering_key TEXT NULL
    CONSTRAINT ` + t.ident(suffixKeyLengthCheck) + ` CHECK (octet_length(ordering_key) BETWEEN 1 AND ` + itoa(MaxOrderingKeyBytes) + `),
  ADD COLUMN IF NOT EXISTS ordering_partition SMALLINT GENERATED ALWAYS AS ((hashtext(ordering_key) & ` + itoa(OrderingPartitions-1) + `)::smallint) STORED`,
		`CREATE INDEX IF NOT EXISTS ` + t.ident(suffixKeyedByPartition) + ` ON ` + tbl + ` (ordering_partition, sequence) WHERE ordering_key IS NOT NULL`,
		`CREATE INDEX IF NOT EXISTS ` + t.ident(suffixKeyedByKey) + ` ON ` + tbl + ` (ordering_key, sequence) WHERE ordering_key IS NOT NULL`,
		`CREATE INDEX IF NOT EXISTS ` + t.ident(suffixPendingUnkeyed) + ` ON ` + tbl + ` (available_at, sequence) WHERE published_at IS NULL AND ordering_key IS NULL`,
	}
}

// orderedCompanionStatements create the companion tables, idempotently.
func orderedCompanionStatements(t Table) []string {
	stmts := []string{
		`CREATE TABLE IF NOT EXISTS ` + t.PartitionsTable() + ` (
  partition      SMALLINT    NOT NULL,
  owner          TEXT        NULL,
  lease_until    TIMESTAMPTZ NULL,
  floor_sequence BIGINT      NOT NULL DEFAULT 0,
  CONSTRAINT ` + t.ident(suffixPartitions+suffixPkey) + ` PRIMARY KEY (partition)
)`,
		`INSERT INTO ` + t.PartitionsTable() + ` (partition) SELECT generate_series(0, ` + itoa(OrderingPartitions-1) + `) ON CONFLICT DO NOTHING`,
		`CREATE TABLE IF NOT EXISTS ` + t.RelaysTable() + ` (
  relay_id     TEXT        NOT NULL,
  heartbeat_at TIMESTAMPTZ NOT NULL DEFAULT now(),
  CONSTRAINT ` + t.ident(suffixRelays+suffixPkey) + ` PRIMARY KEY (relay_id)
)`,
		termStatement(t),
	}
	return append(stmts, holdsTableStatements(t)...)
}

// termStatement adds the partition lease's term (epoch) to a partitions
// table made by an older version, idempotently. Every acquisition of a
// partition starts a new term; the writes of progress and holds are fenced
// on it, so that nothing a relay did under an earlier lease of the same
// partition (its own included) is written after the lease ended.
func termStatement(t Table) string {
	return `ALTER TABLE ` + t.PartitionsTable() + ` ADD COLUMN IF NOT EXISTS epoch BIGINT NOT NULL DEFAULT 0`
}

// TermUpSQL returns the DDL that adds the partition lease's term to the
// partitions table of an ordered table t made by an older version
// (idempotent; the shipped migration 000006).
func termUpSQL(t Table) string { return termStatement(t) + ";\n" }

// TermDownSQL reverts TermUpSQL.
func termDownSQL(t Table) string {
	return `ALTER TABLE ` + t.PartitionsTable() + ` DROP COLUMN IF EXISTS epoch;` + "\n"
}

// holdsStateStatement adds the hold states of this version to a holds table
// made by an older one, idempotently: resolved_at marks a resolved hold (a
// tombstone: the key's rows up to its sequence are done, kept until the
// partition's written floor passes it) and replay marks an operator's
// replay of a row already relayed (delivered once more, covering nothing).
func holdsStateStatement(t Table) string {
	return `ALTER TABLE ` + t.HoldsTable() + ` ADD COLUMN IF NOT EXISTS resolved_at TIMESTAMPTZ NULL,
  ADD COLUMN IF NOT EXISTS replay BOOLEAN NOT NULL DEFAULT false`
}

// HoldsStateUpSQL returns the DDL that brings the holds table of an ordered
// table t made by an older version to this version's hold states
// (idempotent; the shipped migration 000005).
func holdsStateUpSQL(t Table) string { return holdsStateStatement(t) + ";\n" }

// HoldsStateDownSQL reverts HoldsStateUpSQL.
func holdsStateDownSQL(t Table) string {
	return `ALTER TABLE ` + t.HoldsTable() + ` DROP COLUMN IF EXISTS state, DROP COLUMN IF EXISTS resolved_at, DROP COLUMN IF EXISTS replay;` + "\n"
}

func orderedCompanionDrops(t Table) []string {
	return []string{
		`DROP TABLE IF EXISTS ` + t.HoldsTable(),
		`DROP TABLE IF EXISTS ` + t.RelaysTable(),
		`DROP TABLE IF EXISTS ` + t.PartitionsTable(),
	}
}

func orderedDownStatements(t Table) []string {
	return append(orderedCompanionDrops(t),
		`ALTER TABLE `+t.Sanitize()+` DROP COLUMN IF EXISTS ordering_partition, DROP COLUMN IF EXISTS ordering_key`)
}

// ErrRelayModeMix is matched (errors.Is) by the error of a relay that refuses
// to start, and of Migrate refusing to switch a table's mode, because relays
// of another mode work on the table: a default-mode relay would claim keyed
// rows out of their order, beside the ordered relays.
var ErrRelayModeMix = errors.New("relays of the other mode are active on the table")

func modeName(ordered bool) string {
	if ordered {
		return "an ordered-mode"
	}
	return "a default-mode"
}

// ErrKeysHeld is matched (errors.Is) by the error of a mode switch
// (SwitchMode, and so Migrate's WithMode, walrelay.Setup and a relay
// starting on a table of another mode) refused while a hold of any mode is
// open: a failing, dead or draining row that holds its key, whose later
// rows wait. The relay after the switch does not read the old mode's
// holds; resolve them first (replay or skip each held row with the old
// mode's relay running), then switch.
var ErrKeysHeld = errors.New("keys of the table are held")

// ErrSequenceCached is matched (errors.Is) by the error of an ordered relay
// or a WAL relay refusing to start when the table's sequence hands out values from a
// per-session cache (CACHE > 1): a session can then take a lower value
// after a higher one was committed, which breaks the cut of ordered mode
// and the WAL relay's order.
var ErrSequenceCached = errors.New("the outbox sequence has CACHE > 1")
