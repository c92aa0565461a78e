package sqlq

import (
	"strconv"
	"strings"
	"time"

	"github.com/outboxkit/watermill-outbox/schema"
)

// Queries holds every statement the project runs against one outbox table,
// rendered once for the table's name and optional columns. All values travel
// as parameters; only the sanitized table name is spliced in. Parameters are
// typed with explicit casts and passed as text where pgx's simple protocol
// (PgBouncer) would otherwise guess wrong, so the statements work under every
// pgx QueryExecMode.
type Queries struct {
	Table   schema.Table
	Columns schema.Columns

	// Enqueue inserts one row, idempotent on event_id, and wakes relays when
	// it wrote the row: one INSERT ... ON CONFLICT (event_id) DO NOTHING
	// RETURNING, with the wake-up (the shared try of the idle lock and, when
	// it fails, NOTIFY) in the RETURNING list, so that it runs only for a row
	// written. An existing event_id is left alone (no row lock, so a
	// producer's open transaction never holds up the relay's ack of that
	// row) and returns no row: then read and compare it with ExistingEvents
	// (a second round trip, for a re-enqueue only). The existing row is not
	// read in the statement: a CTE with the INSERT and a UNION with that
	// read cost PostgreSQL about 20% more CPU per new row than this form
	// (docs/BENCHMARKS.md, section 4b).
	// Args: tenant_id, topic, payload, event_id (all text), notify channel (""
	// for none),
	// then traceparent, tracestate when schema.Columns.TraceContext, then headers
	// when schema.Columns.Headers, then ordering_key when schema.Columns.OrderingKey.
	// Returns, for a row written: sequence, then a NULL-tested NOTIFY
	// column (ignore it).
	Enqueue string
	// EnqueueQuiet is Enqueue for a writer that wakes no relay
	// (publisher.Config.DisableNotify, or a table the WAL relay streams)
	// and a row without an ordering key: one INSERT ... ON CONFLICT
	// (event_id) DO NOTHING RETURNING sequence, the cheapest statement that
	// keeps Enqueue idempotent. Args: those of Enqueue without $5 (the
	// channel), the optional columns renumbered from $5. Returns the
	// sequence, or no row when the event_id exists: then read it with
	// ExistingEvents.
	EnqueueQuiet string

	// EnqueueBatch is Enqueue for many rows, as text arrays in the same
	// argument order, skipping event_ids that exist. It returns one row (so
	// that database/sql drivers read it too): "event_id:sequence,..." for
	// the rows written; the rows that existed before the statement, as the
	// JSON of ExistingEvents; and a NULL-tested NOTIFY column. It wakes
	// relays only when it wrote a row. An event_id in neither list was
	// committed by a concurrent transaction: read it with ExistingEvents.
	EnqueueBatch string

	// ExistingEvents looks up rows by event_id, for the event_ids that an
	// enqueue skipped. Args: event_ids, payloads (text arrays, same order).
	// Returns one JSON array of [event_id, sequence, tenant_id, topic,
	// same_payload], same_payload comparing the stored and the given payload
	// as jsonb (key order and whitespace do not matter).
	ExistingEvents string

	// UndoEnqueue deletes rows that an EnqueueBatch of the same transaction
	// wrote, when a conflict makes the batch write nothing. Args: event_ids
	// (text array). Returns: rows deleted.
	UndoEnqueue string

	// ClaimAll and ClaimTopic lease up to a batch of due rows: unpublished,
	// not dead (dead_at IS NULL), not skipped (skipped_at IS NULL, when
	// schema.Columns.SkippedAt), due, and not leased or with an expired
	// lease. Re-claiming a row whose lease expired records that in
	// last_error. A row whose lease expired on its last allowed attempt
	// (attempts >= max_attempts) is not claimed but parked dead (dead_at =
	// now(), available_at = 'infinity', locked_at = NULL, last_error saying
	// the lease expired) by the same statement, which also records its
	// death notice when schema.Columns.DeadNotices (deadnotices.go), and
	// returned with parked = true so that the relay counts it. max_attempts plays no other part:
	// raising it does not revive dead rows, lowering it does not kill rows
	// that are retrying (they die when their next attempt fails). See
	// docs/ARCHITECTURE.md, "The relay".
	// Args: max_attempts, lock_ttl seconds (float8), batch size, and for
	// ClaimTopic the topic. Returns the claimed columns (see ClaimedRow;
	// ordering_key last when schema.Columns.OrderingKey), then parked; read
	// them with ClaimedRow.ScanClaim.
	ClaimAll   string
	ClaimTopic string

	// AdapterClaimAll and AdapterClaimTopic are ClaimAll and ClaimTopic
	// without the parked rows and column, for the watermill-sql adapters:
	// they return only the rows leased, read with ClaimedRow.Scan.
	AdapterClaimAll   string
	AdapterClaimTopic string

	// ClaimAllUnkeyed and ClaimTopicUnkeyed are ClaimAll and ClaimTopic
	// restricted to rows without an ordering key: ordered mode claims only
	// those, keyed rows go through OrderedQueries. Empty unless
	// schema.Columns.OrderingKey.
	ClaimAllUnkeyed   string
	ClaimTopicUnkeyed string

	// ClaimAllExcept and ClaimAllUnkeyedExcept are ClaimAll and
	// ClaimAllUnkeyed that skip the rows of the paused topics, passed as a
	// fourth argument (text array, not empty): the relays use them only
	// while a topic is paused, and ClaimAll or ClaimAllUnkeyed otherwise. ClaimAllUnkeyedExcept is empty unless schema.Columns.OrderingKey.
	ClaimAllExcept        string
	ClaimAllUnkeyedExcept string

	// LockKeys takes the per-key transaction-level advisory locks that
	// serialise the writers of one ordering key (docs/ORDERING.md), in hash
	// order so that two writers never deadlock on one statement. Args: the
	// table's lock class (int4, schema.Table.LookupOrderingLockClass), keys (text
	// array).
	// Empty unless schema.Columns.OrderingKey.
	LockKeys string

	// Ack marks leased rows published, fenced by (id, attempts, locked_at).
	// Args: ids, attempts, locked_ats (arrays). Returns: id::text,
	// extract(epoch from published_at - created_at).
	Ack string

	// nack releases one leased row for a retry or, at max attempts or for a
	// permanent error, marks it dead (dead_at = now()). Fenced like Ack. A
	// dead row is parked at available_at = 'infinity', after every due row
	// in the claim index, so that dead rows cost claims nothing (parked at
	// now() instead, with 100,000 dead rows that made every claim walk them
	// all, 14x slower).
	// Run it through Nack. Returns: dead.
	nack string

	// Extend renews the lease of one row that is still being handled. It
	// leaves locked_at, the fence token set by the claim, alone and records
	// the renewal in available_at, which a leased row does not otherwise
	// use: a lease lasts lock_ttl from GREATEST(locked_at, available_at)
	// (LeaseExpiredSince). So a renewal that committed but whose reply was
	// lost changes nothing the relay fences on, and the later ack or nack
	// still matches. Fenced like Ack. Args: id, attempts, locked_at. Command
	// tag: 1 when renewed, 0 when the lease passed to another holder.
	Extend string

	// Release gives leases back without an attempt's verdict, when a
	// subscription stops: locked_at = NULL, due now, and attempts lowered
	// by the undo argument (1 for rows never delivered, 0 for rows whose
	// handler did not answer). A row left at or above max_attempts (the
	// handler did not answer on the last allowed attempt) is parked dead
	// instead, with its death notice when schema.Columns.DeadNotices.
	// Fenced like Ack.
	// Args: ids, attempts, locked_ats (arrays), undo, max_attempts.
	// Returns: id::text, topic, dead, for the rows released.
	Release string

	// TakeBack makes every lease of the table due again at once: the
	// statement of a relay that has just taken the single-active lock.
	// Getting the lock proves that the previous holder's session is gone,
	// and a relay gives the lock back only after its leases are settled
	// (Close), so every lease still in the table is orphaned: its holder
	// crashed, was cut off or stepped down. Like a lease that expired, the
	// attempt counts (last_error says so) and a row leased on its last
	// allowed attempt is parked dead, with its death notice when
	// schema.Columns.DeadNotices. locked_at is cleared, so the previous
	// holder's late ack or nack is fenced out. Args: max_attempts.
	// Returns: id::text, topic, dead, for the rows taken back.
	TakeBack string

	// Stats reads the gauges of one table. No args. Returns: pending
	// (unpublished and not dead, leased and retrying rows included), locked,
	// dead (dead_at set), oldest pending age in seconds.
	Stats string

	// DeletePublished deletes up to a batch of rows published before a
	// retention. Args: retention seconds, batch size. Command tag: rows.
	DeletePublished string

	// EnqueueLeased is EnqueueQuiet for the hot path: the row is written
	// leased (locked_at, attempts 1), and a second column returns it as
	// the claim reads it (LeaseRequest.Decode). Args: those of
	// EnqueueQuiet.
	EnqueueLeased string

	// EnqueueBatchLeased is EnqueueBatch for the hot path: the rows are
	// written leased (locked_at, attempts 1), no NOTIFY is sent, and a
	// fourth column returns the written rows as the claim reads them
	// (LeaseRequest.Decode). Args: those of EnqueueBatch ($5 unused).
	EnqueueBatchLeased string

	// AckUpToInTx is the watermill-sql offsets-style ack used by Adapter: it
	// marks published the rows this same transaction claimed (locked_at =
	// now()) up to a sequence. Args: sequence.
	AckUpToInTx string

	// ClaimNotices and ClaimNoticesTopic lease up to a batch of the due
	// death notices (deadnotices.go) whose rows are still dead of the
	// death they record, for one delivery each (due_at moves LockTTL
	// ahead, tries counts it), and drop in the same statement the stale
	// ones and those already delivered NoticeTries times (returned with a
	// nil lease, to be logged). Args: NoticeTries, lock_ttl seconds
	// (float8), batch size, and for ClaimNoticesTopic the topic. Returns
	// the dead rows as a claim returns them, in sequence order; read them
	// with ClaimedNotice.ScanNotice. Empty unless schema.Columns.DeadNotices.
	ClaimNotices      string
	ClaimNoticesTopic string
	// NoticeDone deletes a notice the router answered, fenced by its lease
	// (due_at). Args: id, due_at. Command tag: 1 when deleted.
	NoticeDone string
	// NoticeRenew moves the lease of a notice still in a handler LockTTL
	// ahead, fenced like NoticeDone. Args: id, due_at, lock_ttl seconds.
	// Returns the new due_at, no row when the lease passed on.
	NoticeRenew string
	// NoticeGiveBack makes a leased notice that was not handed over due
	// again at once, its delivery not counted. Fenced like NoticeDone.
	// Args: id, due_at.
	NoticeGiveBack string
}

// NewQueries renders the statements for table t with optional columns c.
func NewQueries(t schema.Table, c schema.Columns) *Queries {
	tbl := t.Sanitize()
	q := &Queries{Table: t, Columns: c}

	insertCols := []string{ColumnTenantID, ColumnTopic, ColumnPayload, ColumnEventID}
	values := []string{"$1::uuid", "$2", "$3::jsonb", "$4::uuid"}
	unnestArgs := []string{"$1::text[]", "$2::text[]", "$3::text[]", "$4::text[]"}
	unnestCols := []string{"u.c1::uuid", "u.c2", "u.c3::jsonb", "u.c4::uuid"}
	aliases := []string{"c1", "c2", "c3", "c4"}
	next := 6 // $5 is the notify channel
	add := func(col, cast string) {
		insertCols = append(insertCols, col)
		n := itoa(next)
		values = append(values, "$"+n+cast)
		unnestArgs = append(unnestArgs, "$"+n+"::text[]")
		alias := "c" + n
		aliases = append(aliases, alias)
		unnestCols = append(unnestCols, "u."+alias+cast)
		next++
	}
	if c.TraceContext {
		add(ColumnTraceParent, "")
		add(ColumnTraceState, "")
	}
	if c.Headers {
		add(ColumnHeaders, "::jsonb")
	}
	keyArg := ""
	if c.OrderingKey {
		keyArg = "$" + itoa(next)
		add(ColumnOrderingKey, "")
		q.LockKeys = lockKeysStatement
	}
	// NOTIFY only when a relay is idle: an idle relay holds the table's idle
	// lock exclusively, so the shared try fails. When it succeeds, no relay
	// is idle, and the shared lock, held to the end of this transaction,
	// keeps any relay from going idle before this row is visible to it
	// (docs/ARCHITECTURE.md, "Wake-up"). Writers never wait on each other:
	// shared locks do not conflict.
	idleKey := strconv.FormatInt(IdleLockKey(t), 10)
	notify := `(SELECT pg_notify($5, '') WHERE $5 <> '' AND NOT pg_try_advisory_xact_lock_shared(` + idleKey + `)`
	batchNotify := notify
	if c.OrderingKey {
		// A keyed row wakes the ordered relays, an unkeyed one the claim
		// loop: each kind tries its own idle lock. A batch tries the lock
		// of each kind it holds (when one try fails it notifies anyway,
		// which wakes both).
		okey := strconv.FormatInt(OrderedIdleLockKey(t), 10)
		notify = `(SELECT pg_notify($5, '') WHERE $5 <> '' AND NOT pg_try_advisory_xact_lock_shared(CASE WHEN ` + keyArg + `::text IS NULL THEN ` + idleKey + ` ELSE ` + okey + ` END)`
		kcol := "u.c" + keyArg[1:]
		batchNotify = `(SELECT pg_notify($5, '') WHERE $5 <> '' AND (
    (EXISTS (SELECT 1 FROM u WHERE ` + kcol + ` IS NULL) AND NOT pg_try_advisory_xact_lock_shared(` + idleKey + `))
    OR (EXISTS (SELECT 1 FROM u WHERE ` + kcol + ` IS NOT NULL) AND NOT pg_try_advisory_xact_lock_shared(` + okey + `)))`
	}

	// With an ordering key, the statement takes the key's lock first (lk is
	// aggregated before the row is formed, so before its sequence value):
	// one round trip instead of two (docs/ORDERING.md, "Writers serialise
	// per key").
	enqueueHead := `INSERT INTO ` + tbl + ` (` + strings.Join(insertCols, ", ") + `) VALUES (` + strings.Join(values, ", ") + `)`
	batchSource := `FROM u`
	batchLock := ``
	if c.OrderingKey {
		class := OrderingLockClassSQL(t)
		enqueueHead = `WITH lk AS MATERIALIZED (SELECT count(pg_advisory_xact_lock(` + class + `, hashtext(` + keyArg + `::text))) AS n WHERE ` + keyArg + `::text IS NOT NULL)
INSERT INTO ` + tbl + ` (` + strings.Join(insertCols, ", ") + `) SELECT ` + strings.Join(values, ", ") + ` FROM lk`
		batchLock = `
lk AS MATERIALIZED (SELECT count(pg_advisory_xact_lock(` + class + `, h)) AS n
  FROM (SELECT DISTINCT hashtext(k) AS h FROM unnest(` + keyArg + `::text[]) AS k WHERE k IS NOT NULL ORDER BY 1) AS s),`
		batchSource = `FROM u, lk`
	}
	q.Enqueue = enqueueHead + `
ON CONFLICT (` + ColumnEventID + `) DO NOTHING
RETURNING sequence, ` + notify + `) IS NULL`

	quiet := make([]string, len(values))
	for i, v := range values {
		quiet[i] = v
		if i >= 4 { // $6... become $5...: there is no channel argument
			num, rest, _ := strings.Cut(v[1:], ":")
			n, _ := strconv.Atoi(num)
			quiet[i] = "$" + itoa(n-1)
			if rest != "" {
				quiet[i] += ":" + rest
			}
		}
	}
	q.EnqueueQuiet = `INSERT INTO ` + tbl + ` (` + strings.Join(insertCols, ", ") + `) VALUES (` + strings.Join(quiet, ", ") + `)
ON CONFLICT (` + ColumnEventID + `) DO NOTHING RETURNING sequence`
	q.EnqueueLeased = `INSERT INTO ` + tbl + ` AS o (` + strings.Join(insertCols, ", ") + `, locked_at, attempts) VALUES (` + strings.Join(quiet, ", ") + `, clock_timestamp(), 1)
ON CONFLICT (` + ColumnEventID + `) DO NOTHING RETURNING o.sequence, json_build_array(json_build_array(` + strings.Join(claimExprs(c), ", ") + `))`

	// enqueueBatch renders the batch enqueue; leased renders the hot path's
	// (HotPath, LeaseRequest): the rows are written leased to the writer's
	// process as a claim would lease them and returned as the claim reads
	// them, without the NOTIFY (no relay needs waking).
	enqueueBatch := func(leased bool) string {
		into, cols, vals, ret := tbl, joinComma(insertCols), joinComma(unnestCols), `event_id, sequence`
		tail := batchNotify + ` AND EXISTS (SELECT 1 FROM ins)) IS NULL`
		if leased {
			into, cols, vals = tbl+` AS o`, cols+`, locked_at, attempts`, vals+`, clock_timestamp(), 1`
			ret = `o.event_id, o.sequence, json_build_array(` + joinComma(claimExprs(c)) + `) AS leased`
			tail = `$5::text IS NOT NULL,
  (SELECT COALESCE(json_agg(leased), '[]'::json) FROM ins)`
		}
		return `WITH u AS (SELECT * FROM unnest(` + joinComma(unnestArgs) + `) AS u(` + joinComma(aliases) + `)),` + batchLock + `
ins AS (INSERT INTO ` + into + ` (` + cols + `)
SELECT ` + vals + ` ` + batchSource + `
ON CONFLICT (` + ColumnEventID + `) DO NOTHING RETURNING ` + ret + `),
ex AS (
  SELECT o.event_id, o.sequence, o.tenant_id, o.topic, o.payload = u.c3::jsonb AS same_payload
  FROM u JOIN ` + tbl + ` AS o ON o.event_id = u.c4::uuid
  WHERE u.c4::uuid NOT IN (SELECT event_id FROM ins)
)
SELECT (SELECT COALESCE(string_agg(event_id::text || ':' || sequence::text, ','), '') FROM ins),
  (SELECT ` + existingJSON + ` FROM ex),
  ` + tail
	}
	q.EnqueueBatch = enqueueBatch(false)
	q.EnqueueBatchLeased = enqueueBatch(true)

	q.ExistingEvents = `SELECT ` + existingJSON + `
FROM (SELECT o.event_id, o.sequence, o.tenant_id, o.topic, o.payload = u.p::jsonb AS same_payload
  FROM unnest($1::text[], $2::text[]) AS u(e, p) JOIN ` + tbl + ` AS o ON o.event_id = u.e::uuid) AS ex`

	q.UndoEnqueue = `WITH d AS (DELETE FROM ` + tbl + ` WHERE event_id = ANY($1::text[]::uuid[]) RETURNING 1)
SELECT count(*) FROM d`

	// A row parked dead by a claim, a release or a take-back died without
	// its failure reaching the router: each such statement records its
	// death notice (deadnotices.go) when the table has the notices' table.
	notices := func(source, id, cond string) string {
		if !c.DeadNotices {
			return ``
		}
		return `, ` + recordNotices(t, source, id, cond)
	}
	claim := func(topicFilter string, adapter bool) string {
		// A row leased on its last allowed attempt whose lease expired (the
		// relay crashed, hung, or its ack or nack write failed) is parked
		// dead by the claim that finds it, instead of being claimed again.
		parking := `(o.locked_at IS NOT NULL AND o.attempts >= $1::int)`
		out := claimColumns(c)
		if !adapter {
			out += `, parked`
		}
		filter, noticed := ``, notices("claimed", "c1::uuid", "parked")
		if adapter {
			// The adapters' users relay through watermill-sql, not the
			// forwarder: nobody would deliver the notices.
			filter, noticed = ` WHERE NOT parked`, ``
		}
		// A skipped row (skipped_at, written by a keyed relay) is done:
		// no claim delivers it again (a replay clears skipped_at).
		if c.SkippedAt {
			topicFilter = "\n    AND skipped_at IS NULL" + topicFilter
		}
		return `WITH due AS (
  SELECT id FROM ` + tbl + `
  WHERE published_at IS NULL AND dead_at IS NULL AND available_at <= now()
    AND (locked_at IS NULL OR ` + LeaseExpiredSince("$2::float8") + `)` + topicFilter + `
  ORDER BY available_at, sequence
  LIMIT $3
  FOR UPDATE SKIP LOCKED
), claimed AS (
  UPDATE ` + tbl + ` AS o SET
    locked_at = CASE WHEN ` + parking + ` THEN NULL ELSE now() END,
    attempts = CASE WHEN ` + parking + ` THEN o.attempts ELSE o.attempts + 1 END,
    dead_at = CASE WHEN ` + parking + ` THEN now() END,
    available_at = CASE WHEN ` + parking + ` THEN 'infinity'::timestamptz ELSE o.available_at END,
    last_error = CASE
      WHEN ` + parking + ` THEN 'lease of attempt ' || o.attempts || ' expired: the relay holding it crashed, hung or lost its connection; dead: it was the last allowed attempt (max ' || $1::int || ')'
      WHEN o.locked_at IS NOT NULL THEN 'lease of attempt ' || o.attempts || ' expired: the relay holding it crashed, hung or lost its connection'
      ELSE o.last_error END
  FROM due WHERE o.id = due.id
  RETURNING ` + claimReturning(c) + `, o.dead_at IS NOT NULL AS parked
)` + noticed + `
SELECT ` + out + ` FROM claimed` + filter
	}
	q.ClaimAll = claim("", false)
	q.ClaimTopic = claim("\n    AND topic = $4", false)
	q.AdapterClaimAll = claim("", true)
	q.AdapterClaimTopic = claim("\n    AND topic = $4", true)
	if c.OrderingKey {
		q.ClaimAllUnkeyed = claim("\n    AND ordering_key IS NULL", false)
		q.ClaimTopicUnkeyed = claim("\n    AND ordering_key IS NULL AND topic = $4", false)
		q.ClaimAllUnkeyedExcept = claim("\n    AND ordering_key IS NULL AND topic <> ALL($4::text[])", false)
	}
	q.ClaimAllExcept = claim("\n    AND topic <> ALL($4::text[])", false)

	fence := `o.id = a.id AND o.attempts = a.attempts AND o.locked_at = a.locked_at AND o.published_at IS NULL`
	q.Ack = `UPDATE ` + tbl + ` AS o SET published_at = now(), locked_at = NULL, last_error = NULL
FROM unnest($1::uuid[], $2::int[], $3::timestamptz[]) AS a(id, attempts, locked_at)
WHERE ` + fence + `
RETURNING o.id::text, extract(epoch FROM o.published_at - o.created_at)::float8`

	q.nack = `UPDATE ` + tbl + ` AS o SET locked_at = NULL, last_error = $4,
  dead_at = CASE WHEN $6::bool OR o.attempts >= $5::int THEN now() END,
  available_at = CASE WHEN $6::bool OR o.attempts >= $5::int THEN 'infinity'::timestamptz ELSE now() + make_interval(secs => $7::float8) END
FROM (SELECT $1::uuid AS id, $2::int AS attempts, $3::timestamptz AS locked_at) AS a
WHERE ` + fence + `
RETURNING o.dead_at IS NOT NULL`

	q.Extend = `UPDATE ` + tbl + ` AS o SET available_at = clock_timestamp()
FROM (SELECT $1::uuid AS id, $2::int AS attempts, $3::timestamptz AS locked_at) AS a
WHERE ` + fence

	lastTry := `($4::int = 0 AND o.attempts >= $5::int)`
	q.Release = `WITH released AS (
UPDATE ` + tbl + ` AS o SET locked_at = NULL, attempts = GREATEST(o.attempts - $4::int, 0),
  dead_at = CASE WHEN ` + lastTry + ` THEN now() END,
  available_at = CASE WHEN ` + lastTry + ` THEN 'infinity'::timestamptz ELSE now() END,
  last_error = CASE WHEN ` + lastTry + `
    THEN 'attempt ' || o.attempts || ' got no verdict before the relay stopped; dead: it was the last allowed attempt (max ' || $5::int || ')'
    ELSE o.last_error END
FROM unnest($1::uuid[], $2::int[], $3::timestamptz[]) AS a(id, attempts, locked_at)
WHERE ` + fence + `
RETURNING o.id, o.topic, o.dead_at IS NOT NULL AS dead
)` + notices("released", "id", "dead") + `
SELECT id::text, topic, dead FROM released`

	lastAttempt := `o.attempts >= $1::int`
	q.TakeBack = `WITH taken AS (
UPDATE ` + tbl + ` AS o SET locked_at = NULL,
  dead_at = CASE WHEN ` + lastAttempt + ` THEN now() END,
  available_at = CASE WHEN ` + lastAttempt + ` THEN 'infinity'::timestamptz ELSE now() END,
  last_error = 'lease of attempt ' || o.attempts || ' taken back: the relay holding it lost its database session (crashed, cut off or stepped down)'
    || CASE WHEN ` + lastAttempt + ` THEN '; dead: it was the last allowed attempt (max ' || $1::int || ')' ELSE '' END
WHERE o.published_at IS NULL AND o.dead_at IS NULL AND o.locked_at IS NOT NULL
RETURNING o.id, o.topic, o.dead_at IS NOT NULL AS dead
)` + notices("taken", "id", "dead") + `
SELECT id::text, topic, dead FROM taken`

	q.Stats = `SELECT count(*) FILTER (WHERE dead_at IS NULL), count(*) FILTER (WHERE locked_at IS NOT NULL), count(*) FILTER (WHERE dead_at IS NOT NULL),
  COALESCE(extract(epoch FROM now() - min(created_at) FILTER (WHERE dead_at IS NULL))::float8, 0)
FROM ` + tbl + ` WHERE published_at IS NULL`

	q.DeletePublished = `WITH victims AS (
  SELECT id FROM ` + tbl + `
  WHERE published_at IS NOT NULL AND published_at < now() - make_interval(secs => $1::float8)
  ORDER BY published_at, sequence LIMIT $2 FOR UPDATE SKIP LOCKED
)
DELETE FROM ` + tbl + ` AS o USING victims WHERE o.id = victims.id`

	q.AckUpToInTx = `UPDATE ` + tbl + ` SET published_at = now(), locked_at = NULL, last_error = NULL
WHERE locked_at = now() AND published_at IS NULL AND sequence <= $1`
	q.renderNotices(t, c)
	return q
}

// LeaseExpiredSince renders the predicate "this leased row's lease expired":
// no claim and no renewal within ttl, a SQL expression of seconds. A lease
// starts at locked_at (the claim) and is renewed through available_at
// (Queries.Extend), so it lasts until GREATEST(locked_at, available_at) +
// ttl. Use it with locked_at IS NOT NULL.
func LeaseExpiredSince(ttl string) string {
	return `GREATEST(locked_at, available_at) < now() - make_interval(secs => ` + ttl + `)`
}

// LeaseLiveWithin renders the predicate "this row is leased and its lease
// has not expired": false for a row that is not leased.
func LeaseLiveWithin(ttl string) string {
	return `(locked_at IS NOT NULL AND GREATEST(locked_at, available_at) >= now() - make_interval(secs => ` + ttl + `))`
}

// existingJSON aggregates the rows of an "ex" relation into the JSON that
// ExistingEvents returns.
const existingJSON = `COALESCE(json_agg(json_build_array(ex.event_id::text, ex.sequence, ex.tenant_id::text, ex.topic, ex.same_payload)), '[]')::text`

// claimReturning lists the columns a claim's UPDATE returns, named c1,
// c2, ... in ClaimedRow.Scan order; claimColumns lists those names.
func claimReturning(c schema.Columns) string {
	cols := claimExprs(c)
	for i := range cols {
		cols[i] += " AS c" + itoa(i+1)
	}
	return strings.Join(cols, ", ")
}

// claimExprs are the expressions of the claim's columns, in the order
// ClaimedRow.ScanClaim reads them, on the row o.
func claimExprs(c schema.Columns) []string {
	cols := []string{"o.id::text", "o.event_id::text", "o.tenant_id::text", "o.topic", "o.payload::text",
		"o.sequence", "o.attempts", "o.locked_at", "o.created_at"}
	if c.TraceContext {
		cols = append(cols, "o.traceparent", "o.tracestate")
	}
	if c.Headers {
		cols = append(cols, "o.headers::text")
	}
	if c.OrderingKey {
		// Every claim reads the key, so that a keyed row carries
		// schema.MetadataOrderingKey whichever relay delivers it (the
		// forwarder keys a Kafka record by it).
		cols = append(cols, "o.ordering_key")
	}
	return cols
}

func claimColumns(c schema.Columns) string {
	n := 9
	if c.TraceContext {
		n += 2
	}
	if c.Headers {
		n++
	}
	if c.OrderingKey {
		n++
	}
	cols := make([]string, n)
	for i := range cols {
		cols[i] = "c" + itoa(i+1)
	}
	return strings.Join(cols, ", ")
}

func itoa(n int) string { return strconv.Itoa(n) }

func joinComma(s []string) string { return strings.Join(s, ", ") }

// NackArgs are the arguments of Queries.Nack.
type NackArgs struct {
	ID          string    // the row's id, as text
	Attempts    int32     // the attempts the lease was taken with (fence)
	LockedAt    time.Time // the lease's locked_at (fence)
	LastError   string    // the failure, as last_error keeps it
	MaxAttempts int       // the attempts after which the row is dead
	Permanent   bool      // the failure is permanent: dead at once
	Backoff     float64   // seconds until the next attempt
}

// Nack releases one leased row for a retry or, at max attempts or for a
// permanent error, marks it dead (see the nack field). Returns: dead.
func (q *Queries) Nack(a NackArgs) Statement {
	return Statement{SQL: q.nack, Args: []any{a.ID, a.Attempts, a.LockedAt, a.LastError, a.MaxAttempts, a.Permanent, a.Backoff}}
}
