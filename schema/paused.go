package schema

import (
	"context"
	"errors"
	"fmt"
)

// suffixPausedTopics names the companion table of paused topics.
const suffixPausedTopics = "_paused_topics"

// PauseReasonMaxBytes bounds the operator's reason stored with a paused
// topic (a CHECK of the paused-topics table; the runbook refuses longer
// reasons before writing).
const PauseReasonMaxBytes = 200

// PauseTopicMaxBytes bounds a paused topic's name, as publisher.Message
// bounds topics (under 128 bytes).
const PauseTopicMaxBytes = 127

// ErrNoPausedTopics is matched (errors.Is) by the runbook's error when the
// table of paused topics of an outbox table does not exist: migration
// 000007 (schema.Migrate, `outbox migrate`) creates it. Relays treat a
// missing table as "nothing is paused".
var ErrNoPausedTopics = errors.New("the table of paused topics does not exist (migration 000007)")

// PausedTopicsTable names the companion table of the topics an operator
// paused (runbook.PauseTopic), sanitized for SQL.
func (t Table) PausedTopicsTable() string { return t.companion(suffixPausedTopics) }

// pausedTopicsStatement creates the paused-topics table of t, idempotently.
// It does not lock t.
func pausedTopicsStatement(t Table) string {
	return `CREATE TABLE IF NOT EXISTS ` + t.PausedTopicsTable() + ` (
  topic     TEXT        NOT NULL PRIMARY KEY CHECK (octet_length(topic) BETWEEN 1 AND ` + itoa(PauseTopicMaxBytes) + `),
  paused_at TIMESTAMPTZ NOT NULL DEFAULT now(),
  reason    TEXT        NOT NULL DEFAULT '' CHECK (octet_length(reason) <= ` + itoa(PauseReasonMaxBytes) + `)
)`
}

// PausedTopicsUpSQL returns the DDL that creates the table of paused topics
// of an existing table t (idempotent; the shipped migration 000007).
func PausedTopicsUpSQL(t Table) string { return pausedTopicsStatement(t) + ";\n" }

// PausedTopicsDownSQL reverts PausedTopicsUpSQL: every paused topic is
// resumed.
func PausedTopicsDownSQL(t Table) string {
	return `DROP TABLE IF EXISTS ` + t.PausedTopicsTable() + ";\n"
}

// PausedTopicsExist reports whether the table of paused topics of t exists.
func PausedTopicsExist(ctx context.Context, q Querier, t Table) (bool, error) {
	var ok bool
	if err := q.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, t.PausedTopicsTable()).Scan(&ok); err != nil {
		return false, fmt.Errorf("look up the paused topics of %s: %w", t, err)
	}
	return ok, nil
}

// PausedTopicsNotifyPayload is the payload of the notification on the
// table's channel that PauseTopic and ResumeTopic send: it wakes the relays
// as any notification does, and makes them read the paused topics again.
const PausedTopicsNotifyPayload = "paused-topics"

// PausedTopicsQueries are the statements on the table of paused topics of
// one outbox table.
type PausedTopicsQueries struct {
	// List returns every paused topic: topic, paused_at, reason, by topic.
	List string
	// Topics returns the paused topics' names only (the relays' read).
	Topics string
	// Pause pauses a topic. Args: topic, reason. Returns paused_at, or no
	// row when the topic was paused already.
	Pause string
	// Get returns one paused topic: paused_at, reason. Args: topic.
	Get string
	// Resume resumes a topic. Args: topic. Returns paused_at, or no row
	// when the topic was not paused.
	Resume string
	// Notify wakes the relays of the table and makes them read the paused
	// topics again. Args: none.
	Notify string
}

// NewPausedTopicsQueries returns the statements on the paused topics of t.
func NewPausedTopicsQueries(t Table) PausedTopicsQueries {
	tbl := t.PausedTopicsTable()
	return PausedTopicsQueries{
		List:   `SELECT topic, paused_at, reason FROM ` + tbl + ` ORDER BY topic`,
		Topics: `SELECT topic FROM ` + tbl + ` ORDER BY topic`,
		Pause:  `INSERT INTO ` + tbl + ` (topic, reason) VALUES ($1, $2) ON CONFLICT (topic) DO NOTHING RETURNING paused_at`,
		Get:    `SELECT paused_at, reason FROM ` + tbl + ` WHERE topic = $1`,
		Resume: `DELETE FROM ` + tbl + ` WHERE topic = $1 RETURNING paused_at`,
		Notify: `SELECT pg_notify(` + quoteLiteral(t.NotifyChannel()) + `, '` + PausedTopicsNotifyPayload + `')`,
	}
}
