package runbook

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/internal/redact"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/schema"
)

// ErrPauseWAL is returned (wrapped) by PauseTopic for a table the WAL relay
// streams: it cannot skip a topic without holding its replication slot
// back, which would make PostgreSQL retain WAL for as long as the pause
// lasts.
var ErrPauseWAL = errors.New("runbook: the WAL relay cannot pause a topic")

// ErrNotPaused is returned (wrapped) by ResumeTopic for a topic that is not
// paused.
var ErrNotPaused = errors.New("runbook: topic not paused")

// ErrBadTopic is returned (wrapped) by PauseTopic and ResumeTopic for a
// topic they refuse (empty, "*", too long, or with spaces or control
// characters); nothing is changed.
var ErrBadTopic = errors.New("runbook: bad topic")

// PausedTopic is one topic an operator paused.
type PausedTopic struct {
	// Topic is the paused topic column value.
	Topic string `json:"topic"`
	// PausedAt is when it was paused.
	PausedAt time.Time `json:"paused_at"`
	// Reason is the operator's reason, secrets masked, possibly empty.
	Reason string `json:"reason,omitempty"`
}

// TopicPause reports a PauseTopic or a ResumeTopic.
type TopicPause struct {
	// Table is the table, as given.
	Table string `json:"table"`
	// Topic is the topic paused or resumed.
	Topic string `json:"topic"`
	// Paused is whether the topic is paused after the call (for a dry run:
	// would be).
	Paused bool `json:"paused"`
	// PausedAt is when the topic was paused: for PauseTopic, now or, when
	// it was paused already, then; for ResumeTopic, when the pause began.
	// Nil for a dry run of a pause.
	PausedAt *time.Time `json:"paused_at,omitempty"`
	// Reason is the reason stored (secrets masked).
	Reason string `json:"reason,omitempty"`
	// Changed is 1 when the call changed the table, 0 for a dry run or a
	// pause of a topic paused already.
	Changed int64 `json:"changed"`
	// DryRun is true when nothing was changed on purpose.
	DryRun bool `json:"dry_run"`
	// Statement is the statement that pauses or resumes the topic.
	Statement Statement `json:"-"`
}

// checkTopic refuses what no pause can name.
func checkTopic(op, topic string, t schema.Table) error {
	bad := func(why string) error {
		return fmt.Errorf("runbook: cannot %s a topic of %s: %w: %s; nothing changed", op, t, ErrBadTopic, why)
	}
	switch {
	case topic == "":
		return bad("the topic is empty; name one, such as org.organization.created.v1 (list them with `outbox topics`)")
	case topic == "*":
		return bad(`"*" is not a topic: pause topics one at a time, or stop the table's relay to stop them all`)
	case len(topic) > schema.PauseTopicMaxBytes:
		return bad(fmt.Sprintf("the topic is %d bytes; topics are shorter than %d bytes", len(topic), schema.PauseTopicMaxBytes+1))
	case !utf8.ValidString(topic):
		return bad("the topic is not valid UTF-8")
	case strings.IndexFunc(topic, func(r rune) bool { return unicode.IsSpace(r) || unicode.IsControl(r) }) >= 0:
		return bad("the topic has spaces or control characters")
	}
	return nil
}

// checkPauseReason refuses a reason the table would not store.
func checkPauseReason(reason string, t schema.Table) error {
	switch {
	case len(reason) > schema.PauseReasonMaxBytes:
		return fmt.Errorf("runbook: cannot pause a topic of %s: the reason is %d bytes, at most %d are kept; shorten it; nothing changed",
			t, len(reason), schema.PauseReasonMaxBytes)
	case !utf8.ValidString(reason):
		return fmt.Errorf("runbook: cannot pause a topic of %s: the reason is not valid UTF-8; nothing changed", t)
	case strings.IndexFunc(reason, unicode.IsControl) >= 0:
		return fmt.Errorf("runbook: cannot pause a topic of %s: the reason has control characters (line breaks included); write it on one line; nothing changed", t)
	}
	return nil
}

// pausable checks that topics of r's table can be paused: the table
// exists, is not streamed by the WAL relay, and has the paused topics'
// table.
func (r *Runbook) pausable(ctx context.Context, op, topic string) error {
	db, t := r.db, r.table
	mode, err := r.Mode(ctx)
	if err != nil {
		return err
	}
	if mode == schema.ModeWAL {
		return fmt.Errorf("runbook: cannot %s a topic of %s: %w: its replication slot would retain WAL for as long as the pause lasts, "+
			"and the disk fills; nothing changed. Instead let the topic's messages fail until they are dead (they stay in the table; "+
			"`outbox dead list --topic=%s`), and replay them once the consumer is fixed; or stop the table's relay for a short while (its slot retains WAL meanwhile)", op, t, ErrPauseWAL, topic)
	}
	ok, err := sqlq.PausedTopicsExist(ctx, db, t)
	if err != nil {
		return dbError(t, op+" a topic of", err)
	}
	if !ok {
		return fmt.Errorf("runbook: cannot %s a topic of %s: %w; run `outbox migrate --table=%s` (or schema.Migrate, or the shipped migration 000007) first; nothing changed",
			op, t, ErrNoPausedTopics, t)
	}
	return nil
}

// PauseTopic pauses the relaying of topic in the table: the relays stop
// claiming (default mode) or delivering (ordered mode: the key waits, and
// later rows of the key wait behind it) the topic's rows at their next
// wake-up, which PauseTopic sends; rows in flight finish. The rows stay
// pending until ResumeTopic. reason (at most schema.PauseReasonMaxBytes, one
// line) is stored with obvious secrets masked. Pausing a topic paused
// already changes nothing (Changed 0, the first pause's time and reason). A
// table the WAL relay streams is refused with ErrPauseWAL, a table without
// the paused topics' table with ErrNoPausedTopics; with dryRun nothing
// is written.
func (r *Runbook) PauseTopic(ctx context.Context, topic, reason string, dryRun bool) (TopicPause, error) {
	if err := r.check(); err != nil {
		return TopicPause{}, err
	}
	db, t := r.db, r.table
	if err := checkTopic("pause", topic, t); err != nil {
		return TopicPause{}, err
	}
	if err := checkPauseReason(reason, t); err != nil {
		return TopicPause{}, err
	}
	if err := r.pausable(ctx, "pause", topic); err != nil {
		return TopicPause{}, err
	}
	reason = redact.Summary(reason, nil, schema.PauseReasonMaxBytes)
	q := sqlq.NewPausedTopicsQueries(t)
	res := TopicPause{Table: t.String(), Topic: topic, Paused: true, Reason: reason,
		Statement: Statement{SQL: q.Pause, Args: []any{topic, reason}}}
	if dryRun {
		res.DryRun = true
		return res, nil
	}
	var at time.Time
	err := db.QueryRow(ctx, q.Pause, topic, reason).Scan(&at)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		// Paused already: report the pause in place.
		if err := db.QueryRow(ctx, q.Get, topic).Scan(&at, &res.Reason); err != nil {
			return TopicPause{}, dbError(t, "read the pause of a topic of", err)
		}
	case err != nil:
		return TopicPause{}, dbError(t, "pause a topic of", err)
	default:
		res.Changed = 1
		wakePaused(ctx, db, q)
	}
	res.PausedAt = &at
	return res, nil
}

// ResumeTopic resumes a topic paused with PauseTopic: the relays deliver
// its rows again from their next wake-up, which ResumeTopic sends. A topic
// that is not paused is refused with ErrNotPaused; with dryRun nothing is
// written.
func (r *Runbook) ResumeTopic(ctx context.Context, topic string, dryRun bool) (TopicPause, error) {
	if err := r.check(); err != nil {
		return TopicPause{}, err
	}
	db, t := r.db, r.table
	if err := checkTopic("resume", topic, t); err != nil {
		return TopicPause{}, err
	}
	if err := r.pausable(ctx, "resume", topic); err != nil && !errors.Is(err, ErrPauseWAL) {
		return TopicPause{}, err
	}
	q := sqlq.NewPausedTopicsQueries(t)
	res := TopicPause{Table: t.String(), Topic: topic, Statement: Statement{SQL: q.Resume, Args: []any{topic}}}
	var at time.Time
	if err := db.QueryRow(ctx, q.Get, topic).Scan(&at, &res.Reason); errors.Is(err, pgx.ErrNoRows) {
		return TopicPause{}, fmt.Errorf("runbook: cannot resume topic %q of %s: %w (list the paused topics with `outbox topics`); nothing changed", topic, t, ErrNotPaused)
	} else if err != nil {
		return TopicPause{}, dbError(t, "read the pause of a topic of", err)
	}
	res.PausedAt = &at
	if dryRun {
		res.DryRun = true
		return res, nil
	}
	if err := db.QueryRow(ctx, q.Resume, topic).Scan(&at); errors.Is(err, pgx.ErrNoRows) {
		return TopicPause{}, fmt.Errorf("runbook: cannot resume topic %q of %s: %w (resumed meanwhile); nothing changed", topic, t, ErrNotPaused)
	} else if err != nil {
		return TopicPause{}, dbError(t, "resume a topic of", err)
	}
	res.Changed = 1
	wakePaused(ctx, db, q)
	return res, nil
}

// wakePaused notifies t's relays that the paused topics changed. A
// failure is ignored: the relays read them again at their next poll.
func wakePaused(ctx context.Context, db DB, q sqlq.PausedTopicsQueries) {
	_, _ = db.Exec(ctx, q.Notify)
}

// PausedTopics lists the paused topics of the table, by topic. A table
// without the paused topics' table (before migration 000007) has none.
func (r *Runbook) PausedTopics(ctx context.Context) ([]PausedTopic, error) {
	if err := r.check(); err != nil {
		return nil, err
	}
	db, t := r.db, r.table
	ok, err := sqlq.PausedTopicsExist(ctx, db, t)
	if err != nil {
		return nil, dbError(t, "list the paused topics of", err)
	}
	if !ok {
		if _, err := schema.DetectColumns(ctx, db, t); err != nil {
			return nil, dbError(t, "list the paused topics of", err)
		}
		return nil, nil
	}
	rows, err := db.Query(ctx, sqlq.NewPausedTopicsQueries(t).List)
	if err != nil {
		return nil, dbError(t, "list the paused topics of", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (PausedTopic, error) {
		var p PausedTopic
		return p, r.Scan(&p.Topic, &p.PausedAt, &p.Reason)
	})
	if err != nil {
		return nil, dbError(t, "list the paused topics of", err)
	}
	return out, nil
}
