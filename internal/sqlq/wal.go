package sqlq

import (
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/outboxkit/watermill-outbox/internal/pgmeta"
	"github.com/outboxkit/watermill-outbox/schema"
)

// Statements of the WAL relay (package walrelay): its publication, its
// logical replication slot and the few row writes it makes (a dead row, a
// progress record). Rows are still written by package publisher.

// ValidSlotName reports whether name is a valid replication slot name.
func ValidSlotName(name string) bool {
	if name == "" || len(name) > 63 {
		return false
	}
	for _, r := range name {
		if (r < 'a' || r > 'z') && (r < '0' || r > '9') && r != '_' {
			return false
		}
	}
	return true
}

const (
	// WALLevel reads the server's wal_level.
	WALLevel = `SELECT current_setting('wal_level')`

	// WALPublicationExists tells whether publication $1 exists and
	// publishes table ($2, a regclass text) with inserts and updates.
	// Returns: exists, publishes the table, publishes inserts, publishes
	// updates, and the other tables it publishes (text array, at most 5:
	// the WAL relay refuses a publication of other tables).
	WALPublicationExists = `SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1),
  EXISTS (SELECT 1 FROM pg_publication_rel AS r JOIN pg_publication AS p ON p.oid = r.prpubid WHERE p.pubname = $1 AND r.prrelid = $2::regclass),
  COALESCE((SELECT pubinsert FROM pg_publication WHERE pubname = $1), false),
  COALESCE((SELECT pubupdate FROM pg_publication WHERE pubname = $1), false),
  ARRAY(SELECT format('%I.%I', pt.schemaname, pt.tablename) FROM pg_publication_tables AS pt
    WHERE pt.pubname = $1 AND format('%I.%I', pt.schemaname, pt.tablename)::regclass <> $2::regclass ORDER BY 1 LIMIT 5)`

	// WALTableOID is the OID of table $1 (regclass text), the relation id
	// the replication stream names its rows by.
	WALTableOID = `SELECT $1::regclass::oid`

	// WALPublished tells whether table $1 (regclass text) is named in a
	// publication: a table the WAL relay streams. The runbook then treats
	// keyed rows as the WAL relay does (no partitions, no holds table).
	WALPublished = `SELECT EXISTS (SELECT 1 FROM pg_publication_rel WHERE prrelid = to_regclass($1))`

	// WALSlotState reads slot $1: exists, its plugin, whether a walsender
	// uses it, its confirmed_flush_lsn (text), and whether the server
	// invalidated it (wal_status = 'lost'). Returns no row when the slot
	// does not exist.
	WALSlotState = `SELECT plugin, active, COALESCE(confirmed_flush_lsn::text, ''), COALESCE(wal_status = 'lost', false)
FROM pg_replication_slots WHERE slot_name = $1`

	// WALCreateSlot creates logical replication slot $1 with pgoutput. It
	// must run outside a transaction that wrote anything.
	WALCreateSlot = `SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')`

	// WALDropSlot drops slot $1 when it exists.
	WALDropSlot = `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1`

	// WALSlotLag reads how far slot $1 is behind: the retained WAL in
	// bytes (current WAL position minus restart_lsn) and the bytes not yet
	// confirmed (current position minus confirmed_flush_lsn). Returns no row
	// when the slot does not exist.
	WALSlotLag = `SELECT COALESCE(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn), 0)::float8,
  COALESCE(pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn), 0)::float8
FROM pg_replication_slots WHERE slot_name = $1`
)

// WALCreateProgressTable creates the progress table of t.
func WALCreateProgressTable(t schema.Table) string {
	return `CREATE TABLE IF NOT EXISTS ` + t.WALProgressTable() + ` (
  slot          TEXT        NOT NULL PRIMARY KEY,
  confirmed_lsn PG_LSN      NOT NULL,
  horizon       XID8        NULL,
  updated_at    TIMESTAMPTZ NOT NULL DEFAULT now()
)`
}

// WALCreateHoldsTable creates the holds table of t (schema.HoldsTableSQL:
// the one holds table both keyed modes share), or brings one made by an
// older version to this version's shape: statements for a call without
// arguments (simple protocol) or a script.
func WALCreateHoldsTable(t schema.Table) string { return schema.HoldsTableSQL(t) }

// WALAddSkippedAt adds skipped_at to the keyed table t (the ALTER of
// migration 000012, pgmeta.SkippedAt), where the WAL relay records a skip;
// walrelay.Setup runs it when the column is missing. Not the backfill of
// the migration: no WAL relay wrote the old last_error text, and the rows
// an ordered relay wrote it on were marked published when the table was
// switched to the WAL relay.
func WALAddSkippedAt(t schema.Table) string { return pgmeta.SkippedAt(t.Sanitize())[0] }

// WALMoveLegacyHolds copies the holds of <table>_wal_holds, where WAL
// relays of older versions kept them, into the holds table (mode wal; a
// hold of a key replaces only a resolved hold of it, never an open one of
// ordered mode), in one transaction after WALCreateHoldsTable, which then
// drops the old table when every hold was copied. An old hold is dead
// unless its row was spilled (retrying) or an operator's replay reset its
// row (replay). Returns: holds copied, holds in the old table.
func WALMoveLegacyHolds(t schema.Table) string {
	legacy := LegacyWALHoldsTable(t)
	spilled := `COALESCE((to_jsonb(w) ->> 'retrying')::boolean, false)`
	replayed := `EXISTS (SELECT 1 FROM ` + t.Sanitize() + ` AS o WHERE o.event_id = w.event_id AND o.published_at IS NULL AND o.dead_at IS NULL)`
	return `WITH moved AS (
INSERT INTO ` + t.HoldsTable() + ` AS h (mode, ordering_key, partition, sequence, event_id, draining, skip_requested_at, created_at,
  through, resolved_at, until_lsn, spilled, dead_at, replay)
SELECT 'wal', w.ordering_key, ` + partitionOf("w.ordering_key") + `, w.sequence, w.event_id, w.draining, w.skip_requested_at, w.held_at,
  w.through, CASE WHEN w.released THEN now() END, w.until_lsn, ` + spilled + `,
  CASE WHEN NOT ` + spilled + ` AND NOT ` + replayed + ` THEN w.held_at END,
  NOT ` + spilled + ` AND ` + replayed + `
FROM ` + legacy + ` AS w
ON CONFLICT (ordering_key) DO UPDATE SET mode = 'wal', partition = EXCLUDED.partition, sequence = EXCLUDED.sequence, event_id = EXCLUDED.event_id,
  attempts = 0, available_at = now(), last_error = NULL, draining = EXCLUDED.draining, skip_requested_at = EXCLUDED.skip_requested_at,
  created_at = EXCLUDED.created_at, through = EXCLUDED.through, resolved_at = EXCLUDED.resolved_at, until_lsn = EXCLUDED.until_lsn,
  spilled = EXCLUDED.spilled, dead_at = EXCLUDED.dead_at, replay = EXCLUDED.replay
WHERE h.resolved_at IS NOT NULL OR h.mode = 'wal'
RETURNING 1
)
SELECT (SELECT count(*) FROM moved), (SELECT count(*) FROM ` + legacy + `)`
}

// LegacyWALHoldsTable names the table (name plus "_wal_holds") in which
// the WAL relay of versions before the one holds table kept its holds;
// walrelay.Setup moves them into schema.Table.HoldsTable and drops it.
func LegacyWALHoldsTable(t schema.Table) string {
	if t.Schema() == "" {
		return pgx.Identifier{t.Name() + "_wal_holds"}.Sanitize()
	}
	return pgx.Identifier{t.Schema(), t.Name() + "_wal_holds"}.Sanitize()
}

// partitionOf is the partition of the ordering key expression key, as the
// outbox table's generated ordering_partition computes it: a hold written
// by the WAL relay carries it as the ordered relay's do.
func partitionOf(key string) string {
	return `(hashtext(` + key + `) & ` + strconv.Itoa(schema.OrderingPartitions-1) + `)::smallint`
}

// WALHoldsReady tells whether t is ready for the WAL relay's holds: the
// holds table has this version's shape, and no table of older versions'
// holds (<table>_wal_holds) is left. Returns: holds table shaped, legacy
// table exists, skipped_at exists (holdsShape, as ModeProbe reads them).
func WALHoldsReady(t schema.Table) string {
	return `SELECT ` + holdsShape(t)
}

// holdsShape is the select list of three facts about t's holds: the holds
// table has this version's shape (its generated state column), the table
// of a WAL relay of an older version (<table>_wal_holds) exists, and t has
// skipped_at (migration 000012), where a skip is recorded on the row.
func holdsShape(t schema.Table) string {
	return `EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass(` + quoteLiteral(t.HoldsTable()) + `) AND attname = 'state' AND NOT attisdropped),
  to_regclass(` + quoteLiteral(LegacyWALHoldsTable(t)) + `) IS NOT NULL,
  ` + skippedAtExists(t)
}

// skippedAtExists is the condition that t has skipped_at (migration
// 000012), which the keyed relays write when they apply a skip and every
// reader of a keyed table reads.
func skippedAtExists(t schema.Table) string {
	return `EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass(` + quoteLiteral(t.Sanitize()) + `) AND attname = 'skipped_at' AND NOT attisdropped)`
}

// WALSkippedAtExists tells whether t has skipped_at (migration 000012).
// Args: none. Returns: exists.
func WALSkippedAtExists(t schema.Table) string { return `SELECT ` + skippedAtExists(t) }

// walSkipRow is what the WAL relay writes on a row when it marks it
// skipped (Drain, MarkSkipped): skipped, not dead, and its retention,
// available_at, counted from the skip.
const walSkipRow = `skipped_at = now(), dead_at = NULL, available_at = now(), locked_at = NULL`

// WALProgressTableExists tells whether t has a progress table: t is
// relayed by the WAL relay. Args: none. Returns: exists.
func WALProgressTableExists(t schema.Table) string {
	return `SELECT to_regclass(` + quoteLiteral(t.WALProgressTable()) + `) IS NOT NULL`
}

// WALProgressBeforeSetup records, for slot $1 when it has no progress
// record yet, the position $2 (text: the slot's start minus one, see
// WALBackfill) and no horizon: the relay's first session finds its slot
// just ahead of the record and delivers first, from the table, the rows
// the slot never streamed (those written before Setup), as after a lost
// slot. Until the relay records a horizon, no row counts as streamed (the
// cleaner deletes none).
func WALProgressBeforeSetup(t schema.Table) string {
	return `INSERT INTO ` + t.WALProgressTable() + ` (slot, confirmed_lsn) VALUES ($1, $2::pg_lsn) ON CONFLICT (slot) DO NOTHING`
}

// WALCommitTimestamps reads whether the server tracks commit timestamps
// (track_commit_timestamp): then WALBackfill can read unkeyed rows in
// commit order.
const WALCommitTimestamps = `SELECT current_setting('track_commit_timestamp')::bool`

// WALBackfill reads the rows of t that slot $1 never streamed, for the
// relay to deliver before its stream, with the columns ClaimedRow.ScanKeyed
// reads (ordering_key NULL without the column): the rows not published and
// not dead and, after a lost slot (beforeSetup false), not below the
// slot's recorded horizon (every such row when none was recorded); at the
// first start after Setup (beforeSetup), those created up to Setup's
// progress record (the rows written later were streamed; a later record
// of a session that did not finish the backfill only widens the read).
//
// Order: keyed rows by sequence (keyed writers serialise per key, so that
// is their commit order within a key). Unkeyed rows are ordered by topic,
// where sequence order need not be commit order (unkeyed writers do not
// serialise): with commitTimestamps (the server's track_commit_timestamp)
// they are read in the order of their transactions' commit timestamps,
// then by sequence (rows of one transaction, or older than the tracking);
// without it, by sequence.
func WALBackfill(t schema.Table, c schema.Columns, beforeSetup, commitTimestamps bool) string {
	cols := walClaimColumns(c)
	key := `NULL::text`
	unkeyed := `true`
	if c.OrderingKey {
		key = `ordering_key`
		unkeyed = `(o.ordering_key IS NULL OR o.ordering_key = '')`
	}
	prog := t.WALProgressTable()
	bound := `NOT COALESCE(age(o.xmin) > (SELECT age((horizon::text::numeric % 4294967296)::text::xid) FROM ` + prog + ` WHERE slot = $1), false)`
	if beforeSetup {
		bound = `o.created_at <= (SELECT updated_at FROM ` + prog + ` WHERE slot = $1)`
	}
	order := `ORDER BY sequence`
	if commitTimestamps {
		order = `ORDER BY CASE WHEN ` + unkeyed + ` THEN pg_xact_commit_timestamp(o.xmin) END NULLS FIRST, sequence`
	}
	return `SELECT ` + cols + `, ` + key + ` FROM ` + t.Sanitize() + ` AS o
WHERE published_at IS NULL AND dead_at IS NULL` + notSkipped(c) + `
  AND ` + bound + `
` + order
}

// notSkipped is the condition, appended to a WHERE clause on a row of a
// table with columns c, that the row was not skipped: a keyed table's
// skipped row (skipped_at) is done, never delivered again unless replayed.
// A table without ordering_key has no skips.
func notSkipped(c schema.Columns) string {
	if !c.OrderingKey {
		return ``
	}
	return ` AND skipped_at IS NULL`
}

// walClaimColumns are the columns ClaimedRow.Scan reads, for a table with
// columns c.
func walClaimColumns(c schema.Columns) string {
	cols := `id::text, event_id::text, tenant_id::text, topic, payload::text, sequence, attempts, COALESCE(locked_at, now()), created_at`
	if c.TraceContext {
		cols += `, traceparent, tracestate`
	}
	if c.Headers {
		cols += `, headers::text`
	}
	return cols
}

// WALProgressRecorded tells whether slot $1 has a progress record in t's
// progress table (it streamed before).
func WALProgressRecorded(t schema.Table) string {
	return `SELECT EXISTS (SELECT 1 FROM ` + t.WALProgressTable() + ` WHERE slot = $1)`
}

// WALCreatePublication creates publication name for table t, publishing
// inserts (new events) and updates (a replay resets a row with an UPDATE).
func WALCreatePublication(name string, t schema.Table) string {
	return `CREATE PUBLICATION ` + pgx.Identifier{name}.Sanitize() + ` FOR TABLE ` + t.Sanitize() + ` WITH (publish = 'insert, update')`
}

// WALDropPublication drops publication name when it exists.
func WALDropPublication(name string) string {
	return `DROP PUBLICATION IF EXISTS ` + pgx.Identifier{name}.Sanitize()
}

// WALFenceKey is the advisory lock key of slot's write fence (see
// WALQueries): the relay's writes take it shared, a new session takes and
// releases it exclusively (WALFenceHandover) before it loads the holds.
func WALFenceKey(slot string) int64 {
	return pgmeta.WALFence(slot)
}

// WALFenceHandover waits until every fenced write of the sessions before
// the caller's has committed or rolled back: it takes and releases the
// slot's fence lock ($1, WALFenceKey) exclusively. A new session runs it
// once it holds the slot, before it reads the holds.
const WALFenceHandover = `SELECT pg_advisory_xact_lock($1::bigint)`

// walFence is the fence of the WAL relay's writes, a CTE named f with one
// column ok: the write applies only if the replication session that makes
// it still holds the slot ($n slot name, $n+1 the session's walsender pid,
// its pgconn PID, $n+2 WALFenceKey). It takes the slot's fence lock shared
// first (CASE evaluates its condition first), so a new session's
// WALFenceHandover waits for a write that passed the check.
func walFence(n int) string {
	a, b, c := strconv.Itoa(n), strconv.Itoa(n+1), strconv.Itoa(n+2)
	return `f AS MATERIALIZED (SELECT CASE WHEN pg_advisory_xact_lock_shared($` + c + `::bigint) IS NULL THEN false
  ELSE EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $` + a + `::text AND active_pid = $` + b + `::int) END AS ok)`
}

// WALQueries are the row statements of the WAL relay for one table. Every
// write (MarkDeadHold, Spill, Progress, Drain, RetryDrain, Release,
// Forget) is fenced by the
// relay's replication session: it takes three more arguments after its
// own, the slot name, the session's walsender pid and WALFenceKey of the
// slot, applies only while that walsender holds the slot, and returns one
// more column, last: whether the fence let it apply (docs/WAL.md,
// "Sessions are terms").
type WALQueries struct {
	// MarkDead parks row $1 (id) dead: attempts $2, last_error $3,
	// dead_at = now(), available_at = 'infinity', unless it was published or
	// already reset by a replay in the meantime (attempts changed). Its
	// UPDATE reaches the relay's stream and is ignored there (dead_at set).
	MarkDead string
	// Progress records the relay's position and, when $3 is not NULL, a
	// new horizon for slot $1: confirmed_lsn $2 (text), horizon $3 (xid8
	// text; it never moves back). In the same statement it reads the next
	// horizon candidate: the oldest transaction still running now
	// (pg_snapshot_xmin) and the WAL insert position after it. Once the
	// relay has confirmed that position, every transaction older than that
	// xid has been streamed and settled. Returns: the candidate xid8 (text)
	// and WAL position (text), fence ok (the record was written).
	Progress string
	// MarkDeadHold is MarkDead ($1 id, $2 attempts, $3 last_error) that,
	// for a keyed row ($4 its ordering key), also holds the key: a hold
	// (the key, the row's sequence and event_id) replaces a resolved hold
	// of the key or one at or below the row (a retrying hold of the row
	// itself among them), never an active hold of a later row (that row
	// stays the one that holds the key). Returns: rows changed, holds
	// written, fence ok.
	MarkDeadHold string
	// MarkSkipped records the nack of row $1 (id) whose hold's skip was
	// applied while the copy was in a handler: attempts $2, last_error
	// $3, skipped (skipped_at), not dead; it holds nothing. Returns: rows
	// changed, 0, fence ok (the columns of MarkDeadHold).
	MarkSkipped string
	// Spill holds the key $2 of row $1 (id), which failed and waits for
	// its retry, with a retrying hold (the key, the row's sequence and
	// event_id, retrying), so that the relay can drop the key's queued rows
	// from memory: they are in the table, parked behind the hold. $3 is a
	// sequence up to which the stream's copies of the key's rows are parked
	// (through, never moved back), $4 the row's attempts and $5 its
	// last_error, written on the row (not published, not dead) in the same
	// statement (its UPDATE, attempts above 0, is not a replay). The hold
	// replaces a resolved, draining or retrying hold of the key at or
	// below the row, never a dead one; the row is written only with its
	// hold. Returns: holds written, fence ok.
	Spill string
	// Holds lists the holds: key, sequence, draining, skip requested,
	// through, released, until_lsn (text, '' when NULL), retrying.
	Holds string
	// Drain marks the hold of key $1 at sequence $2 as draining (its held
	// row was delivered again or skipped: it is no longer retrying; when a
	// skip was requested the held row is marked skipped, whatever its
	// attempts), with
	// $3 the last sequence its drain read (through never moves back) and
	// $4 (text) the WAL position after that read. Returns: holds changed,
	// fence ok.
	Drain string
	// RetryDrain is Drain for the retry of a retrying hold: the drain
	// delivers the held row first, then the rows behind it; the hold stays
	// retrying (a relay that restarts drains from the held row again). It
	// changes nothing when a skip was requested (the relay then applies
	// the skip with Drain). Returns: holds changed, fence ok.
	RetryDrain string
	// Parked reads the rows of key $1 after sequence $2 that are not
	// published and not dead, in sequence order, at most $3 of them: what
	// a hold kept back, in bounded batches. The columns
	// ClaimedRow.ScanKeyed reads.
	Parked string
	// Release turns the drained hold of key $1 at sequence $2 into a
	// tombstone: released, through $3 (the stream's copies of the rows up
	// to it were delivered by the drain, or skipped, and are parked),
	// kept until the relay confirms until_lsn. Returns: holds changed,
	// fence ok.
	Release string
	// Forget deletes the tombstone of key $1 at sequence $2. Returns: holds
	// deleted, fence ok.
	Forget string
	// InsertPosition reads the WAL insert position (text).
	InsertPosition string
	// Start reads, for slot $1, its confirmed_flush_lsn (text, '' when the
	// slot is gone) and the confirmed position the relay last recorded in
	// the progress table (text, '' when none). A slot ahead of the record
	// was recreated: the rows between were never streamed.
	Start string
	// Unsettled reads, in sequence order, the rows not published, not dead
	// and not below the slot's recorded horizon (every such row when no
	// horizon was recorded): what a recreated slot did not stream. The
	// columns ClaimedRow.ScanKeyed reads (ordering_key NULL without the
	// column). It is WALBackfill(t, c, false, false); the relay runs
	// WALBackfill itself.
	Unsettled string
	// Row reads row $1 (id) as a claim does (the columns of
	// ClaimedRow.Scan), for a replay whose UPDATE did not carry every
	// column (an unchanged TOASTed payload) and for every replay of a
	// keyed row; no row when it is gone, published, dead again or skipped.
	Row string
}

// NewWALQueries renders the WAL relay's row statements for table t with
// columns c. Without the ordering_key column no key is ever held: the hold
// statements (MarkDeadHold, MarkSkipped, Holds, Drain, Release, Forget, Spill,
// RetryDrain) are empty.
func NewWALQueries(t schema.Table, c schema.Columns) WALQueries {
	tbl := t.Sanitize()
	cols := walClaimColumns(c)
	prog := t.WALProgressTable()
	holds := t.HoldsTable()
	q := WALQueries{
		InsertPosition: `SELECT pg_current_wal_insert_lsn()::text`,
		Start: `SELECT COALESCE((SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1), ''),
  COALESCE((SELECT confirmed_lsn::text FROM ` + prog + ` WHERE slot = $1), '')`,
		Unsettled: WALBackfill(t, c, false, false),
		Progress: `WITH ` + walFence(4) + `, up AS (
  INSERT INTO ` + prog + ` AS p (slot, confirmed_lsn, horizon, updated_at) SELECT $1, $2::pg_lsn, $3::xid8, now() WHERE (SELECT ok FROM f)
  ON CONFLICT (slot) DO UPDATE SET confirmed_lsn = GREATEST(p.confirmed_lsn, EXCLUDED.confirmed_lsn), updated_at = now(),
    horizon = CASE WHEN EXCLUDED.horizon IS NULL THEN p.horizon WHEN p.horizon IS NULL THEN EXCLUDED.horizon ELSE GREATEST(p.horizon, EXCLUDED.horizon) END
)
SELECT pg_snapshot_xmin(pg_current_snapshot())::text, pg_current_wal_insert_lsn()::text, (SELECT ok FROM f)`,
		MarkDead: `UPDATE ` + tbl + ` SET attempts = $2, last_error = $3, dead_at = now(), available_at = 'infinity', locked_at = NULL
WHERE id = $1::uuid AND published_at IS NULL AND dead_at IS NULL`,
		Row: `SELECT ` + cols + ` FROM ` + tbl + ` WHERE id = $1::uuid AND published_at IS NULL AND dead_at IS NULL` + notSkipped(c),
	}
	if !c.OrderingKey {
		return q
	}
	// A hold the WAL relay writes replaces only the ordered relay's
	// tombstone of its key (a switch is refused while the other mode holds
	// keys) and takes the mode wal.
	q.MarkDeadHold = `WITH ` + walFence(5) + `, d AS (
  UPDATE ` + tbl + ` SET attempts = $2, last_error = $3, dead_at = now(), available_at = 'infinity', locked_at = NULL
  WHERE id = $1::uuid AND published_at IS NULL AND dead_at IS NULL AND skipped_at IS NULL AND (SELECT ok FROM f)
  RETURNING sequence, event_id
), h AS (
  INSERT INTO ` + holds + ` AS h (mode, ordering_key, partition, sequence, event_id, dead_at)
  SELECT 'wal', $4::text, ` + partitionOf("$4::text") + `, sequence, event_id, now() FROM d WHERE $4::text IS NOT NULL
  ON CONFLICT (ordering_key) DO UPDATE SET mode = 'wal', sequence = EXCLUDED.sequence, event_id = EXCLUDED.event_id, draining = false,
    skip_requested_at = NULL, created_at = now(), resolved_at = NULL, until_lsn = NULL, spilled = false, dead_at = now(), replay = false
  WHERE h.resolved_at IS NOT NULL OR (h.mode = 'wal' AND h.sequence <= EXCLUDED.sequence)
  RETURNING 1
)
SELECT (SELECT count(*) FROM d), (SELECT count(*) FROM h), (SELECT ok FROM f)`
	q.Holds = `SELECT ordering_key, sequence, draining, skip_requested_at IS NOT NULL, through, resolved_at IS NOT NULL, COALESCE(until_lsn::text, ''), spilled
FROM ` + holds + ` WHERE mode = 'wal'`
	// A drain that applies a skip marks the held row skipped: not dead,
	// never delivered again; the cleaner deletes it like a delivered row
	// (available_at, from which its retention counts, is the skip's time).
	// A skip is final once applied, whatever came before it: the row is
	// marked whatever its attempts (a replay reset them to 0, and the
	// relay may not have read that replay yet: the stream then reads the
	// row from the table and drops it), and a copy of it still in a
	// handler changes nothing (its nack's MarkSkipped finds it skipped).
	q.Drain = `WITH ` + walFence(5) + `, u AS (
  UPDATE ` + holds + ` SET draining = true, through = GREATEST(through, $3), until_lsn = $4::pg_lsn, spilled = false
  WHERE ordering_key = $1 AND sequence = $2 AND mode = 'wal' AND resolved_at IS NULL AND (SELECT ok FROM f) RETURNING 1
), s AS (
  UPDATE ` + tbl + ` AS o SET ` + walSkipRow + ` FROM ` + holds + ` AS h
  WHERE h.ordering_key = $1 AND h.sequence = $2 AND h.mode = 'wal' AND h.resolved_at IS NULL AND h.skip_requested_at IS NOT NULL
    AND o.event_id = h.event_id AND o.published_at IS NULL AND o.skipped_at IS NULL AND EXISTS (SELECT 1 FROM u)
)
SELECT (SELECT count(*) FROM u), (SELECT ok FROM f)`
	q.MarkSkipped = `WITH ` + walFence(4) + `, d AS (
  UPDATE ` + tbl + ` SET attempts = $2, last_error = $3, ` + walSkipRow + `
  WHERE id = $1::uuid AND published_at IS NULL AND dead_at IS NULL AND skipped_at IS NULL AND (SELECT ok FROM f)
  RETURNING 1
)
SELECT (SELECT count(*) FROM d), 0, (SELECT ok FROM f)`
	q.Parked = `SELECT ` + cols + `, ordering_key FROM ` + tbl + ` WHERE ordering_key = $1 AND sequence > $2 AND published_at IS NULL AND dead_at IS NULL AND skipped_at IS NULL
ORDER BY sequence LIMIT $3::int`
	q.Release = `WITH ` + walFence(4) + `, u AS (
  UPDATE ` + holds + ` SET resolved_at = now(), draining = false, spilled = false, through = GREATEST(through, $3)
  WHERE ordering_key = $1 AND sequence = $2 AND mode = 'wal' AND (SELECT ok FROM f) RETURNING 1
)
SELECT (SELECT count(*) FROM u), (SELECT ok FROM f)`
	q.Forget = `WITH ` + walFence(3) + `, u AS (
  DELETE FROM ` + holds + ` WHERE ordering_key = $1 AND sequence = $2 AND mode = 'wal' AND resolved_at IS NOT NULL AND (SELECT ok FROM f) RETURNING 1
)
SELECT (SELECT count(*) FROM u), (SELECT ok FROM f)`
	q.Spill = `WITH ` + walFence(6) + `, h AS (
  INSERT INTO ` + holds + ` AS h (mode, ordering_key, partition, sequence, event_id, spilled, through)
  SELECT 'wal', $2::text, ` + partitionOf("$2::text") + `, o.sequence, o.event_id, true, $3::bigint FROM ` + tbl + ` AS o
  WHERE o.id = $1::uuid AND o.published_at IS NULL AND o.dead_at IS NULL AND o.skipped_at IS NULL AND (SELECT ok FROM f)
  ON CONFLICT (ordering_key) DO UPDATE SET mode = 'wal', sequence = EXCLUDED.sequence, event_id = EXCLUDED.event_id, spilled = true, draining = false,
    skip_requested_at = NULL, created_at = now(), resolved_at = NULL, until_lsn = NULL, dead_at = NULL, replay = false,
    through = CASE WHEN h.mode = 'wal' THEN GREATEST(h.through, EXCLUDED.through) ELSE EXCLUDED.through END
  WHERE (h.mode <> 'wal' AND h.resolved_at IS NOT NULL)
    OR (h.mode = 'wal' AND (h.resolved_at IS NOT NULL OR h.draining OR h.spilled) AND h.sequence <= EXCLUDED.sequence)
  RETURNING 1
), d AS (
  UPDATE ` + tbl + ` SET attempts = $4, last_error = $5 WHERE id = $1::uuid AND EXISTS (SELECT 1 FROM h)
)
SELECT (SELECT count(*) FROM h), (SELECT ok FROM f)`
	q.RetryDrain = `WITH ` + walFence(5) + `, u AS (
  UPDATE ` + holds + ` SET draining = true, through = GREATEST(through, $3), until_lsn = $4::pg_lsn
  WHERE ordering_key = $1 AND sequence = $2 AND mode = 'wal' AND spilled AND resolved_at IS NULL AND skip_requested_at IS NULL AND (SELECT ok FROM f) RETURNING 1
)
SELECT (SELECT count(*) FROM u), (SELECT ok FROM f)`
	return q
}

// WALStaleAfter is how old the newest progress record of a WAL table may
// be for the cleaner to trust its horizon: past it (no relay is active) the
// cleaner deletes no WAL-relayed row.
const WALStaleAfter = "10 minutes"

// WALSkipHold asks the WAL relay to skip the dead row $1 (event_id text)
// that holds its key (the relay's tests use it; the runbook uses
// WALSkipHoldIn, which applies the hold's rules): the relay then delivers
// the key's later rows and marks the row skipped. Returns: the key and the sequence, no row when the event
// holds no key (or its hold drains already).
func WALSkipHold(t schema.Table) string {
	return `UPDATE ` + t.HoldsTable() + ` SET skip_requested_at = now()
WHERE event_id = $1::uuid AND mode = 'wal' AND NOT draining AND resolved_at IS NULL RETURNING ordering_key, sequence`
}
