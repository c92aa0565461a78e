package subscriber

import (
	"time"

	"context"
	"errors"

	"github.com/jackc/pgx/v5"
)

// Abandon makes the ordered relays of s stop, at Close, like a killed
// process: without giving their partitions back or leaving the membership.
func Abandon(s *Subscriber) { s.abandon.Store(true) }

// SetBeforeIdle makes f run each time a subscription of s found nothing and
// is about to try the idle lock. Set it before Subscribe.
func SetBeforeIdle(s *Subscriber, f func()) { s.beforeIdle = f }

// AfterClaimQuery makes s run fn after each claim statement was sent and
// before its rows are read.
func AfterClaimQuery(s *Subscriber, fn func()) { s.afterClaimQuery = fn }

// LeaderSetting reads a setting of s's leader session; ok is false when s is
// not the leader.
func LeaderSetting(ctx context.Context, s *Subscriber, name string) (value string, ok bool, err error) {
	if s.leader == nil {
		return "", false, nil
	}
	err = s.leader.withConn(ctx, func(ctx context.Context, conn *pgx.Conn) error {
		return conn.QueryRow(ctx, `SELECT current_setting($1)`, name).Scan(&value)
	})
	if errors.Is(err, errNotLeader) {
		return "", false, nil
	}
	return value, err == nil, err
}

// LeaderKeepalive exposes the keepalive settings derived from a leader
// timeout.
var LeaderKeepalive = leaderKeepalive

// SetWriteTimeout sets the timeout of each ack, nack, renewal and release
// statement of s (each attempt of a grouped ack has its own).
func SetWriteTimeout(s *Subscriber, d time.Duration) { s.writeTimeout = d }
