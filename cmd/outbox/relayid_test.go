package main

import (
	"errors"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/forwarder"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
)

// batchSink is a forwarder.BatchPublisher that fails the messages named in
// fail and keeps the others.
type batchSink struct {
	fail map[string]bool
	got  []*message.Message
}

func (b *batchSink) Publish(topic string, msgs ...*message.Message) error {
	return errors.Join(b.PublishBatch(topic, msgs)...)
}

func (b *batchSink) PublishBatch(_ string, msgs []*message.Message) []error {
	errs := make([]error, len(msgs))
	for i, m := range msgs {
		if b.fail[m.UUID] {
			errs[i] = errors.New("refused")
			continue
		}
		b.got = append(b.got, m)
	}
	return errs
}

func (b *batchSink) Close() error { return nil }

// TestRelayIDKeepsBatching: the daemon's relay-id stamp over a
// BatchPublisher (Kafka) is itself a BatchPublisher, so the forwarder keeps
// batching; it stamps every message and passes each message's result on.
func TestRelayIDKeepsBatching(t *testing.T) {
	t.Parallel()
	sink := &batchSink{fail: map[string]bool{"b": true}}
	var pub message.Publisher = relayIDBatchPublisher{relayIDPublisher: relayIDPublisher{Publisher: sink, id: "relay-1"}, batch: sink}
	bp, ok := pub.(forwarder.BatchPublisher)
	if !ok {
		t.Fatal("the stamped Kafka publisher is not a forwarder.BatchPublisher")
	}
	msgs := []*message.Message{message.NewMessage("a", nil), message.NewMessage("b", nil), message.NewMessage("c", nil)}
	errs := bp.PublishBatch("t", msgs)
	if len(errs) != 3 || errs[0] != nil || errs[1] == nil || errs[2] != nil {
		t.Fatalf("results %v, want only b failed", errs)
	}
	for _, m := range msgs {
		if m.Metadata.Get(MetadataRelayID) != "relay-1" || m.Metadata.Get(MetadataRelayedAt) == "" {
			t.Errorf("message %s not stamped: %v", m.UUID, m.Metadata)
		}
	}
	if len(sink.got) != 2 {
		t.Fatalf("%d messages published, want 2", len(sink.got))
	}
}

// TestRelaySessionsNamed: the daemon's sessions say who they are in
// pg_stat_activity ("outbox-relay <host> <pid> <version>", at most 63
// bytes), unless OUTBOX_DATABASE_URL names them itself.
func TestRelaySessionsNamed(t *testing.T) {
	cfg, err := pgxpool.ParseConfig("postgres://u@localhost/db")
	if err != nil {
		t.Fatal(err)
	}
	nameSessions(cfg)
	host, _ := os.Hostname()
	name := cfg.ConnConfig.RuntimeParams["application_name"]
	want := sqlq.RelayApplicationPrefix + host + " " + strconv.Itoa(os.Getpid()) + " "
	if len(name) > 63 || (!strings.HasPrefix(name, want) && !strings.HasPrefix(want, name)) {
		t.Fatalf("application_name %q, want %q and a version", name, want)
	}
	cfg, err = pgxpool.ParseConfig("postgres://u@localhost/db?application_name=mine")
	if err != nil {
		t.Fatal(err)
	}
	nameSessions(cfg)
	if got := cfg.ConnConfig.RuntimeParams["application_name"]; got != "mine" {
		t.Fatalf("the URL's application_name was replaced by %q", got)
	}
}
