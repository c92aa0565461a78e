package sqlq

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/outboxkit/watermill-outbox/internal/pgmeta"
	"github.com/outboxkit/watermill-outbox/schema"
)

// ColumnOrderingPartition is the stored generated column that maps a row's
// ordering key to its partition.
const ColumnOrderingPartition = "ordering_partition"

// OrderingLockClassSQL is the SQL expression of the first key (an int4) of
// the transaction-level advisory locks that serialise the writers of one
// ordering key, pg_advisory_xact_lock(class, hashtext(key)): the OID of
// the table, as int4, resolved from its name as t spells it (through the
// session's search_path when t has no schema). Every writer and relay of a
// table agrees on it, however each names the table. The regclass literal is
// resolved when the statement is parsed and recorded as a dependency of its
// cached plan, so a prepared statement is re-planned, and the OID looked up
// again, when the table is dropped and made again.
func OrderingLockClassSQL(t schema.Table) string {
	return quoteLiteral(t.Sanitize()) + `::regclass::oid::int4`
}

// LookupOrderingLockClass returns the value of OrderingLockClassSQL on q's
// session: the table's OID as int4. Relays look it up once, at start.
func LookupOrderingLockClass(ctx context.Context, q schema.Querier, t schema.Table) (int32, error) {
	var class int32
	if err := q.QueryRow(ctx, `SELECT `+OrderingLockClassSQL(t)).Scan(&class); err != nil {
		return 0, fmt.Errorf("schema: ordering lock class of %s: %w", t, err)
	}
	return class, nil
}

// LegacyOrderingLockClass is the class writers of versions before the OID
// class took: a hash of the qualified name. Relays watch both classes, so
// that writers not yet upgraded are still seen by the cut during a rolling
// upgrade (relays first, then writers).
func LegacyOrderingLockClass(t schema.Table) int32 { return pgmeta.LegacyOrderingClass(t.Qualified()) }

const lockKeysStatement = `SELECT count(pg_advisory_xact_lock($1::int4, h)) FROM (SELECT DISTINCT hashtext(k) AS h FROM unnest($2::text[]) AS k ORDER BY 1) AS s`

// OrderedQueries holds the statements of ordered mode for one table with the
// ordering columns: partition leases, membership, the keyed-row scan, holds,
// gauges, cleaning and the runbook. The happy path writes no outbox row:
// progress is one floor per partition (docs/ORDERING.md).
type OrderedQueries struct {
	Table   schema.Table
	Columns schema.Columns

	// Heartbeat records that relay $1 is alive and returns the ids of the
	// relays alive within $2 seconds (text array, this one included); it
	// forgets relays silent for a day (killed without leaving).
	Heartbeat string
	// Leave removes relay $1 from the membership.
	Leave string
	// LiveOwners counts the relays that own a partition with a lease not
	// expired: the ordered relays at work (the console's overview).
	LiveOwners string
	// Acquire takes the partitions $2 (int array) that are free, expired or
	// already owned by relay $1, for $3 seconds, each in a new term (its
	// epoch incremented, also when relay $1 owned it already). Returns:
	// partition, floor_sequence, epoch.
	Acquire string
	// Renew extends the leases of relay $1 on partitions $2 for $4 seconds
	// and raises their floors to $3 (bigint array, same order), fenced on
	// a live lease of $1 in the terms $5 (bigint array, same order).
	// Returns: partition.
	Renew string
	// release gives partitions back with their floors (Release).
	release string
	// Cut returns the sequence's last value, then the virtual transactions
	// that hold a key lock of the table (lock class $1, or the legacy class
	// $2 of writers not yet upgraded) and the lock's key
	// hash (objid as bigint; its low 6 bits are the key's partition), as two
	// arrays of the same length. The last value is read before the locks.
	Cut string
	// Holds lists the holds of partitions $1 (int array): ordering_key,
	// partition, sequence, attempts, seconds until due (<= 0: due), dead,
	// skip requested, replay, resolved.
	Holds string
	// Scan reads the keyed rows of partitions $1 (int array) with
	// sequences in ($2, $3] ($2 a bigint array, same order; $3 one bigint),
	// at most $4 per partition, in sequence order per partition. Returns
	// OrderedRow columns.
	Scan string
	// Rescan reads the keyed rows of partition $1[i] whose key hash is
	// $2[i] with sequences in ($3[i], $4[i]], at most $5 for each i, in
	// sequence order. Returns OrderedRow columns.
	Rescan string
	// RowAt reads the row of key $1 at sequence $2 while its key's hold is
	// at that sequence, not resolved and no skip is requested (OrderedRow
	// columns; no row otherwise).
	RowAt string
	// rowExists tells whether the key $1 has a row at sequence $2 (Gone).
	rowExists string
	// fail records a failed attempt as its key's hold (Fail).
	fail string
	// advance moves a hold on (Advance).
	advance string
	// CleanResolved deletes the resolved holds at or below the written
	// floor of their partition, for the partitions relay $1 owns.
	CleanResolved string
	// Stats returns pending (not dead), leased, dead and the oldest pending
	// age in seconds, for keyed and unkeyed rows together: a row is dead
	// when its dead_at is set (a keyed row that died in default mode before
	// the table was switched), or when its key's hold on it has dead_at set.
	// No args.
	Stats string
	// HeldKeys counts the holds that hold a key (not resolved): all, dead.
	HeldKeys string
	// DeleteDone deletes up to $2 keyed rows at or below their partition's
	// floor created more than $1 seconds ago, never a dead row nor a row at
	// or after the sequence of its key's hold (a replay hold keeps only its
	// own row), nor a row changed since the statement began: ReplayDone
	// writes the row it replays, so a replay that commits while the delete
	// runs keeps its row (the delete compares the row's xmin).
	DeleteDone string
	// ReplayDone makes the keyed row whose event_id is $1 a replay hold when
	// it is at or below its partition's written floor and its key has no
	// hold (or only a resolved one at or below that floor): the relay
	// delivers it once more before the key's next row. It writes the row
	// back to pending in its own columns (dead_at, skipped_at and
	// published_at NULL: a row that died in default mode before the table
	// was switched is revived, a skipped row is no longer skipped, a row the
	// default relay published is no longer read as delivered nor deleted by
	// the published retention while its replay is due; the relay's Advance
	// marks it skipped again when the replay is skipped), so that
	// DeleteDone racing it keeps the row, and inserts the hold only when the
	// row is still there. Returns: inserted,
	// above floor, held sequence (NULL when the key has no hold).
	ReplayDone string
	// Keyed reports whether the row whose event_id is $1 has an ordering
	// key (no row when there is no such event).
	Keyed string
}

// orderedReturning lists the columns of an OrderedRow, for row alias o.
func orderedReturning(c schema.Columns) string {
	cols := []string{"o.ordering_partition::int", "o.ordering_key", "hashtext(o.ordering_key)", "o.id::text", "o.event_id::text", "o.tenant_id::text", "o.topic",
		"o.payload::text", "o.sequence", "o.created_at"}
	if c.TraceContext {
		cols = append(cols, "o.traceparent", "o.tracestate")
	}
	if c.Headers {
		cols = append(cols, "o.headers::text")
	}
	return strings.Join(cols, ", ")
}

// OrderedRow is one keyed row read by OrderedQueries.Scan, Rescan or RowAt.
type OrderedRow struct {
	ClaimedRow
	Partition int
	Key       string
	// KeyHash is hashtext(Key), the second key of the key's writer lock.
	KeyHash int32
}

// HeldRow reads, through RowAt, the row of key at seq that the key's hold
// holds; pgx.ErrNoRows when there is none (see Gone).
func (q *OrderedQueries) HeldRow(ctx context.Context, db schema.Querier, key string, seq int64) (*OrderedRow, error) {
	row := &OrderedRow{}
	if err := row.Scan(db.QueryRow(ctx, q.RowAt, key, seq), q.Columns); err != nil {
		return nil, err
	}
	return row, nil
}

// Gone reports whether key's row at seq is no longer in the table (false
// when that cannot be read).
func (q *OrderedQueries) Gone(ctx context.Context, db schema.Querier, key string, seq int64) bool {
	var exists bool
	err := db.QueryRow(ctx, q.rowExists, key, seq).Scan(&exists)
	return err == nil && !exists
}

// Scan reads a row produced by Scan, Rescan or RowAt for a table with
// columns c.
func (r *OrderedRow) Scan(s Scanner, c schema.Columns) error {
	dest := []any{&r.Partition, &r.Key, &r.KeyHash, &r.ID, &r.EventID, &r.TenantID, &r.Topic, &r.Payload, &r.Sequence, &r.CreatedAt}
	if c.TraceContext {
		dest = append(dest, &r.TraceParent, &r.TraceState)
	}
	if c.Headers {
		dest = append(dest, &r.Headers)
	}
	if err := s.Scan(dest...); err != nil {
		return fmt.Errorf("scan keyed outbox row: %w", err)
	}
	r.OrderingKey = &r.Key
	return nil
}

// orderedTakeover is the SET list by which an ordered-mode upsert that
// takes over a resolved hold of the key makes it ordered mode's: the mode,
// and the WAL relay's columns cleared (a WAL tombstone left by a switch
// would otherwise keep spilled, which the state column reads).
const orderedTakeover = `mode = 'ordered', event_id = NULL, draining = false, spilled = false, through = 0, until_lsn = NULL`

// NewOrderedQueries renders the ordered-mode statements for table t with
// columns c (c.OrderingKey must be true).
func NewOrderedQueries(t schema.Table, c schema.Columns) *OrderedQueries {
	tbl, parts, relays, holds := t.Sanitize(), t.PartitionsTable(), t.RelaysTable(), t.HoldsTable()
	ret := orderedReturning(c)
	ttl := func(n string) string { return `make_interval(secs => ` + n + `::float8)` }
	q := &OrderedQueries{Table: t, Columns: c}
	q.Heartbeat = `WITH hb AS (
  INSERT INTO ` + relays + ` AS r (relay_id, heartbeat_at) VALUES ($1, now())
  ON CONFLICT (relay_id) DO UPDATE SET heartbeat_at = now() RETURNING r.relay_id
), gone AS (
  DELETE FROM ` + relays + ` WHERE heartbeat_at < now() - interval '1 day'
)
SELECT ARRAY(SELECT relay_id FROM ` + relays + ` WHERE heartbeat_at > now() - ` + ttl("$2") + ` UNION SELECT relay_id FROM hb)`
	q.Leave = `DELETE FROM ` + relays + ` WHERE relay_id = $1`
	q.LiveOwners = `SELECT count(DISTINCT owner) FROM ` + parts + ` WHERE owner IS NOT NULL AND lease_until > now()`
	q.Acquire = `UPDATE ` + parts + ` SET owner = $1, lease_until = now() + ` + ttl("$3") + `, epoch = epoch + 1
WHERE partition = ANY($2::int[]) AND (owner IS NULL OR owner = $1 OR lease_until IS NULL OR lease_until < now())
RETURNING partition::int, floor_sequence, epoch`
	q.Renew = `UPDATE ` + parts + ` AS p SET lease_until = now() + ` + ttl("$4") + `, floor_sequence = GREATEST(p.floor_sequence, u.floor)
FROM unnest($2::int[], $3::bigint[], $5::bigint[]) AS u(part, floor, epoch)
WHERE p.partition = u.part AND p.owner = $1 AND p.epoch = u.epoch AND p.lease_until > now()
RETURNING p.partition::int`
	q.release = `UPDATE ` + parts + ` AS p SET owner = NULL, lease_until = NULL, floor_sequence = GREATEST(p.floor_sequence, u.floor)
FROM unnest($2::int[], $3::bigint[], $4::bigint[]) AS u(part, floor, epoch)
WHERE p.partition = u.part AND p.owner = $1 AND p.epoch = u.epoch AND p.lease_until > now()`
	// The last value is read in a subquery that runs before the lock list
	// (OFFSET 0 keeps it from being flattened into it).
	q.Cut = `SELECT s.last_value, COALESCE(l.vx, '{}'), COALESCE(l.h, '{}')
FROM (SELECT COALESCE(pg_sequence_last_value(pg_get_serial_sequence(` + quoteLiteral(tbl) + `, 'sequence')::regclass), 0) AS last_value OFFSET 0) AS s
CROSS JOIN LATERAL (
  SELECT array_agg(k.virtualtransaction) AS vx, array_agg(k.objid::int8) AS h FROM pg_locks AS k
  WHERE k.locktype = 'advisory' AND k.classid IN (($1::int4)::oid, ($2::int4)::oid) AND k.objsubid = 2 AND k.granted AND s.last_value IS NOT NULL
) AS l`
	// Holds filters on an expression, so that reading the holds of many
	// partitions is one scan of the (small) holds table, not one index probe
	// per partition.
	q.Holds = `SELECT ordering_key, partition::int, sequence, attempts, extract(epoch FROM LEAST(available_at, now() + interval '1 day') - now())::float8,
  dead_at IS NOT NULL, skip_requested_at IS NOT NULL, replay, resolved_at IS NOT NULL
FROM ` + holds + ` WHERE partition::int + 0 = ANY($1::int[])`
	q.Scan = `SELECT ` + ret + `
FROM unnest($1::int[], $2::bigint[]) AS p(part, lo)
CROSS JOIN LATERAL (
  SELECT * FROM ` + tbl + ` AS k
  WHERE k.ordering_partition = p.part AND k.ordering_key IS NOT NULL AND k.sequence > p.lo AND k.sequence <= $3 AND k.published_at IS NULL AND k.dead_at IS NULL
    AND k.skipped_at IS NULL
  ORDER BY k.sequence LIMIT $4
) AS o`
	q.Rescan = `SELECT ` + ret + `
FROM unnest($1::int[], $2::int4[], $3::bigint[], $4::bigint[]) AS w(part, h, lo, hi)
CROSS JOIN LATERAL (
  SELECT * FROM ` + tbl + ` AS k
  WHERE k.ordering_partition = w.part AND k.ordering_key IS NOT NULL AND k.sequence > w.lo AND k.sequence <= w.hi
    AND hashtext(k.ordering_key) = w.h AND k.published_at IS NULL AND k.dead_at IS NULL AND k.skipped_at IS NULL
  ORDER BY k.sequence LIMIT $5
) AS o ORDER BY o.sequence`
	q.RowAt = `SELECT ` + ret + ` FROM ` + tbl + ` AS o JOIN ` + holds + ` AS h ON h.ordering_key = o.ordering_key AND h.sequence = o.sequence
WHERE o.ordering_key = $1 AND o.sequence = $2 AND h.resolved_at IS NULL AND h.skip_requested_at IS NULL`
	q.rowExists = `SELECT EXISTS (SELECT 1 FROM ` + tbl + ` WHERE ordering_key = $1 AND sequence = $2)`
	own := func(epoch string) string {
		return `SELECT 1 FROM ` + parts + ` WHERE partition = $2 AND owner = $1 AND epoch = ` + epoch + `::bigint AND lease_until > now()`
	}
	deadFirst := `$7::bool OR $6::int <= 1`
	same := `(h.resolved_at IS NULL AND h.sequence = EXCLUDED.sequence)`
	deadNow := `($7::bool OR (CASE WHEN ` + same + ` THEN h.attempts ELSE 0 END) + 1 >= $6::int)`
	q.fail = `INSERT INTO ` + holds + ` AS h (ordering_key, partition, sequence, attempts, available_at, last_error, dead_at)
SELECT $3, $2, $4, 1,
  CASE WHEN ` + deadFirst + ` THEN 'infinity'::timestamptz ELSE now() + ` + ttl("$8") + ` END, $5,
  CASE WHEN ` + deadFirst + ` THEN now() END
WHERE EXISTS (` + own("$9") + `)
ON CONFLICT (ordering_key) DO UPDATE SET
  sequence = EXCLUDED.sequence,
  attempts = CASE WHEN ` + same + ` THEN h.attempts + 1 ELSE 1 END,
  last_error = EXCLUDED.last_error,
  available_at = CASE WHEN ` + deadNow + ` THEN 'infinity'::timestamptz ELSE now() + ` + ttl("$8") + ` END,
  dead_at = CASE WHEN ` + deadNow + ` THEN now() END,
  skip_requested_at = CASE WHEN ` + same + ` THEN h.skip_requested_at END,
  replay = CASE WHEN ` + same + ` THEN h.replay ELSE false END,
  resolved_at = NULL, created_at = CASE WHEN ` + same + ` THEN h.created_at ELSE now() END,
  ` + orderedTakeover + `
WHERE ` + same + ` OR (h.resolved_at IS NOT NULL AND h.sequence < EXCLUDED.sequence)
RETURNING h.dead_at IS NOT NULL, h.attempts, h.skip_requested_at IS NOT NULL`
	q.advance = `WITH own AS (` + own("$6") + `),
h0 AS (SELECT replay, attempts, last_error, skip_requested_at IS NOT NULL AS skip FROM ` + holds + `
  WHERE ordering_key = $3 AND sequence = $4 AND resolved_at IS NULL AND EXISTS (SELECT 1 FROM own) FOR UPDATE),
sk AS (
  UPDATE ` + tbl + ` AS o SET skipped_at = now(),
    attempts = CASE WHEN h0.last_error IS NULL THEN o.attempts ELSE h0.attempts END, last_error = COALESCE(h0.last_error, o.last_error)
  FROM h0
  WHERE $7::bool AND h0.skip AND o.ordering_key = $3 AND o.sequence = $4 AND o.published_at IS NULL
),
nxt AS (SELECT min(sequence) AS s FROM ` + tbl + ` WHERE ordering_key = $3 AND sequence > $4 AND sequence <= $5 AND published_at IS NULL AND dead_at IS NULL AND skipped_at IS NULL),
del AS (
  DELETE FROM ` + holds + ` AS h WHERE h.ordering_key = $3 AND h.sequence = $4 AND (SELECT replay FROM h0)
  RETURNING 1
),
upd AS (
  UPDATE ` + holds + ` AS h SET sequence = COALESCE((SELECT s FROM nxt), h.sequence), attempts = 0, available_at = now(),
    last_error = NULL, dead_at = NULL, skip_requested_at = NULL, created_at = now(),
    resolved_at = CASE WHEN (SELECT s FROM nxt) IS NULL THEN now() END
  WHERE h.ordering_key = $3 AND h.sequence = $4 AND h.resolved_at IS NULL AND NOT (SELECT replay FROM h0)
  RETURNING h.sequence, h.resolved_at IS NOT NULL AS resolved
)
SELECT EXISTS (SELECT 1 FROM own), (SELECT sequence FROM upd WHERE NOT resolved), EXISTS (SELECT 1 FROM upd WHERE resolved),
  EXISTS (SELECT 1 FROM del)`
	q.CleanResolved = `DELETE FROM ` + holds + ` AS h USING ` + parts + ` AS p
WHERE h.partition = p.partition AND p.owner = $1 AND p.lease_until > now() AND h.resolved_at IS NOT NULL AND h.sequence <= p.floor_sequence`
	active := `h.resolved_at IS NULL`
	keyed := `SELECT o.sequence, o.created_at, o.ordering_key
  FROM ` + parts + ` AS p CROSS JOIN LATERAL (
    SELECT k.sequence, k.created_at, k.ordering_key FROM ` + tbl + ` AS k
    WHERE k.ordering_partition = p.partition AND k.ordering_key IS NOT NULL AND k.sequence > p.floor_sequence AND k.published_at IS NULL
      AND k.dead_at IS NULL AND k.skipped_at IS NULL
  ) AS o
  UNION
  SELECT o.sequence, o.created_at, o.ordering_key
  FROM ` + holds + ` AS h JOIN ` + tbl + ` AS o ON o.ordering_key = h.ordering_key AND o.published_at IS NULL AND o.dead_at IS NULL
    AND o.skipped_at IS NULL AND (o.sequence = h.sequence OR (o.sequence > h.sequence AND NOT h.replay))
  WHERE ` + active
	q.Stats = `WITH keyed AS (` + keyed + `),
marked AS (
  SELECT k.created_at, EXISTS (SELECT 1 FROM ` + holds + ` AS h WHERE h.ordering_key = k.ordering_key AND h.sequence = k.sequence AND h.dead_at IS NOT NULL AND ` + active + `) AS dead
  FROM keyed AS k
),
unkeyed AS (
  SELECT count(*) FILTER (WHERE dead_at IS NULL AND ordering_key IS NULL) AS pending,
    count(*) FILTER (WHERE locked_at IS NOT NULL AND ordering_key IS NULL) AS locked,
    count(*) FILTER (WHERE dead_at IS NOT NULL) AS dead, min(created_at) FILTER (WHERE dead_at IS NULL AND ordering_key IS NULL) AS oldest
  FROM ` + tbl + ` WHERE published_at IS NULL AND (ordering_key IS NULL OR dead_at IS NOT NULL)
)
SELECT u.pending + (SELECT count(*) FROM marked WHERE NOT dead), u.locked, u.dead + (SELECT count(*) FROM marked WHERE dead),
  COALESCE(extract(epoch FROM now() - LEAST(u.oldest, (SELECT min(created_at) FROM marked WHERE NOT dead)))::float8, 0)
FROM unkeyed AS u`
	q.HeldKeys = `SELECT count(*), count(*) FILTER (WHERE dead_at IS NOT NULL) FROM ` + holds + ` AS h WHERE ` + active
	// The rows a hold keeps (its row and, but for a replay hold, the key's
	// later rows) are left out before each partition's LIMIT: a held key's
	// backlog at the bottom of a partition must not fill the batch and stop
	// the cleaning of the partition's other keys.
	q.DeleteDone = `WITH victims AS (
  SELECT o.id, o.x FROM ` + parts + ` AS p CROSS JOIN LATERAL (
    SELECT k.id, k.xmin AS x FROM ` + tbl + ` AS k
    WHERE k.ordering_partition = p.partition AND k.ordering_key IS NOT NULL AND k.sequence <= p.floor_sequence
      AND k.dead_at IS NULL AND k.created_at < now() - ` + ttl("$1") + `
      AND NOT EXISTS (SELECT 1 FROM ` + holds + ` AS h WHERE h.ordering_key = k.ordering_key AND ` + active + `
        AND (k.sequence = h.sequence OR (k.sequence > h.sequence AND NOT h.replay)))
    ORDER BY k.sequence LIMIT $2
  ) AS o
  LIMIT $2
)
DELETE FROM ` + tbl + ` AS o USING victims WHERE o.id = victims.id AND o.xmin = victims.x`
	q.ReplayDone = `WITH r AS (
  SELECT o.ordering_key, o.ordering_partition, o.sequence, o.sequence <= p.floor_sequence AS done, p.floor_sequence AS floor,
    NOT EXISTS (SELECT 1 FROM ` + holds + ` AS h WHERE h.ordering_key = o.ordering_key
      AND NOT (h.resolved_at IS NOT NULL AND h.sequence <= p.floor_sequence)) AS free
  FROM ` + tbl + ` AS o JOIN ` + parts + ` AS p ON p.partition = o.ordering_partition
  WHERE o.event_id = $1::uuid AND o.ordering_key IS NOT NULL
), touch AS (
  UPDATE ` + tbl + ` AS o SET dead_at = NULL, skipped_at = NULL, published_at = NULL FROM r WHERE o.event_id = $1::uuid AND r.done AND r.free
  RETURNING 1
), ins AS (
  INSERT INTO ` + holds + ` AS h (ordering_key, partition, sequence, attempts, available_at, replay)
  SELECT r.ordering_key, r.ordering_partition, r.sequence, 0, now(), true FROM r WHERE r.done AND EXISTS (SELECT 1 FROM touch)
  ON CONFLICT (ordering_key) DO UPDATE SET sequence = EXCLUDED.sequence, partition = EXCLUDED.partition, attempts = 0,
    available_at = now(), last_error = NULL, dead_at = NULL, skip_requested_at = NULL, replay = true, resolved_at = NULL, created_at = now(),
    ` + orderedTakeover + `
  WHERE h.resolved_at IS NOT NULL AND h.sequence <= (SELECT floor FROM r)
  RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM ins), NOT COALESCE((SELECT done FROM r), false),
  (SELECT h.sequence FROM ` + holds + ` AS h, r WHERE h.ordering_key = r.ordering_key AND h.resolved_at IS NULL)`
	q.Keyed = `SELECT ordering_key IS NOT NULL FROM ` + tbl + ` WHERE event_id = $1::uuid`
	return q
}

// OrderedTablesExist reports whether the companion tables of ordered mode
// exist for t.
func OrderedTablesExist(ctx context.Context, q schema.Querier, t schema.Table) (bool, error) {
	var ok bool
	err := q.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL AND to_regclass($2) IS NOT NULL AND to_regclass($3) IS NOT NULL
  AND (SELECT count(*) FROM pg_attribute WHERE attrelid = to_regclass($3) AND attname IN ('resolved_at', 'replay') AND NOT attisdropped) = 2`,
		t.PartitionsTable(), t.RelaysTable(), t.HoldsTable()).Scan(&ok)
	if err != nil {
		return false, fmt.Errorf("look up the ordered-mode tables of %s: %w", t, err)
	}
	return ok, nil
}

// CheckOrderedSequence fails with schema.ErrSequenceCached when the sequence of
// t's sequence column caches more than one value per session. Ordered mode
// reads the sequence's last value as the bound of what a writer holding a
// key lock may still commit; with a cache a session hands out lower values
// later, so a committed row could fall below the relay's scan position.
func CheckOrderedSequence(ctx context.Context, q schema.Querier, t schema.Table) error {
	var seq string
	var cache int64
	err := q.QueryRow(ctx, `SELECT s.seqrelid::regclass::text, s.seqcache FROM pg_sequence AS s
WHERE s.seqrelid = pg_get_serial_sequence($1, 'sequence')::regclass`, t.Sanitize()).Scan(&seq, &cache)
	if errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("the sequence column of %s has no owned sequence (BIGSERIAL); recreate it with outbox migrate", t)
	}
	if err != nil {
		return fmt.Errorf("look up the sequence of %s: %w", t, err)
	}
	if cache > 1 {
		return fmt.Errorf("%s has CACHE %d: run `ALTER SEQUENCE %s CACHE 1` (ordered mode and the WAL relay need sequence values handed out in commit-lock order): %w",
			seq, cache, seq, schema.ErrSequenceCached)
	}
	return nil
}

// RelayModeOthers is how CheckRelayMode learns of relays of the other mode
// in the caller's own process that share its connection (their locks carry
// the caller's pid, which the check leaves out): the number of them.
type RelayModeOthers int

// CheckRelayMode fails with schema.ErrRelayModeMix when a relay of the other mode
// could work on t, naming what shows it. For an ordered relay (ordered
// true) that is a session holding the default relays' mode lock
// (RelayModeLockKey(false): every subscribed default-mode relay, idle or
// standby, holds it), the table's single-active lock (leaderKey), or a
// keyed row under a lease younger than lockTTL (a default-mode relay of an
// earlier version; a lease that expired proves nothing runs). For a
// default-mode relay it is a session holding the ordered relays' mode lock
// or a live partition lease. A relay that holds its own mode's lock before
// it checks (Subscriber does, on its LISTEN connection, for as long as it
// has a subscription) makes the refusal hold for as long as both could
// run: of two relays of different modes that start together, at least one
// sees the other. inProcess counts the relays of the other mode that share
// the caller's connection (0 when the caller holds no mode lock).
func CheckRelayMode(ctx context.Context, q schema.Querier, t schema.Table, ordered bool, leaderKey int64, lockTTL time.Duration, inProcess RelayModeOthers) error {
	if inProcess > 0 {
		return fmt.Errorf("%d relay(s) of the other mode run on %s in this process; %s: %w", inProcess, t, relayModeFix(ordered), schema.ErrRelayModeMix)
	}
	holder, err := pgmeta.Holder(ctx, q, RelayModeLockKey(t, !ordered))
	if err != nil {
		return fmt.Errorf("look up the relays of %s: %w", t, err)
	}
	if holder != "" {
		return fmt.Errorf("%s relay is subscribed to %s (%s); %s: %w", modeName(!ordered), t, holder, relayModeFix(ordered), schema.ErrRelayModeMix)
	}
	if ordered {
		if holder, err = pgmeta.Holder(ctx, q, leaderKey); err != nil {
			return fmt.Errorf("look up the relays of %s: %w", t, err)
		}
		if holder != "" {
			return fmt.Errorf("a default-mode relay holds the single-active lock of %s (%s); %s: %w", t, holder, relayModeFix(ordered), schema.ErrRelayModeMix)
		}
		var leaseAge *float64
		err := q.QueryRow(ctx, `SELECT extract(epoch FROM now() - max(GREATEST(locked_at, available_at)))::float8 FROM `+t.Sanitize()+`
WHERE ordering_key IS NOT NULL AND published_at IS NULL AND `+LeaseLiveWithin("$1::float8"), lockTTL.Seconds()).Scan(&leaseAge)
		if err != nil {
			return fmt.Errorf("look up the relays of %s: %w", t, err)
		}
		if leaseAge != nil {
			return fmt.Errorf("a default-mode relay leased keyed rows of %s %.1fs ago (a lease lasts LockTTL %s; an expired lease would not count); %s: %w",
				t, *leaseAge, lockTTL, relayModeFix(ordered), schema.ErrRelayModeMix)
		}
		return nil
	}
	var exists bool
	if err := q.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, t.PartitionsTable()).Scan(&exists); err != nil {
		return fmt.Errorf("look up the ordered-mode tables of %s: %w", t, err)
	}
	if !exists {
		return nil
	}
	var live bool
	if err := q.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+t.PartitionsTable()+` WHERE owner IS NOT NULL AND lease_until > now())`).Scan(&live); err != nil {
		return fmt.Errorf("look up the ordered relays of %s: %w", t, err)
	}
	if live {
		return fmt.Errorf("ordered relays own partitions of %s; %s: %w", t, relayModeFix(ordered), schema.ErrRelayModeMix)
	}
	return nil
}

func modeName(ordered bool) string {
	if ordered {
		return "an ordered-mode"
	}
	return "a default-mode"
}

// relayModeFix says what the operator of a refused relay does.
func relayModeFix(ordered bool) string {
	if ordered {
		return "stop it first, or start this relay without Ordered"
	}
	return "start this relay with Ordered (OUTBOX_RELAY_ORDERED=true), or stop them first"
}

// OrderedReady reports whether t has what ordered mode needs (its
// companion tables, the hold states of migration 000005, the partitions'
// term of 000006, the one holds table of 000011 and skipped_at of 000012)
// and how many holds the
// WAL relay keeps open in it (they refuse the switch, OpenHoldsOfOtherMode):
// one round trip, but for a table a WAL relay of an older version left its
// holds table in.
func OrderedReady(ctx context.Context, q schema.Querier, t schema.Table) (ready bool, walOpen int64, err error) {
	var legacy bool
	err = q.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL AND to_regclass($2) IS NOT NULL
  AND EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = 'epoch' AND NOT attisdropped)
  AND `+skippedAtExists(t)+`,
  (SELECT count(*) FROM `+t.HoldsTable()+` AS h WHERE h.mode = 'wal' AND h.resolved_at IS NULL),
  to_regclass($3) IS NOT NULL`,
		t.PartitionsTable(), t.RelaysTable(), LegacyWALHoldsTable(t)).Scan(&ready, &walOpen, &legacy)
	var pgErr *pgconn.PgError
	// No holds table (42P01), or one without this version's columns: 42703,
	// or 42809 for h.mode, which PostgreSQL reads as the aggregate mode(h)
	// when the table has no such column.
	if errors.As(err, &pgErr) && (pgErr.Code == "42P01" || pgErr.Code == "42703" || pgErr.Code == "42809") {
		return false, 0, nil
	}
	if err != nil {
		return false, 0, fmt.Errorf("look up the ordered-mode tables of %s: %w", t, err)
	}
	if ready && legacy {
		n, err := legacyOpenWALHolds(ctx, q, t)
		if err != nil {
			return false, 0, err
		}
		walOpen += n
	}
	return ready, walOpen, nil
}

// SwitchesToOrdered reports whether an ordered relay's start switches t to
// ordered mode (schema.SwitchMode, which creates ordered mode's companion
// tables that t lacks): t has its mode table (migration 000010) and
// another mode, or none, is recorded in it.
func SwitchesToOrdered(ctx context.Context, q schema.Querier, t schema.Table) (bool, error) {
	var ok bool
	if err := q.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, modeTable(t)).Scan(&ok); err != nil {
		return false, fmt.Errorf("look up the relay mode of %s: %w", t, err)
	}
	if !ok {
		return false, nil
	}
	rec, recorded, err := schema.RecordedMode(ctx, q, t)
	if err != nil {
		return false, err
	}
	return !recorded || rec.Mode != schema.ModeOrdered, nil
}

// OrderedTermExists reports whether the partitions table of t has the
// lease's term (epoch, migration 000006), which ordered relays of this
// version fence their writes on. The runbook and the cleaner do not need
// it: they work on tables an older relay still serves.
func OrderedTermExists(ctx context.Context, q schema.Querier, t schema.Table) (bool, error) {
	var ok bool
	err := q.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = 'epoch' AND NOT attisdropped)`,
		t.PartitionsTable()).Scan(&ok)
	if err != nil {
		return false, fmt.Errorf("look up the partitions' term of %s: %w", t, err)
	}
	return ok, nil
}

// LockKey is t's single-active lock (the leader lock).
func LockKey(t schema.Table) int64 { return pgmeta.Leader(t.Qualified()) }

// IdleLockKey is the lock of t's wake-up handshake (docs/ARCHITECTURE.md,
// "Wake-up").
func IdleLockKey(t schema.Table) int64 { return pgmeta.Idle(t.Qualified()) }

// OrderedIdleLockKey is the idle lock of t's ordered relays.
func OrderedIdleLockKey(t schema.Table) int64 { return pgmeta.OrderedIdle(t.Qualified()) }

// RelayModeLockKey is the lock every relay of one mode holds in shared mode
// while it has a subscription on t (CheckRelayMode).
func RelayModeLockKey(t schema.Table, ordered bool) int64 {
	return pgmeta.RelayMode(t.Qualified(), ordered)
}

// NotifyChannel is the channel on which enqueues of t wake relays.
func NotifyChannel(t schema.Table) string { return pgmeta.NotifyChannel(t.Qualified()) }

// FailArgs are the arguments of OrderedQueries.Fail.
type FailArgs struct {
	Relay       string  // the relay's id, owner of the partition's lease
	Partition   int     // the row's partition
	Key         string  // the row's ordering key
	Sequence    int64   // the row's sequence
	LastError   string  // the failure, as last_error keeps it
	MaxAttempts int     // the attempts after which the row is dead
	Permanent   bool    // the failure is permanent: dead at once
	Backoff     float64 // seconds until the next attempt
	Epoch       int64   // the lease's term the write is fenced on
}

// Fail records a failed attempt of a keyed row as its key's hold, fenced on
// the relay's lease in its term. A resolved hold below the row is replaced;
// a hold at the row counts one more attempt and keeps a requested skip.
// Returns: dead, attempts, skip requested (no row when not owned or the key
// has another hold).
func (q *OrderedQueries) Fail(a FailArgs) Statement {
	return Statement{SQL: q.fail, Args: []any{a.Relay, a.Partition, a.Key, a.Sequence, a.LastError, a.MaxAttempts, a.Permanent, a.Backoff, a.Epoch}}
}

// AdvanceArgs are the arguments of OrderedQueries.Advance.
type AdvanceArgs struct {
	Relay     string // the relay's id, owner of the partition's lease
	Partition int    // the key's partition
	Key       string // the held key
	Sequence  int64  // the hold's sequence, whose row succeeded or was skipped
	Bound     int64  // the highest sequence the next row may have
	Epoch     int64  // the lease's term the write is fenced on
	// Skipped: the row was not acked (the relay applies an operator's
	// skip). When the hold's skip was requested, the row records it:
	// skipped_at, with the hold's attempts and last_error (the row's own
	// when the hold has none: a replay skipped before it was tried). A
	// replay hold's row too: a skip is final once applied, whatever replay
	// came before it (docs/OPERATIONS.md, "The row's states").
	Skipped bool
}

// Advance moves the hold of a key, whose row succeeded or was skipped, to
// the key's next row at or below Bound, fenced on the relay's lease in its
// term; without a next row the hold is resolved (kept as a tombstone); a
// replay hold is deleted. A skipped row is marked skipped in the same
// statement (AdvanceArgs.Skipped). Returns: owned, next sequence (NULL
// when none), resolved, deleted.
func (q *OrderedQueries) Advance(a AdvanceArgs) Statement {
	return Statement{SQL: q.advance, Args: []any{a.Relay, a.Partition, a.Key, a.Sequence, a.Bound, a.Epoch, a.Skipped}}
}

// Release gives the relay's partitions back with their floors (same order),
// fenced like Renew on the terms (same order).
func (q *OrderedQueries) Release(relay string, partitions []int32, floors, epochs []int64) Statement {
	return Statement{SQL: q.release, Args: []any{relay, partitions, floors, epochs}}
}
