package schema

// suffixPausedTopics names the companion table of paused topics.
const suffixPausedTopics = "_paused_topics"

// PauseReasonMaxBytes bounds the operator's reason stored with a paused
// topic (a CHECK of the paused-topics table; the runbook refuses longer
// reasons before writing).
const PauseReasonMaxBytes = 200

// PauseTopicMaxBytes bounds a paused topic's name, as publisher.Message
// bounds topics (under 128 bytes).
const PauseTopicMaxBytes = 127

// PausedTopicsTable names the companion table of the topics an operator
// paused (runbook.Runbook.PauseTopic), sanitized for SQL.
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
func pausedTopicsUpSQL(t Table) string { return pausedTopicsStatement(t) + ";\n" }

// PausedTopicsDownSQL reverts PausedTopicsUpSQL: every paused topic is
// resumed.
func pausedTopicsDownSQL(t Table) string {
	return `DROP TABLE IF EXISTS ` + t.PausedTopicsTable() + ";\n"
}
