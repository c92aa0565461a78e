package subscriber

import (
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Paused topics (docs/ARCHITECTURE.md, "Paused topics"). An operator pauses
// a topic with runbook.Runbook.PauseTopic, which writes <table>_paused_topics and
// notifies the table's channel with sqlq.PausedTopicsNotifyPayload. The
// relay keeps the set in memory and reads it again after such a
// notification (or a reconnection of the listener, which may have missed
// one) and PollInterval after the last read, before a claim or an ordered
// cycle: the wake-ups of enqueues cost no read. With
// nothing paused the claim is the same statement as without the feature;
// with topics paused it is the claim with `topic <> ALL($4)`. A table
// without the paused-topics table (before migration 000007) has nothing
// paused.

// pausedSet is one read of the paused topics; nil means none.
type pausedSet struct {
	topics []string // sorted
	m      map[string]struct{}
}

func (p *pausedSet) has(topic string) bool {
	if p == nil {
		return false
	}
	_, ok := p.m[topic]
	return ok
}

// pausedState is the subscriber's copy of the paused topics.
type pausedState struct {
	set     atomic.Pointer[pausedSet]
	readGen atomic.Uint64 // the broadcaster's topicsGen the last read followed
	readAt  atomic.Int64  // unix nanoseconds of the last read (0: never)

	mu      sync.Mutex // serialises reads
	missing bool       // the table was missing at the last read (logged once)
}

// pausedTopics returns the topics paused now, reading them again when a
// wake-up came after the last read or the last read is PollInterval old.
// A failed read keeps the previous set (and is retried at the next poll).
func (s *Subscriber) pausedTopics(ctx context.Context) *pausedSet {
	p := &s.paused
	if !s.pausedStale() {
		return p.set.Load()
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if !s.pausedStale() {
		return p.set.Load()
	}
	gen := s.wake.topicsGen.Load()
	qctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), opTimeout)
	defer cancel()
	topics, err := s.readPausedTopics(qctx)
	p.readGen.Store(gen)
	p.readAt.Store(time.Now().UnixNano())
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr) && pgErr.Code == "42P01": // undefined_table
		if !p.missing {
			p.missing = true
			s.logger.Info("No table of paused topics (migration 000007): nothing is paused", nil)
		}
		topics = nil
	case err != nil:
		if ctx.Err() == nil {
			s.logger.Error("Could not read the paused topics; keeping the last read", err, nil)
		}
		return p.set.Load()
	default:
		p.missing = false
	}
	old := p.set.Load()
	var next *pausedSet
	if len(topics) > 0 {
		next = &pausedSet{topics: topics, m: make(map[string]struct{}, len(topics))}
		for _, t := range topics {
			next.m[t] = struct{}{}
		}
	}
	// The set first, then the log: a claim that ends after the log gives
	// back what it leased of a topic paused here (Subscriber.unpaused).
	p.set.Store(next)
	for _, t := range topics {
		if !old.has(t) {
			s.logger.Info("Topic paused: its rows are not relayed until it is resumed", watermill.LogFields{"paused_topic": t})
		}
	}
	if old != nil {
		for _, t := range old.topics {
			if !next.has(t) {
				s.logger.Info("Topic resumed: relaying its rows again", watermill.LogFields{"paused_topic": t})
			}
		}
	}
	if m := s.cfg.Metrics; m != nil {
		m.PausedTopics.WithLabelValues(s.label).Set(float64(len(topics)))
	}
	return next
}

// pausedStale reports whether the paused topics must be read again.
func (s *Subscriber) pausedStale() bool {
	p := &s.paused
	at := p.readAt.Load()
	return at == 0 || p.readGen.Load() != s.wake.topicsGen.Load() ||
		time.Since(time.Unix(0, at)) >= s.cfg.PollInterval
}

func (s *Subscriber) readPausedTopics(ctx context.Context) ([]string, error) {
	rows, err := s.pool.Query(ctx, s.pq.Topics)
	if err != nil {
		return nil, err
	}
	topics, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, err
	}
	slices.Sort(topics)
	return topics, nil
}
