package sqlq

import (
	"context"
	"fmt"
	"time"

	"github.com/outboxkit/watermill-outbox/schema"
)

// The words of the hold states, as the state expressions below return them
// (package runbook's HoldState names them; docs/ORDERING.md, "Hold
// states").
const (
	HoldWordRetrying      = "retrying"
	HoldWordDead          = "dead"
	HoldWordSkipRequested = "skip_requested"
	HoldWordReplay        = "replay"
	HoldWordDraining      = "draining"
	HoldWordResolved      = "resolved"
)

// holdState is the state of the hold h (a row of <table>_holds aliased as
// h), one of the words above: the holds table's generated column, which
// both keyed modes share (schema's holdStateExpr: resolved, draining,
// skip_requested, retrying when the WAL relay spilled the key, dead,
// replay, else retrying).
const holdState = `h.state`

// HoldList lists up to $1 holds for the runbook, oldest first, the
// resolved ones (tombstones) only when $2 is true: ordering_key, partition,
// sequence, attempts, available_at (NULL when dead), last_error, dead_at,
// skip_requested_at, event_id, topic (event_id and topic NULL when the row
// is gone), replay, state (the holds table's state column).
func (q *OrderedQueries) HoldList() string {
	return `SELECT h.ordering_key, h.partition::int, h.sequence, h.attempts,
  CASE WHEN h.available_at = 'infinity' THEN NULL ELSE h.available_at END, h.last_error, h.dead_at, h.skip_requested_at,
  o.event_id::text, o.topic, h.replay, ` + holdState + `
FROM ` + q.Table.HoldsTable() + ` AS h LEFT JOIN ` + q.Table.Sanitize() + ` AS o ON o.ordering_key = h.ordering_key AND o.sequence = h.sequence
WHERE ($2::bool OR h.resolved_at IS NULL)
ORDER BY h.created_at, h.ordering_key LIMIT $1`
}

// HoldOfEvent finds the hold at the row whose event_id is $1, resolved
// ones included: ordering_key, sequence, dead, state. No row when the row
// holds no key.
func (q *OrderedQueries) HoldOfEvent() string {
	return `SELECT h.ordering_key, h.sequence, h.dead_at IS NOT NULL, ` + holdState + `
FROM ` + q.Table.Sanitize() + ` AS o JOIN ` + q.Table.HoldsTable() + ` AS h ON h.ordering_key = o.ordering_key AND h.sequence = o.sequence
WHERE o.event_id = $1::uuid`
}

// RetryHoldIn makes the hold of key $1 at sequence $2 due now and clears
// dead_at and attempts, only while its state is one of $3 (text array):
// the state the runbook checked cannot change under it. Command tag: rows.
func (q *OrderedQueries) RetryHoldIn() string {
	return `UPDATE ` + q.Table.HoldsTable() + ` AS h SET dead_at = NULL, attempts = 0, available_at = now()
WHERE h.ordering_key = $1 AND h.sequence = $2 AND ` + holdState + ` = ANY($3::text[])`
}

// SkipHoldIn asks the relay to drop the hold of key $1 at sequence $2 and
// continue with the key's next row, only while its state is one of $3
// (text array); the relay marks the row skipped (skipped_at) when it
// applies the skip (OrderedQueries.Advance). Returns: skipped (bool).
func (q *OrderedQueries) SkipHoldIn() string {
	return `WITH h AS (
  UPDATE ` + q.Table.HoldsTable() + ` AS h SET skip_requested_at = now()
  WHERE h.ordering_key = $1 AND h.sequence = $2 AND ` + holdState + ` = ANY($3::text[]) RETURNING sequence
)
SELECT EXISTS (SELECT 1 FROM h)`
}

// WALHoldList lists up to $1 holds of the WAL table t, oldest first, the
// released ones (tombstones) only when $2 is true, with the columns of
// OrderedQueries.HoldList (partition 0, replay false).
func WALHoldList(t schema.Table) string {
	return `SELECT h.ordering_key, 0, h.sequence, COALESCE(o.attempts, 0), NULLIF(o.available_at, 'infinity'), o.last_error, o.dead_at,
  h.skip_requested_at, h.event_id::text, o.topic, false, ` + holdState + `
FROM ` + t.HoldsTable() + ` AS h LEFT JOIN ` + t.Sanitize() + ` AS o ON o.event_id = h.event_id
WHERE h.mode = 'wal' AND ($2::bool OR h.resolved_at IS NULL)
ORDER BY h.created_at, h.ordering_key LIMIT $1`
}

// WALHoldOfEvent finds the hold of the WAL table t whose row's event_id is
// $1, released ones included: ordering_key, sequence, state. No row when
// the event holds no key.
func WALHoldOfEvent(t schema.Table) string {
	return `SELECT h.ordering_key, h.sequence, ` + holdState + ` FROM ` + t.HoldsTable() + ` AS h WHERE h.mode = 'wal' AND h.event_id = $1::uuid`
}

// WALSkipHoldIn asks the WAL relay to skip the row $1 (event_id text) that
// holds its key, only while the hold's state is one of $2 (text array):
// the relay then delivers the key's later rows and marks the row skipped
// (WALQueries.Drain, MarkSkipped).
// Returns: the key and the sequence, no row otherwise.
func WALSkipHoldIn(t schema.Table) string {
	return `UPDATE ` + t.HoldsTable() + ` AS h SET skip_requested_at = now()
WHERE h.mode = 'wal' AND h.event_id = $1::uuid AND ` + holdState + ` = ANY($2::text[]) RETURNING h.ordering_key, h.sequence`
}

// WALSkipDeadRow marks skipped the dead keyed row $1 (event_id text) of
// the WAL table t that holds no key (no open hold at it: the WAL relay
// parks a failed replay of a row its key went past dead without holding
// the key). The relay keeps nothing of such a row but its columns, so the
// skip is applied on the row at once: skipped (walSkipRow), not dead, its
// attempts and last_error kept. A row reset by a replay meanwhile (dead_at
// cleared) is left as it is. Returns: the key and the sequence, no row
// when nothing changed.
func WALSkipDeadRow(t schema.Table) string {
	return `UPDATE ` + t.Sanitize() + ` AS o SET ` + walSkipRow + `
WHERE ` + walDeadUnheld(t) + `
RETURNING o.ordering_key, o.sequence`
}

// WALDeadRowUnheld reads the row WALSkipDeadRow would skip ($1 event_id
// text), for a dry run: the key and the sequence, no row otherwise.
func WALDeadRowUnheld(t schema.Table) string {
	return `SELECT o.ordering_key, o.sequence FROM ` + t.Sanitize() + ` AS o WHERE ` + walDeadUnheld(t)
}

// walDeadUnheld is the condition that row o of the WAL table t is the row
// $1 (event_id), dead, keyed, not skipped, and holds no key.
func walDeadUnheld(t schema.Table) string {
	return `o.event_id = $1::uuid AND o.dead_at IS NOT NULL AND o.published_at IS NULL AND o.skipped_at IS NULL
  AND o.ordering_key IS NOT NULL AND o.ordering_key <> ''
  AND NOT EXISTS (SELECT 1 FROM ` + t.HoldsTable() + ` AS h WHERE h.mode = 'wal' AND h.event_id = o.event_id AND h.resolved_at IS NULL)`
}

// WALReplayRule is the hold rule of a replay in a WAL table, as the states
// (words) in which the hold of a row's key accepts the replay of the row:
// Held when the row is the hold's own (held) row, Others for another row
// of the key. The runbook derives both from its one rule
// (runbook.HoldState.Allows); every replay statement of a WAL table applies
// them through WALReplayAllowsSQL: ReplayEvent (WALReplayEvent) and the
// bulk replays (RunbookFilter.WALReplay).
type WALReplayRule struct {
	Table  schema.Table
	Held   []string
	Others []string
}

// WALReplayAllowsSQL is the condition that the WAL hold h (a row of
// <table>_wal_holds aliased h, the hold of row's key) accepts a replay of
// row (an alias of a row of t): its state (WALHoldStateSQL) is one of held
// (a text array expression) when row is the held row, else one of others.
func WALReplayAllowsSQL(row, held, others string) string {
	return holdState + ` = ANY(CASE WHEN h.event_id = ` + row + `.event_id THEN ` + held + ` ELSE ` + others + ` END)`
}

// guard is the condition, on row o of a dead row's selection, that the
// hold of its key (if any) accepts its replay (WALReplayAllowsSQL), its
// rule's arrays passed through arg. With locked, the holds are read from
// the statement's CTE lh (lockHolds): as locked, not as of the
// statement's snapshot.
func (r WALReplayRule) guard(arg func(v any, cast string) string, locked bool) string {
	holds := r.Table.HoldsTable()
	if locked {
		holds = "lh"
	}
	return `NOT EXISTS (SELECT 1 FROM ` + holds + ` AS h WHERE h.ordering_key = o.ordering_key AND h.mode = 'wal'
      AND NOT (` + WALReplayAllowsSQL("o", arg(r.Held, "::text[]"), arg(r.Others, "::text[]")) + `))`
}

// lockHolds is the CTE lh of a bulk replay's statement: the holds of the
// keys with dead rows, locked (FOR SHARE) and read as locked, so that a
// concurrent skip, replay or relay write of a hold is ordered before or
// after the replay, never beside it (as WALReplayEvent's lock).
func (r WALReplayRule) lockHolds() string {
	return `lh AS MATERIALIZED (
  SELECT h.* FROM ` + r.Table.HoldsTable() + ` AS h
  WHERE h.mode = 'wal' AND h.ordering_key IN (SELECT d.ordering_key FROM ` + r.Table.Sanitize() + ` AS d WHERE d.published_at IS NULL AND d.dead_at IS NOT NULL)
  FOR SHARE
), `
}

// Skipped reads whether the row $1 (event_id) of the keyed table t was
// skipped (skipped_at set). No row when it is not in the table.
func Skipped(t schema.Table) string {
	return `SELECT skipped_at IS NOT NULL FROM ` + t.Sanitize() + ` WHERE event_id = $1::uuid`
}

// WALReplayEvent is RunbookQueries.ReplayEvent for the WAL table t (with
// an ordering_key column): it resets row $1 (event_id) as that statement
// does, and when the row's key has a hold, only while the hold accepts the
// replay by the rule (WALReplayAllowsSQL: held states $3 when the row is
// the held one, others $4). The hold row is locked in the same statement,
// and its state checked on the row as locked, so that a concurrent skip or
// drain of the hold is ordered before or after the replay, never beside
// it. Returns: sequence, no row when nothing was reset.
func WALReplayEvent(r WALReplayRule, eventID string, lockTTL time.Duration) Statement {
	t := r.Table
	holds := t.HoldsTable()
	return Statement{SQL: `WITH g AS (
  SELECT h.ordering_key FROM ` + holds + ` AS h JOIN ` + t.Sanitize() + ` AS r ON h.ordering_key = r.ordering_key
  WHERE r.event_id = $1::uuid AND h.mode = 'wal' AND ` + WALReplayAllowsSQL("r", "$3::text[]", "$4::text[]") + `
  FOR UPDATE OF h
), u AS (
  UPDATE ` + t.Sanitize() + ` AS o SET dead_at = NULL, skipped_at = NULL, attempts = 0, available_at = now(), locked_at = NULL, last_error = NULL
  WHERE o.event_id = $1::uuid
    AND o.published_at IS NULL
    AND (o.dead_at IS NOT NULL OR o.last_error IS NOT NULL OR o.skipped_at IS NOT NULL)
    AND NOT ` + LeaseLiveWithin("$2::float8") + `
    AND (EXISTS (SELECT 1 FROM g) OR NOT EXISTS (SELECT 1 FROM ` + holds + ` AS h WHERE h.ordering_key = o.ordering_key AND h.mode = 'wal'))
  RETURNING o.sequence, o.event_id
), hr AS (
  ` + walHeldReplayed(t, "u") + `
)
SELECT sequence FROM u`, Args: []any{eventID, lockTTLSeconds(lockTTL), r.Held, r.Others}}
}

// walHeldReplayed is the statement that records, on the WAL relay's open
// holds, that their held row is among the rows of rel (a relation with
// event_id) an operator's replay just reset: the hold is no longer dead but
// replayed (state replay), until the relay delivers the row again.
func walHeldReplayed(t schema.Table, rel string) string {
	return `UPDATE ` + t.HoldsTable() + ` AS h SET dead_at = NULL, replay = true FROM ` + rel + ` AS x
  WHERE h.event_id = x.event_id AND h.mode = 'wal' AND h.resolved_at IS NULL`
}

// WALHoldOfKeyOfEvent finds the hold of the key of the row of the WAL
// table t whose event_id is $1, released ones included: ordering_key,
// sequence, state, and whether the row is the held one. No row when the
// key holds nothing.
func WALHoldOfKeyOfEvent(t schema.Table) string {
	return `SELECT h.ordering_key, h.sequence, ` + holdState + `, h.event_id = r.event_id
FROM ` + t.HoldsTable() + ` AS h JOIN ` + t.Sanitize() + ` AS r ON h.ordering_key = r.ordering_key WHERE h.mode = 'wal' AND r.event_id = $1::uuid`
}

// OpenHoldsOfOtherMode counts the holds of t that the keyed mode other than
// m keeps open: for the WAL relay (m = schema.ModeWAL) the ordered relay's
// holds not resolved, for ordered mode the WAL relay's holds not released.
// A table without that holds table has none. A switch between the keyed
// modes is refused while it is not 0: the relay after the switch does not
// read the other mode's holds, and would deliver a held key's rows past its
// failing or dead row (or deliver that row again).
func OpenHoldsOfOtherMode(ctx context.Context, q schema.Querier, t schema.Table, m schema.Mode) (int64, error) {
	other := string(schema.ModeWAL)
	if m == schema.ModeWAL {
		other = string(schema.ModeOrdered)
	}
	var n int64
	var exists bool
	if err := q.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, t.HoldsTable()).Scan(&exists); err != nil {
		return 0, fmt.Errorf("look up the holds table %s: %w", t.HoldsTable(), err)
	}
	if exists {
		// The mode is read through to_jsonb: a holds table made by an
		// older version has no mode column, and holds ordered mode's only.
		err := q.QueryRow(ctx, `SELECT count(*) FROM `+t.HoldsTable()+` AS h
  WHERE COALESCE(to_jsonb(h)->>'mode', 'ordered') = $1 AND h.resolved_at IS NULL`, other).Scan(&n)
		if err != nil {
			return 0, fmt.Errorf("count the open holds of %s: %w", t.HoldsTable(), err)
		}
	}
	if m != schema.ModeOrdered {
		return n, nil
	}
	var legacy bool
	if err := q.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, LegacyWALHoldsTable(t)).Scan(&legacy); err != nil {
		return 0, fmt.Errorf("look up %s: %w", LegacyWALHoldsTable(t), err)
	}
	if !legacy {
		return n, nil
	}
	l, err := legacyOpenWALHolds(ctx, q, t)
	return n + l, err
}

// legacyOpenWALHolds counts the open holds a WAL relay of an older version
// kept in <table>_wal_holds (walrelay.Setup moves them), which must exist.
func legacyOpenWALHolds(ctx context.Context, q schema.Querier, t schema.Table) (int64, error) {
	var n int64
	if err := q.QueryRow(ctx, `SELECT count(*) FROM `+LegacyWALHoldsTable(t)+` WHERE NOT released`).Scan(&n); err != nil {
		return 0, fmt.Errorf("count the open holds of %s: %w", LegacyWALHoldsTable(t), err)
	}
	return n, nil
}
