package walrelay_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
	"github.com/outboxkit/watermill-outbox/walrelay"
)

// TestConfigRuleIsTheSubscribers: the fields the WAL relay shares with the
// table relay are refused with the same words when negative (0 takes the
// default), and a missing table too: one rule (keyed.CheckSettings) for
// every relay's configuration. Nothing connects: the configuration is
// checked first.
func TestConfigRuleIsTheSubscribers(t *testing.T) {
	t.Parallel()
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none?connect_timeout=1")
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	tbl := schema.MustParseTable("public.config_rule_outbox")
	msgOf := func(err error) string {
		if err == nil {
			return ""
		}
		s := err.Error()
		return s[strings.Index(s, "invalid config: ")+len("invalid config: "):]
	}
	for _, c := range []struct {
		name string
		wal  func(*walrelay.Config)
		sub  func(*subscriber.Config)
	}{
		{"MaxAttempts", func(c *walrelay.Config) { c.MaxAttempts = -1 }, func(c *subscriber.Config) { c.MaxAttempts = -1 }},
		{"MaxInFlight", func(c *walrelay.Config) { c.MaxInFlight = -1 }, func(c *subscriber.Config) { c.MaxInFlight = -1 }},
		{"ElectionInterval", func(c *walrelay.Config) { c.ElectionInterval = -time.Second }, func(c *subscriber.Config) { c.ElectionInterval = -time.Second }},
		{"CloseTimeout", func(c *walrelay.Config) { c.CloseTimeout = -time.Second }, func(c *subscriber.Config) { c.CloseTimeout = -time.Second }},
		{"DispatchTimeout", func(c *walrelay.Config) { c.DispatchTimeout = -time.Second }, func(c *subscriber.Config) { c.DispatchTimeout = -time.Second }},
		{"LastErrorMaxBytes", func(c *walrelay.Config) { c.LastErrorMaxBytes = -1 }, func(c *subscriber.Config) { c.LastErrorMaxBytes = -1 }},
		{"Table", func(c *walrelay.Config) { c.Table = schema.Table{} }, func(c *subscriber.Config) { c.Table = schema.Table{} }},
	} {
		wc := walrelay.Config{Table: tbl}
		c.wal(&wc)
		_, werr := walrelay.New(context.Background(), pool, wc, watermill.NopLogger{})
		sc := subscriber.Config{Table: tbl}
		c.sub(&sc)
		_, serr := subscriber.New(context.Background(), pool, sc, watermill.NopLogger{})
		if werr == nil || !strings.Contains(werr.Error(), "walrelay: invalid config: ") || !strings.Contains(werr.Error(), c.name) {
			t.Errorf("%s: walrelay.New = %v, want an invalid config naming it", c.name, werr)
			continue
		}
		if msgOf(werr) != msgOf(serr) {
			t.Errorf("%s: the relays say it differently:\n walrelay:   %v\n subscriber: %v", c.name, werr, serr)
		}
	}
}
