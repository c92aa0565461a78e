package router_test

import (
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/outboxkit/watermill-outbox/router"
)

// TestMiddlewareConfigValidation: a bad MiddlewareConfig is refused like a
// bad subscriber.Config, naming the field and the fix; MustMiddlewares
// panics with the same message.
func TestMiddlewareConfigValidation(t *testing.T) {
	t.Parallel()
	pub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer pub.Close()
	bad := []struct {
		cfg  router.MiddlewareConfig
		want string
	}{
		{router.MiddlewareConfig{DispatchTimeout: -time.Second}, "router: invalid config: DispatchTimeout: "},
		{router.MiddlewareConfig{MaxAttempts: -1}, "router: invalid config: MaxAttempts: "},
		{router.MiddlewareConfig{PoisonPublisher: pub}, "router: invalid config: PoisonTopic: "},
		{router.MiddlewareConfig{PoisonTopic: "outbox.poison.v1"}, "router: invalid config: PoisonPublisher: "},
	}
	for _, b := range bad {
		if _, err := router.Middlewares(b.cfg); err == nil || !strings.Contains(err.Error(), b.want) {
			t.Errorf("Middlewares(%+v): %v, want %q", b.cfg, err, b.want)
		}
		func() {
			defer func() {
				if r := recover(); r == nil || !strings.Contains(r.(error).Error(), b.want) {
					t.Errorf("MustMiddlewares(%+v) panicked with %v, want %q", b.cfg, r, b.want)
				}
			}()
			router.MustMiddlewares(b.cfg)
		}()
	}
	for _, good := range []router.MiddlewareConfig{{}, {PoisonPublisher: pub, PoisonTopic: "outbox.poison.v1", DispatchTimeout: time.Second}} {
		if stack, err := router.Middlewares(good); err != nil || len(stack) == 0 {
			t.Errorf("Middlewares(%+v): %v, %d middlewares", good, err, len(stack))
		}
	}
}
