package runbook

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/schema"
)

// ErrNoReplayJob is returned (wrapped) by GetReplayJob for an id that the
// table of replay jobs does not hold: never recorded, or deleted as one of
// the oldest.
var ErrNoReplayJob = errors.New("runbook: no such replay job")

// replayJobsKeptDefault is how many replay jobs SaveReplayJob keeps per
// outbox table when it is given no other number (its doc says the number):
// the oldest beyond it are deleted as a new one is recorded.
const replayJobsKeptDefault = 50

// ReplayJob is the record of one bulk replay (ReplayDead) whose progress
// someone follows: the filter, the rows it changed and their event ids
// (ReplayProgress counts them in the outbox table).
type ReplayJob struct {
	// ID names the job; SaveReplayJob draws a random one when it is empty.
	ID string `json:"id"`
	// CreatedAt is when the job was recorded.
	CreatedAt time.Time `json:"created_at"`
	// Topic, ErrorContains and Cause are the replay's filter ("" for none).
	Topic         string `json:"topic,omitempty"`
	ErrorContains string `json:"error_contains,omitempty"`
	Cause         string `json:"cause,omitempty"`
	// Rows counts the rows the replay changed.
	Rows int64 `json:"rows"`
	// EventIDs are the event ids of those rows.
	EventIDs []uuid.UUID `json:"event_ids"`
	// RequestedBy says who asked, such as "token holder"; Remote from
	// where (a client address). Either may be empty.
	RequestedBy string `json:"requested_by,omitempty"`
	Remote      string `json:"remote,omitempty"`
}

// SaveReplayJob records j in the outbox table's table of replay jobs and
// deletes the oldest jobs beyond the newest keep (50 when keep < 1), in one
// statement. Texts longer than schema.ReplayJobTextMaxBytes are shortened.
// It returns j with its ID and CreatedAt. A table without the replay jobs'
// table is refused with ErrNoReplayJobs (run `outbox migrate`); nothing
// is written then.
func (r *Runbook) SaveReplayJob(ctx context.Context, j ReplayJob, keep int) (ReplayJob, error) {
	if err := r.check(); err != nil {
		return ReplayJob{}, err
	}
	db, t := r.db, r.table
	if err := replayJobsReady(ctx, db, t, "record a replay job of"); err != nil {
		return ReplayJob{}, err
	}
	if keep < 1 {
		keep = replayJobsKeptDefault
	}
	if j.ID == "" {
		var b [8]byte
		if _, err := rand.Read(b[:]); err != nil {
			return ReplayJob{}, fmt.Errorf("runbook: record a replay job of %s: draw an id: %w", t, err)
		}
		j.ID = hex.EncodeToString(b[:])
	}
	if len(j.ID) > schema.ReplayJobIDMaxBytes {
		return ReplayJob{}, fmt.Errorf("runbook: record a replay job of %s: the id is %d bytes, at most %d", t, len(j.ID), schema.ReplayJobIDMaxBytes)
	}
	for _, s := range []*string{&j.Topic, &j.ErrorContains, &j.Cause, &j.RequestedBy, &j.Remote} {
		*s = cutText(*s, schema.ReplayJobTextMaxBytes)
	}
	ids := make([]string, len(j.EventIDs))
	for i, id := range j.EventIDs {
		ids[i] = id.String()
	}
	q := sqlq.NewReplayJobsQueries(t)
	if err := db.QueryRow(ctx, q.Insert, j.ID, j.Topic, j.ErrorContains, j.Cause, j.Rows, ids, j.RequestedBy, j.Remote, keep).Scan(&j.CreatedAt); err != nil {
		return ReplayJob{}, dbError(t, "record a replay job of", err)
	}
	return j, nil
}

// GetReplayJob reads the replay job id of the table: ErrNoReplayJob when the
// table of replay jobs does not hold it, ErrNoReplayJobs when the table
// has no such table.
func (r *Runbook) GetReplayJob(ctx context.Context, id string) (ReplayJob, error) {
	if err := r.check(); err != nil {
		return ReplayJob{}, err
	}
	db, t := r.db, r.table
	if err := replayJobsReady(ctx, db, t, "read a replay job of"); err != nil {
		return ReplayJob{}, err
	}
	j := ReplayJob{ID: id}
	var ids []string
	err := db.QueryRow(ctx, sqlq.NewReplayJobsQueries(t).Get, id).Scan(&j.CreatedAt, &j.Topic, &j.ErrorContains, &j.Cause, &j.Rows, &ids, &j.RequestedBy, &j.Remote)
	if errors.Is(err, pgx.ErrNoRows) {
		return ReplayJob{}, fmt.Errorf("runbook: replay job %q of %s: %w", cutText(id, 64), t, ErrNoReplayJob)
	}
	if err != nil {
		return ReplayJob{}, dbError(t, "read a replay job of", err)
	}
	j.EventIDs = make([]uuid.UUID, len(ids))
	for i, s := range ids {
		if j.EventIDs[i], err = uuid.Parse(s); err != nil {
			return ReplayJob{}, fmt.Errorf("runbook: read a replay job of %s: event id %q: %w", t, s, err)
		}
	}
	return j, nil
}

// replayJobsReady refuses a table without the replay jobs' table.
func replayJobsReady(ctx context.Context, db DB, t schema.Table, op string) error {
	ok, err := sqlq.ReplayJobsExist(ctx, db, t)
	if err != nil {
		return dbError(t, op, err)
	}
	if !ok {
		return fmt.Errorf("runbook: %s %s: %w; run `outbox migrate --table=%s` (or schema.Migrate, or the shipped migration 000008)",
			op, t, ErrNoReplayJobs, t)
	}
	return nil
}

// cutText shortens s to at most n bytes, on a rune boundary.
func cutText(s string, n int) string {
	if len(s) <= n {
		return s
	}
	s = s[:n]
	// Drop a rune cut in the middle (at most its first 3 bytes).
	for i := 0; i < utf8.UTFMax-1 && len(s) > 0; i++ {
		if r, size := utf8.DecodeLastRuneInString(s); r != utf8.RuneError || size > 1 {
			break
		}
		s = s[:len(s)-1]
	}
	return s
}
