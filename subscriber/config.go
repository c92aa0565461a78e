package subscriber

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/outboxkit/watermill-outbox/internal/keyed"
	"github.com/outboxkit/watermill-outbox/internal/redact"
	"github.com/outboxkit/watermill-outbox/metrics"
	"github.com/outboxkit/watermill-outbox/schema"
)

// AllTopics as the topic of Subscribe delivers every row of the table.
const AllTopics = "*"

// Defaults of Config (docs/ARCHITECTURE.md, "The relay").
const (
	ClaimBatchSizeDefault    = 100
	PollIntervalDefault      = time.Second
	LockTTLDefault           = 60 * time.Second
	MaxAttemptsDefault       = 25
	ElectionIntervalDefault  = time.Second
	LeaderTimeoutDefault     = 15 * time.Second
	CloseTimeoutDefault      = 30 * time.Second
	DispatchTimeoutDefault   = 30 * time.Second
	StatsIntervalDefault     = 15 * time.Second
	LastErrorMaxBytesDefault = redact.DefaultMaxBytes
)

// LockTTLMin is the smallest LockTTL: a shorter lease cannot be renewed
// reliably (renewals run every LockTTL/2).
const LockTTLMin = 100 * time.Millisecond

// LeaderTimeoutMin is the smallest LeaderTimeout: the keepalive settings
// derived from it count whole seconds.
const LeaderTimeoutMin = 3 * time.Second

// Config configures a Subscriber.
type Config struct {
	// Table is the outbox table. Required.
	Table schema.Table
	// BatchSize is how many rows one claim leases. Defaults to
	// ClaimBatchSizeDefault (100).
	BatchSize int
	// MaxInFlight bounds the messages delivered and not yet acked or nacked,
	// per subscription, counting the rows already claimed for it and not
	// yet delivered (the batch in hand, the pre-claimed next batch, the
	// bounded claim's sweep). A message counts from its delivery until its
	// handler returns (acks or nacks it), also after the relay gave up on it
	// (DispatchTimeout passed, or its partition lease ended: it is delivered
	// again, and that copy counts too), until CloseTimeout after Close.
	// Defaults to 2 * BatchSize.
	MaxInFlight int
	// PollInterval is how often an idle subscriber looks for due rows that
	// nothing announced: missed notifications, rows another relay nacked or
	// written with a future available_at. A row this subscriber nacked is
	// claimed again when its Backoff ends, without waiting for the poll.
	// Defaults to 1s.
	PollInterval time.Duration
	// LockTTL is how long a lease lasts before another claim may take the row.
	// Leases of messages still in flight are renewed at LockTTL/2. With
	// single-active, a relay that is elected takes every lease left in the
	// table back at once (the lock proves the previous leader's session
	// gone), so a crashed leader's rows do not wait LockTTL. At least
	// LockTTLMin. Defaults to 60s.
	LockTTL time.Duration
	// MaxAttempts is after how many failed attempts a row is dead. Defaults
	// to 25.
	MaxAttempts int
	// Backoff returns the delay before the next attempt after attempt
	// (1-based) failed: the relay delivers a nacked row again that long
	// after the nack, also while it sleeps. Defaults to DefaultBackoff;
	// ExponentialBackoff builds another.
	Backoff func(attempt int) time.Duration
	// DisableSingleActive lets several subscribers share the table through
	// SKIP LOCKED alone. Defaults to false: one active subscriber per table,
	// elected by advisory lock. Do not mix the two on one table, nor a
	// single-active relay with the watermill-sql adapters' subscribers: an
	// elected leader takes back every lease in the table, theirs too (their
	// rows are delivered again; their late acks are fenced off).
	DisableSingleActive bool
	// DisableBoundedClaim makes Subscribe(ctx, AllTopics) claim without a
	// lower bound. By default, on a table whose available_at defaults to
	// clock_timestamp() (migration 000009), the claim starts its index scan
	// at a bound near the head of the queue instead of at the oldest entry,
	// so that a long-open transaction elsewhere (a pinned xmin horizon) does
	// not make every claim walk the dead entries of the rows relayed since
	// (docs/XMIN.md); a sweep every LockTTL/4 claims the rows below the
	// bound, which the bound missed (expired leases,
	// outbox_sweep_claimed_total). The
	// relay's role should be a member of pg_read_all_stats, or the bound
	// stays put while another role's writer is open. Defaults to false.
	DisableBoundedClaim bool
	// Ordered relays the rows that have an ordering key in per-key order
	// (docs/ORDERING.md): a key's next row only after the previous one was
	// acked, a failing row holds back its key only, and any number of
	// subscribers (relays) share the table by partition leases of LockTTL;
	// single-active does not apply. Rows without a key are relayed as in
	// the default mode. It needs the ordering_key column and the companion
	// tables (schema.WithOrderingKeyColumn). Defaults to false.
	Ordered bool
	// ElectionInterval is how often a standby tries to take over and a leader
	// checks its connection. Defaults to 1s.
	ElectionInterval time.Duration
	// LeaderTimeout bounds how long a single-active leader that cannot reach
	// the database keeps the table (a host cut off from the network, a hung
	// process). The leader's session gets TCP keepalive and TCP_USER_TIMEOUT
	// settings derived from it, so the server ends a silent leader's session,
	// which frees the lock, at most LeaderTimeout + LeaderTimeout/6 after the
	// leader's last packet; a standby takes over at its next election tick.
	// Takeover after a partition is therefore bounded by
	// LeaderTimeout*7/6 + ElectionInterval (18.5s with the defaults). On its
	// side, the leader pings its connection every ElectionInterval and bounds
	// each ping and claim by LeaderTimeout/3: when one does not answer, it
	// steps down (stops claiming and renewing leases, closes the connection,
	// reports outbox_relay_leader 0). It needs a session connection to the
	// server (not PgBouncer transaction pooling, see docs/OPERATIONS.md).
	// At least 3s. Defaults to 15s.
	LeaderTimeout time.Duration
	// DisableNotify turns the LISTEN/NOTIFY wake-up off; new rows are then
	// found by polling. Defaults to false.
	DisableNotify bool
	// DisableLeaseExtension turns off renewing the lease of messages in
	// flight; a handler slower than LockTTL then sees its message delivered
	// again. Defaults to false.
	DisableLeaseExtension bool
	// DispatchTimeout is how long a handler may keep a message. The lease
	// of a message in flight is renewed until DispatchTimeout plus a margin
	// of LockTTL/2 after its delivery (one renewal period, so that a handler
	// cancelled at DispatchTimeout by the router's timeout middleware has
	// time to answer); then the renewals stop, the message's context is
	// cancelled and the attempt counts as failed: the row is nacked with an
	// error saying the handler overran. Set it to the router's dispatch
	// timeout (router.MiddlewareConfig.DispatchTimeout). Defaults to 30s.
	DispatchTimeout time.Duration
	// CloseTimeout bounds how long Close, or the end of a subscription (its
	// Subscribe context done, as a router does at Close), waits for messages
	// in flight to be acked or nacked. Their contexts do not derive from the
	// Subscribe context: they stay live until CloseTimeout after the stop,
	// then are cancelled and their leases given back (a lease on the last
	// allowed attempt goes dead). Defaults to 30s.
	CloseTimeout time.Duration
	// LastErrorMaxBytes bounds last_error. Defaults to 2048.
	LastErrorMaxBytes int
	// Metrics records dispatch results, latency, dead rows, delivery lag,
	// leadership and the table gauges. Defaults to nil (no metrics).
	Metrics *metrics.Metrics
	// StatsInterval is how often the table gauges (pending, locked, oldest
	// pending age) are refreshed when Metrics is set. Defaults to 15s.
	StatsInterval time.Duration
}

func (c *Config) setDefaults() {
	if c.BatchSize == 0 {
		c.BatchSize = ClaimBatchSizeDefault
	}
	if c.MaxInFlight == 0 && c.BatchSize > 0 { // a negative BatchSize is reported as itself
		c.MaxInFlight = 2 * c.BatchSize
	}
	if c.PollInterval == 0 {
		c.PollInterval = PollIntervalDefault
	}
	if c.LockTTL == 0 {
		c.LockTTL = LockTTLDefault
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = MaxAttemptsDefault
	}
	if c.Backoff == nil {
		c.Backoff = DefaultBackoff
	}
	if c.ElectionInterval == 0 {
		c.ElectionInterval = ElectionIntervalDefault
	}
	if c.LeaderTimeout == 0 {
		c.LeaderTimeout = LeaderTimeoutDefault
	}
	if c.CloseTimeout == 0 {
		c.CloseTimeout = CloseTimeoutDefault
	}
	if c.DispatchTimeout == 0 {
		c.DispatchTimeout = DispatchTimeoutDefault
	}
	if c.LastErrorMaxBytes == 0 {
		c.LastErrorMaxBytes = LastErrorMaxBytesDefault
	}
	if c.StatsInterval == 0 {
		c.StatsInterval = StatsIntervalDefault
	}
}

func (c *Config) validate() error {
	errs := []error{keyed.CheckSettings(c.Table,
		keyed.Setting{Name: "BatchSize", Value: int64(c.BatchSize)}, keyed.Setting{Name: "MaxInFlight", Value: int64(c.MaxInFlight)},
		keyed.Setting{Name: "MaxAttempts", Value: int64(c.MaxAttempts)}, keyed.Setting{Name: "PollInterval", Value: int64(c.PollInterval)},
		keyed.Setting{Name: "LockTTL", Value: int64(c.LockTTL)}, keyed.Setting{Name: "ElectionInterval", Value: int64(c.ElectionInterval)},
		keyed.Setting{Name: "LeaderTimeout", Value: int64(c.LeaderTimeout)}, keyed.Setting{Name: "CloseTimeout", Value: int64(c.CloseTimeout)},
		keyed.Setting{Name: "DispatchTimeout", Value: int64(c.DispatchTimeout)}, keyed.Setting{Name: "LastErrorMaxBytes", Value: int64(c.LastErrorMaxBytes)},
		keyed.Setting{Name: "StatsInterval", Value: int64(c.StatsInterval)})}
	if c.MaxInFlight > 0 && c.MaxInFlight < c.BatchSize {
		errs = append(errs, fmt.Errorf("MaxInFlight (%d) is below BatchSize (%d); raise MaxInFlight or lower BatchSize", c.MaxInFlight, c.BatchSize))
	}
	if c.LockTTL > 0 && c.LockTTL < LockTTLMin {
		errs = append(errs, fmt.Errorf("LockTTL %s is too short to renew leases reliably; use at least %s", c.LockTTL, LockTTLMin))
	}
	if c.LeaderTimeout > 0 && c.LeaderTimeout < LeaderTimeoutMin {
		errs = append(errs, fmt.Errorf("LeaderTimeout: %s is below %s (the TCP keepalive derived from it counts whole seconds); use at least %s", c.LeaderTimeout, LeaderTimeoutMin, LeaderTimeoutMin))
	}
	if c.DisableLeaseExtension && c.CloseTimeout > c.LockTTL {
		errs = append(errs, fmt.Errorf("with DisableLeaseExtension, CloseTimeout (%s) must not exceed LockTTL (%s): a lease would expire while Close waits", c.CloseTimeout, c.LockTTL))
	}
	return errors.Join(errs...)
}

// ExponentialBackoff is a Config.Backoff that doubles: its Delay after
// failed attempt n is min(Base * 2^(n-1), Max) plus a jitter drawn uniformly
// from [0, Jitter) by Rand. Set Config.Backoff to its Delay method:
//
//	cfg.Backoff = (&subscriber.ExponentialBackoff{Base: time.Second, Max: time.Minute}).Delay
type ExponentialBackoff struct {
	Base, Max, Jitter time.Duration
	// Rand draws the jitter. Defaults to a source seeded at random.
	Rand *rand.Rand
	mu   sync.Mutex
}

// Delay returns the delay after failed attempt n (1-based).
func (b *ExponentialBackoff) Delay(n int) time.Duration {
	if n < 1 {
		n = 1
	}
	d := b.Max
	if n <= 32 {
		if exp := b.Base << (n - 1); exp > 0 && exp < b.Max {
			d = exp
		}
	}
	if b.Jitter > 0 {
		b.mu.Lock()
		if b.Rand == nil {
			b.Rand = rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64())) //nolint:gosec // jitter needs no cryptographic randomness
		}
		d += time.Duration(b.Rand.Int64N(int64(b.Jitter)))
		b.mu.Unlock()
	}
	return d
}

var defaultBackoff = &ExponentialBackoff{Base: time.Second, Max: 60 * time.Second, Jitter: 200 * time.Millisecond}

// DefaultBackoff is the default Config.Backoff:
// min(1s * 2^(attempt-1), 60s) + jitter(0..200ms).
func DefaultBackoff(attempt int) time.Duration { return defaultBackoff.Delay(attempt) }

// policy is the decision about failed attempts that the configuration
// makes, the same in the default and ordered modes (keyed.Policy).
func (c *Config) policy() keyed.Policy {
	return keyed.Policy{MaxAttempts: c.MaxAttempts, Backoff: c.Backoff, LastErrorMaxBytes: c.LastErrorMaxBytes, Permanent: IsPermanent}
}
