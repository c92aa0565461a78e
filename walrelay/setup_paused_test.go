package walrelay_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/outboxkit/watermill-outbox/walrelay"
)

// TestNewRefusesPausedTopics: a table set up for the WAL relay that has a
// paused topic (paused before the refusal of pauses on WAL tables, or by a
// writer of the table of paused topics itself) is refused by New with
// ErrTopicsPaused, naming the topic and how to resume it, since the relay
// would deliver the topic's rows; once the topic is resumed New starts.
func TestNewRefusesPausedTopics(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `INSERT INTO `+tbl.PausedTopicsTable()+` (topic, reason) VALUES ('org.paused.v1', 'consumer down')`); err != nil {
		t.Fatal(err)
	}
	_, err := walrelay.New(ctx, pool, walrelay.Config{Table: tbl}, nil)
	if !errors.Is(err, walrelay.ErrTopicsPaused) || !strings.Contains(err.Error(), `org.paused.v1`) || !strings.Contains(err.Error(), "outbox topics resume") {
		t.Fatalf("New with a paused topic: %v; want ErrTopicsPaused naming the topic and the resume command", err)
	}
	if _, err := walrelay.Setup(ctx, pool, tbl, walrelay.Names{}); !errors.Is(err, walrelay.ErrTopicsPaused) {
		t.Fatalf("Setup with a paused topic: %v; want ErrTopicsPaused", err)
	}
	if _, err := pool.Exec(ctx, `DELETE FROM `+tbl.PausedTopicsTable()); err != nil {
		t.Fatal(err)
	}
	s, err := walrelay.New(ctx, pool, walrelay.Config{Table: tbl}, nil)
	if err != nil {
		t.Fatalf("New once the topic is resumed: %v", err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
}
