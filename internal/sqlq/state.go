package sqlq

import (
	"strconv"
	"strings"

	"github.com/outboxkit/watermill-outbox/internal/pgmeta"
	"github.com/outboxkit/watermill-outbox/schema"
)

// StateQueries renders, for one table in one mode, the statements that say
// which rows are delivered, pending, retrying, dead, held or waiting behind
// a held key. It is the one place that knows each mode's state: the
// runbook's Stats, Backlog, Dead, Topics and Event, the cleaner's rules for
// keyed and streamed rows, and the relay's gauges read through
// it, so that they cannot disagree.
//
// Every statement classifies rows with the same expressions (classified);
// the row columns it returns are StateColumns.
type StateQueries struct {
	// schema.Table is the outbox table.
	Table schema.Table
	// schema.Mode is the table's relay mode.
	Mode schema.Mode
	// schema.Columns are the table's optional columns; OrderingKey decides whether
	// keyed rows exist (an ordered table always has it; a WAL table may
	// not).
	Columns schema.Columns
}

// NewStateQueries returns the state statements of t relayed in mode m, with
// optional columns c.
func NewStateQueries(t schema.Table, m schema.Mode, c schema.Columns) StateQueries {
	if m == schema.ModeOrdered {
		c.OrderingKey = true
	}
	return StateQueries{Table: t, Mode: m, Columns: c}
}

// StateColumns is the select list of the row statements of StateQueries
// (Backlog, Dead, Event), over a classified relation s: sequence, event_id
// (text), topic, tenant_id (text), attempts, created_at, available_at (NULL
// when dead), locked_at, published_at, last_error, dead_at, ordering_key
// (NULL when unkeyed), done (delivered or skipped), skipped, held (the row
// its key waits for), behind (the sequence of the held row it waits behind,
// NULL when none), skip requested, replay (an operator's replay of a row
// already relayed is due).
//
// For a keyed row of an ordered table that holds its key or whose replay
// is due (a replay hold), attempts, available_at, last_error and dead_at
// are the hold's.
const StateColumns = "s.sequence, s.event_id::text, s.topic, s.tenant_id::text, s.attempts, s.created_at, s.available_at, s.locked_at, s.published_at, s.last_error, s.dead_at, " +
	"s.ordering_key, s.done, s.skipped, s.held, s.behind, s.skip_requested, s.replay"

// keyExpr is the row's ordering key, or NULL without the column.
func (q StateQueries) keyExpr() string {
	if q.Columns.OrderingKey {
		return "o.ordering_key"
	}
	return "NULL::text"
}

// walHorizonAge is the age of the oldest horizon every slot of the table
// recorded within WALStaleAfter; NULL (nothing counts as streamed) when a
// slot has none or recorded nothing lately. The same rule as the cleaner's
// (docs/WAL.md, "Retention").
func (q StateQueries) walHorizonAge() string {
	return `(SELECT age((min(horizon)::text::numeric % 4294967296)::text::xid) FROM ` + q.Table.WALProgressTable() + `
    HAVING count(*) > 0 AND bool_and(horizon IS NOT NULL AND updated_at > now() - interval '` + WALStaleAfter + `'))`
}

// walParked is the condition, on a row o and its key's WAL hold w (LEFT
// JOIN, NULL when none), that o is parked behind the key's held row: the
// hold is not released and o comes after the held row, or o is the held
// row of a retrying hold (not dead: the relay delivers it from the table
// at its retry).
var walParked = `COALESCE(w.resolved_at IS NULL AND (o.sequence > w.sequence OR (o.sequence = w.sequence AND w.spilled)), false)`

// walHoldJoin joins a row o to its key's WAL hold w, or to nothing when
// the table has no ordering column.
func (q StateQueries) walHoldJoin() string {
	if q.Columns.OrderingKey {
		return `LEFT JOIN ` + q.Table.HoldsTable() + ` AS w ON w.ordering_key = o.ordering_key AND w.mode = 'wal'`
	}
	return `LEFT JOIN (SELECT NULL::text AS ordering_key, NULL::bigint AS sequence, NULL::uuid AS event_id, NULL::timestamptz AS resolved_at,
    NULL::boolean AS spilled, NULL::timestamptz AS skip_requested_at WHERE false) AS w ON false`
}

// DeleteStreamed deletes, in a WAL table, up to a batch ($2) of the rows
// the WAL relay delivered (Stats' streamed: not published, not dead,
// written before the horizon every slot recorded within WALStaleAfter) and
// written more than $1 seconds ago (by available_at, which the WAL relay
// never updates), never a row parked behind a held key, however long the
// key has been held. It replaces WALDeleteSettled, which ignores the holds.
func (q StateQueries) DeleteStreamed() string {
	tbl := q.Table.Sanitize()
	return `WITH victims AS (
  SELECT o.id FROM ` + tbl + ` AS o
  ` + q.walHoldJoin() + `
  WHERE o.published_at IS NULL AND o.dead_at IS NULL AND o.available_at < now() - make_interval(secs => $1::float8)
    AND age(o.xmin) > ` + q.walHorizonAge() + ` AND NOT ` + walParked + `
  LIMIT $2 FOR UPDATE OF o SKIP LOCKED
)
DELETE FROM ` + tbl + ` AS o USING victims WHERE o.id = victims.id`
}

// DeleteDead deletes up to a batch ($2) of the dead rows that died (dead_at)
// more than $1 seconds ago (the cleaner's dead retention), never the row a
// held key waits for: a held key waits for an operator's replay or skip in
// every mode, so no retention deletes its row from under it. In ordered mode
// a held row's dead_at is the hold's, so the rows with dead_at set are
// unheld already; the WAL relay's dead held row is its hold's (event_id).
// Never a skipped row (skipped_at): it is done, not dead, whatever its
// dead_at says, and only DeleteSkipped deletes it.
func (q StateQueries) DeleteDead() string {
	tbl := q.Table.Sanitize()
	held := ``
	if q.Mode == schema.ModeWAL && q.Columns.OrderingKey {
		held = `
    AND NOT EXISTS (SELECT 1 FROM ` + q.Table.HoldsTable() + ` AS w WHERE w.ordering_key = o.ordering_key AND w.event_id = o.event_id AND w.mode = 'wal' AND w.resolved_at IS NULL)`
	}
	if q.Columns.SkippedAt {
		held += `
    AND o.skipped_at IS NULL`
	}
	return deleteAged(tbl, `dead_at`, held)
}

// deleteAged deletes up to a batch ($2) of the unpublished rows of tbl
// whose column at (dead_at, skipped_at) is set and more than $1 seconds
// old, and that meet the further conditions and (each starting with AND).
func deleteAged(tbl, at, and string) string {
	return `WITH victims AS (
  SELECT o.id FROM ` + tbl + ` AS o
  WHERE o.published_at IS NULL AND o.` + at + ` IS NOT NULL
    AND o.` + at + ` < now() - make_interval(secs => $1::float8)` + and + `
  LIMIT $2 FOR UPDATE OF o SKIP LOCKED
)
DELETE FROM ` + tbl + ` AS o USING victims WHERE o.id = victims.id`
}

// DeleteSkipped deletes up to a batch ($2) of the rows an operator's skip
// set aside (skipped_at, not published) more than $1 seconds ago, by
// skipped_at: the cleaner's retention of delivered rows, as DeletePublished
// deletes a delivered row by published_at, never the dead retention (a
// skipped row is done, not dead). In the default mode every skipped row; in
// ordered mode the unkeyed ones (a keyed row, delivered or skipped, is
// deleted by OrderedQueries.DeleteDone once at or below its partition's
// floor and not held). Empty in WAL mode (DeleteStreamed deletes the rows
// the WAL relay skipped) and for a table without skipped_at: nothing to run.
func (q StateQueries) DeleteSkipped() string {
	if !q.Columns.SkippedAt || q.Mode == schema.ModeWAL {
		return ""
	}
	tbl := q.Table.Sanitize()
	keyed := ``
	if q.Mode == schema.ModeOrdered {
		keyed = `
    AND o.ordering_key IS NULL`
	}
	return deleteAged(tbl, `skipped_at`, keyed)
}

// classified wraps src, a query returning rows of the table as "k.*,
// k.xmin AS row_xmin", into the relation of StateColumns plus id,
// row_xmin and dead (not done, and dead), with the mode's rules.
func (q StateQueries) classified(src string) string {
	key := q.keyExpr()
	switch q.Mode {
	case schema.ModeOrdered:
		return `SELECT o.id, o.row_xmin, o.sequence, o.event_id, o.topic, o.tenant_id,
    CASE WHEN f.holds_it OR f.replay_it THEN h.attempts ELSE o.attempts END AS attempts, o.created_at,
    CASE WHEN f.holds_it OR f.replay_it THEN NULLIF(h.available_at, 'infinity') ELSE NULLIF(o.available_at, 'infinity') END AS available_at,
    o.locked_at, o.published_at,
    CASE WHEN f.holds_it OR f.replay_it THEN h.last_error ELSE o.last_error END AS last_error,
    CASE WHEN f.holds_it OR f.replay_it THEN h.dead_at ELSE o.dead_at END AS dead_at,
    o.ordering_key, d.done, d.done AND o.published_at IS NULL AND o.skipped_at IS NOT NULL AS skipped,
    f.holds_it AS held, CASE WHEN f.behind_it THEN h.sequence END AS behind,
    (f.holds_it OR f.replay_it) AND h.skip_requested_at IS NOT NULL AS skip_requested, f.replay_it AS replay,
    NOT d.done AND CASE WHEN f.holds_it OR f.replay_it THEN h.dead_at IS NOT NULL ELSE o.dead_at IS NOT NULL END AS dead
  FROM (` + src + `) AS o
  LEFT JOIN ` + q.Table.PartitionsTable() + ` AS p ON p.partition = o.ordering_partition
  LEFT JOIN ` + q.Table.HoldsTable() + ` AS h ON h.ordering_key = o.ordering_key
  CROSS JOIN LATERAL (SELECT o.ordering_key IS NOT NULL AS keyed,
    COALESCE(h.resolved_at IS NULL AND NOT h.replay AND o.sequence = h.sequence, false) AS holds_it,
    COALESCE(h.resolved_at IS NULL AND NOT h.replay AND o.sequence > h.sequence, false) AS behind_it,
    COALESCE(h.resolved_at IS NULL AND h.replay AND o.sequence = h.sequence, false) AS replay_it,
    COALESCE((h.resolved_at IS NOT NULL AND o.sequence <= h.sequence) OR (h.resolved_at IS NULL AND NOT h.replay AND o.sequence < h.sequence), false) AS covered,
    COALESCE(o.sequence <= p.floor_sequence, false) AS below_floor) AS f
  CROSS JOIN LATERAL (SELECT o.published_at IS NOT NULL
    OR (f.keyed AND o.dead_at IS NULL AND NOT (f.holds_it OR f.behind_it OR f.replay_it) AND (f.below_floor OR f.covered))
    OR o.skipped_at IS NOT NULL AS done) AS d`
	case schema.ModeWAL:
		hold := q.walHoldJoin()
		// A skipped row (the relay wrote skipped_at when it applied the
		// skip) is done, not dead.
		skipped := `false`
		if q.Columns.OrderingKey {
			skipped = `o.skipped_at IS NOT NULL`
		}
		return `SELECT o.id, o.row_xmin, o.sequence, o.event_id, o.topic, o.tenant_id, o.attempts, o.created_at,
    NULLIF(o.available_at, 'infinity') AS available_at, o.locked_at, o.published_at, o.last_error, o.dead_at,
    ` + key + ` AS ordering_key, d.done, f.skipped, f.holds_it AS held, CASE WHEN f.parked AND NOT f.holds_it AND NOT f.skipped THEN w.sequence END AS behind,
    f.holds_it AND w.skip_requested_at IS NOT NULL AS skip_requested, false AS replay,
    NOT d.done AND o.dead_at IS NOT NULL AS dead
  FROM (` + src + `) AS o
  ` + hold + `
  CROSS JOIN LATERAL (SELECT COALESCE(w.resolved_at IS NULL AND w.event_id = o.event_id, false) AS holds_it,
    ` + walParked + ` AS parked, ` + skipped + ` AS skipped,
    COALESCE(o.dead_at IS NULL AND age(o.row_xmin) > ` + q.walHorizonAge() + `, false) AS settled) AS f
  CROSS JOIN LATERAL (SELECT o.published_at IS NOT NULL OR f.skipped OR (f.settled AND NOT f.parked) AS done) AS d`
	default:
		// A skipped row (an operator's skip recorded skipped_at: SkipEvent)
		// is done, not dead and not delivered.
		skipped := `false`
		if q.Columns.SkippedAt {
			skipped = `(o.published_at IS NULL AND o.skipped_at IS NOT NULL)`
		}
		return `SELECT o.id, o.row_xmin, o.sequence, o.event_id, o.topic, o.tenant_id, o.attempts, o.created_at,
    NULLIF(o.available_at, 'infinity') AS available_at, o.locked_at, o.published_at, o.last_error, o.dead_at,
    ` + key + ` AS ordering_key, o.published_at IS NOT NULL OR ` + skipped + ` AS done, ` + skipped + ` AS skipped, false AS held, NULL::bigint AS behind,
    false AS skip_requested, false AS replay, o.published_at IS NULL AND o.dead_at IS NOT NULL AND NOT ` + skipped + ` AS dead
  FROM (` + src + `) AS o`
	}
}

// open is the classified relation of the rows that may not be done: every
// unpublished row in the default and WAL modes (the WAL relay's streamed
// rows are told apart by done); in ordered mode the unkeyed unpublished
// rows, the keyed rows above their partition's floor (less those a hold of
// their key covers as done), the keyed rows an active hold holds, parks or
// replays, and the keyed rows below the floor that died in default mode
// before the table was switched, each read through an index.
func (q StateQueries) open() string {
	tbl := q.Table.Sanitize()
	if q.Mode != schema.ModeOrdered {
		return q.classified(`SELECT k.*, k.xmin AS row_xmin FROM ` + tbl + ` AS k WHERE k.published_at IS NULL`)
	}
	holds := q.Table.HoldsTable()
	src := `SELECT k.*, k.xmin AS row_xmin FROM ` + tbl + ` AS k WHERE k.published_at IS NULL AND k.ordering_key IS NULL
  UNION ALL
  SELECT a.* FROM ` + q.Table.PartitionsTable() + ` AS p CROSS JOIN LATERAL (
    SELECT k.*, k.xmin AS row_xmin FROM ` + tbl + ` AS k
    WHERE k.ordering_partition = p.partition AND k.ordering_key IS NOT NULL AND k.sequence > p.floor_sequence AND k.published_at IS NULL
  ) AS a
  WHERE NOT EXISTS (SELECT 1 FROM ` + holds + ` AS h WHERE h.ordering_key = a.ordering_key
    AND ((h.resolved_at IS NULL AND NOT h.replay) OR (h.resolved_at IS NOT NULL AND a.sequence <= h.sequence)))
  UNION ALL
  SELECT k.*, k.xmin AS row_xmin FROM ` + holds + ` AS h JOIN ` + tbl + ` AS k ON k.ordering_key = h.ordering_key
    AND (k.sequence = h.sequence OR (k.sequence > h.sequence AND NOT h.replay)) AND (k.published_at IS NULL OR h.replay)
  WHERE h.resolved_at IS NULL
  UNION ALL
  SELECT k.*, k.xmin AS row_xmin FROM ` + tbl + ` AS k JOIN ` + q.Table.PartitionsTable() + ` AS p ON p.partition = k.ordering_partition
  WHERE k.ordering_key IS NOT NULL AND k.dead_at IS NOT NULL AND k.published_at IS NULL AND k.sequence <= p.floor_sequence
    AND NOT EXISTS (SELECT 1 FROM ` + holds + ` AS h WHERE h.ordering_key = k.ordering_key AND h.resolved_at IS NULL
      AND (k.sequence = h.sequence OR (k.sequence > h.sequence AND NOT h.replay)))`
	return q.classified(src)
}

// Stats reads the counters of the table in its mode. No args. Returns:
// pending (not done, not dead; rows waiting behind a held key included),
// retrying (pending whose last attempt failed), locked (leased unkeyed
// rows), dead, the created_at of the oldest pending row (NULL when none),
// its age in seconds (0 when none), waiting (pending rows waiting behind a
// held key), streamed (WAL mode: unpublished rows the relay delivered),
// published in the last hour and minute (rows with published_at; the keyed
// rows of an ordered table and the streamed rows of a WAL table have
// none), held keys, held keys whose row is dead, replays due, skips
// requested.
func (q StateQueries) Stats() string {
	tbl := q.Table.Sanitize()
	held := `0::bigint, 0::bigint, 0::bigint, 0::bigint`
	switch {
	case q.Mode == schema.ModeOrdered:
		held = `(SELECT count(*) FROM ` + q.Table.HoldsTable() + ` WHERE resolved_at IS NULL),
  (SELECT count(*) FROM ` + q.Table.HoldsTable() + ` WHERE resolved_at IS NULL AND dead_at IS NOT NULL),
  (SELECT count(*) FROM ` + q.Table.HoldsTable() + ` WHERE resolved_at IS NULL AND replay),
  (SELECT count(*) FROM ` + q.Table.HoldsTable() + ` WHERE resolved_at IS NULL AND skip_requested_at IS NOT NULL)`
	case q.Mode == schema.ModeWAL && q.Columns.OrderingKey:
		held = `(SELECT count(*) FROM ` + q.Table.HoldsTable() + ` WHERE mode = 'wal' AND resolved_at IS NULL),
  (SELECT count(*) FROM ` + q.Table.HoldsTable() + ` AS w JOIN ` + tbl + ` AS o ON o.event_id = w.event_id WHERE w.mode = 'wal' AND w.resolved_at IS NULL AND o.dead_at IS NOT NULL),
  0::bigint,
  (SELECT count(*) FROM ` + q.Table.HoldsTable() + ` WHERE mode = 'wal' AND resolved_at IS NULL AND skip_requested_at IS NOT NULL)`
	}
	pending := `NOT s.done AND NOT s.dead`
	return `WITH s AS (
  ` + q.open() + `
)
SELECT count(*) FILTER (WHERE ` + pending + `),
  count(*) FILTER (WHERE ` + pending + ` AND s.last_error IS NOT NULL),
  count(*) FILTER (WHERE NOT s.done AND s.locked_at IS NOT NULL),
  count(*) FILTER (WHERE s.dead),
  min(s.created_at) FILTER (WHERE ` + pending + `),
  COALESCE(extract(epoch FROM now() - min(s.created_at) FILTER (WHERE ` + pending + `))::float8, 0),
  count(*) FILTER (WHERE ` + pending + ` AND s.behind IS NOT NULL),
  count(*) FILTER (WHERE s.done AND NOT s.skipped AND s.published_at IS NULL),
  (SELECT count(*) FROM ` + tbl + ` WHERE published_at IS NOT NULL AND published_at >= now() - interval '1 hour'),
  (SELECT count(*) FROM ` + tbl + ` WHERE published_at IS NOT NULL AND published_at >= now() - interval '1 minute'),
  ` + held + `
FROM s`
}

// Gauges reads what the relay's table gauges show, with the same rules as
// Stats: pending, locked, dead, oldest pending age in seconds (the columns
// of Queries.Stats and OrderedQueries.Stats). No args.
func (q StateQueries) Gauges() string {
	pending := `NOT s.done AND NOT s.dead`
	return `WITH s AS (
  ` + q.open() + `
)
SELECT count(*) FILTER (WHERE ` + pending + `), count(*) FILTER (WHERE NOT s.done AND s.locked_at IS NOT NULL), count(*) FILTER (WHERE s.dead),
  COALESCE(extract(epoch FROM now() - min(s.created_at) FILTER (WHERE ` + pending + `))::float8, 0)
FROM s`
}

// Backlog lists up to limit pending rows (not done, not dead), every topic
// or one, in the order the relays take them (available_at, sequence).
// Returns StateColumns.
func (q StateQueries) Backlog(topic string, limit int) Statement {
	var args []any
	where := "NOT s.done AND NOT s.dead"
	if topic != "" {
		args = append(args, topic)
		where += " AND s.topic = $1::text"
	}
	args = append(args, limit)
	return Statement{SQL: `WITH s AS (
  ` + q.open() + `
)
SELECT ` + StateColumns + ` FROM s
WHERE ` + where + `
ORDER BY s.available_at NULLS LAST, s.sequence
LIMIT $` + strconv.Itoa(len(args)) + `::int`, Args: args}
}

// Dead lists the dead rows matching f (its Topic, TenantID, ErrorContains, Cause,
// AfterSequence and Limit; 0 lists them all) in sequence order: in ordered
// mode the unkeyed dead rows and the keyed rows a dead hold holds, with the
// hold's attempts, last_error and dead_at. Returns StateColumns.
func (q StateQueries) Dead(f RunbookFilter) Statement {
	var args []any
	arg := func(v any, cast string) string {
		args = append(args, v)
		return "$" + strconv.Itoa(len(args)) + cast
	}
	conds := append([]string{"s.dead"}, f.conds("s.", arg)...)
	sql := `WITH s AS (
  ` + q.open() + `
)
SELECT ` + StateColumns + ` FROM s
WHERE ` + strings.Join(conds, " AND ") + `
ORDER BY s.sequence`
	if f.Limit > 0 {
		sql += `
LIMIT ` + arg(f.Limit, "::int")
	}
	return Statement{SQL: sql, Args: args}
}

// DeadCauses groups the dead rows matching f (its Topic, TenantID,
// ErrorContains and AfterSequence; not its Cause) by their normalised
// cause (CauseOf their last_error: a held row's is its hold's), the
// largest groups first, at most limit groups. Returns per group: the
// cause ("" for the rows without an error), its rows, the first and last
// dead_at, the number of groups and of rows in all (the same on every
// line), and the event_id (text), topic and last_error ("" when none) of
// its latest row (the highest sequence).
func (q StateQueries) DeadCauses(f RunbookFilter, limit int) Statement {
	var args []any
	arg := func(v any, cast string) string {
		args = append(args, v)
		return "$" + strconv.Itoa(len(args)) + cast
	}
	f.Cause = ""
	conds := append([]string{"s.dead"}, f.conds("s.", arg)...)
	lim := arg(limit, "::int")
	return Statement{SQL: `WITH s AS (
  ` + q.open() + `
), d AS (
  SELECT s.*, ` + CauseOf("s.last_error") + ` AS cause FROM s WHERE ` + strings.Join(conds, " AND ") + `
)
SELECT d.cause, count(*) AS n, min(d.dead_at), max(d.dead_at), count(*) OVER (), (sum(count(*)) OVER ())::bigint,
  (array_agg(d.event_id::text ORDER BY d.sequence DESC))[1], (array_agg(d.topic ORDER BY d.sequence DESC))[1],
  (array_agg(COALESCE(d.last_error, '') ORDER BY d.sequence DESC))[1]
FROM d
GROUP BY d.cause
ORDER BY n DESC, d.cause
LIMIT ` + lim, Args: args}
}

// TopicBacklog counts, per topic, the pending rows, the retrying ones, the
// dead ones and the age in seconds of the oldest pending row, the largest
// backlog first, at most $1 topics.
func (q StateQueries) TopicBacklog(limit int) Statement {
	pending := `NOT s.done AND NOT s.dead`
	return Statement{SQL: `WITH s AS (
  ` + q.open() + `
)
SELECT s.topic, count(*) FILTER (WHERE ` + pending + `),
  count(*) FILTER (WHERE ` + pending + ` AND s.last_error IS NOT NULL),
  count(*) FILTER (WHERE s.dead),
  COALESCE(extract(epoch FROM now() - min(s.created_at) FILTER (WHERE ` + pending + `))::float8, 0)
FROM s WHERE NOT s.done
GROUP BY s.topic
ORDER BY count(*) DESC, s.topic
LIMIT $1::int`, Args: []any{limit}}
}

// Event classifies the row whose event_id is $1 (canonical UUID text).
// Returns StateColumns, then dead, then leased (a relay leased it less than
// $2 seconds ago, LeaseLiveWithin). No row when there is no such event.
func (q StateQueries) Event(eventID string, lockTTLSeconds float64) Statement {
	return Statement{SQL: `WITH s AS (
  ` + q.classified(`SELECT k.*, k.xmin AS row_xmin FROM `+q.Table.Sanitize()+` AS k WHERE k.event_id = $1::uuid`) + `
)
SELECT ` + StateColumns + `, s.dead, ` + LeaseLiveWithin("$2::float8") + ` FROM s`,
		Args: []any{eventID, lockTTLSeconds}}
}

// Progress counts, among the rows whose event_ids are ids (canonical UUID
// text), those done (delivered, or skipped), those dead and those pending
// (neither), as the mode classifies them. Returns: rows found, done, dead,
// pending.
func (q StateQueries) Progress(ids []string) Statement {
	return Statement{SQL: `WITH s AS (
  ` + q.classified(`SELECT k.*, k.xmin AS row_xmin FROM `+q.Table.Sanitize()+` AS k WHERE k.event_id = ANY($1::uuid[])`) + `
)
SELECT count(*), count(*) FILTER (WHERE s.done), count(*) FILTER (WHERE s.dead), count(*) FILTER (WHERE NOT s.done AND NOT s.dead) FROM s`,
		Args: []any{ids}}
}

// ModeProbe reads what decides a table's mode. No args. Returns: the WAL
// progress table exists, the table is named in a publication, the ordered
// companion tables (with the hold states of migration 000005) exist, the
// holds table has this version's shape (its state column, migration 000011
// or walrelay.Setup), a WAL relay of an older version's holds table
// (<table>_wal_holds) exists, the table has skipped_at (migration 000012,
// or walrelay.Setup).
func ModeProbe(t schema.Table) string {
	return `SELECT to_regclass(` + quoteLiteral(t.WALProgressTable()) + `) IS NOT NULL,
  EXISTS (SELECT 1 FROM pg_publication_rel WHERE prrelid = to_regclass(` + quoteLiteral(t.Sanitize()) + `)),
  to_regclass(` + quoteLiteral(t.PartitionsTable()) + `) IS NOT NULL AND to_regclass(` + quoteLiteral(t.HoldsTable()) + `) IS NOT NULL
  AND (SELECT count(*) FROM pg_attribute WHERE attrelid = to_regclass(` + quoteLiteral(t.HoldsTable()) + `) AND attname IN ('resolved_at', 'replay') AND NOT attisdropped) = 2,
  ` + holdsShape(t)
}

// DecideMode turns the answers of ModeProbe and the table's columns into
// its mode, by the rule schema's switch infers a mode by
// (pgmeta.InferMode).
func DecideMode(walProgress, published, orderedTables bool, c schema.Columns) schema.Mode {
	return schema.Mode(pgmeta.InferMode(walProgress, published, orderedTables, c.OrderingKey))
}
