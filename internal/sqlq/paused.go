package sqlq

import (
	"context"
	"fmt"

	"github.com/outboxkit/watermill-outbox/schema"
)

// PausedTopicsExist reports whether the table of paused topics of t exists.
func PausedTopicsExist(ctx context.Context, q schema.Querier, t schema.Table) (bool, error) {
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
func NewPausedTopicsQueries(t schema.Table) PausedTopicsQueries {
	tbl := t.PausedTopicsTable()
	return PausedTopicsQueries{
		List:   `SELECT topic, paused_at, reason FROM ` + tbl + ` ORDER BY topic`,
		Topics: `SELECT topic FROM ` + tbl + ` ORDER BY topic`,
		Pause:  `INSERT INTO ` + tbl + ` (topic, reason) VALUES ($1, $2) ON CONFLICT (topic) DO NOTHING RETURNING paused_at`,
		Get:    `SELECT paused_at, reason FROM ` + tbl + ` WHERE topic = $1`,
		Resume: `DELETE FROM ` + tbl + ` WHERE topic = $1 RETURNING paused_at`,
		Notify: `SELECT pg_notify(` + quoteLiteral(NotifyChannel(t)) + `, '` + PausedTopicsNotifyPayload + `')`,
	}
}
