package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/redact"
	"github.com/outboxkit/watermill-outbox/schema"
)

// Health probe paths, served on OUTBOX_HEALTH_ADDR.
const (
	livenessPath  = "/healthz"
	readinessPath = "/readyz"
)

// readyPingTimeout bounds the database ping of one readiness check; keep the
// probe's own timeout above it.
const readyPingTimeout = time.Second

// health serves the daemon's liveness and readiness probes. A nil *health
// (OUTBOX_HEALTH_ADDR unset) ignores every call, so the relay's hooks need
// no checks.
type health struct {
	relayEnabled bool
	tables       int
	srv          *http.Server
	closeOnce    sync.Once

	mu     sync.Mutex
	pool   *pgxpool.Pool
	router *message.Router
	relays []tableRelay
}

// tableRelay is one table's relay as readiness sees it.
type tableRelay struct {
	table   schema.Table
	sub     leaderer
	handler *message.Handler
}

// leaderer is a table's relay as readiness sees it: the table relay
// (*subscriber.Subscriber) or the WAL relay (*walrelay.Subscriber).
type leaderer interface{ IsLeader() bool }

// startHealth serves GET /healthz and GET /readyz on OUTBOX_HEALTH_ADDR, or
// returns nil when it is empty (the default: no probe server).
func startHealth(env Env, cfg relayConfig, logger watermill.LoggerAdapter) (*health, error) {
	addr := env.String("OUTBOX_HEALTH_ADDR", "")
	if addr == "" {
		return nil, nil
	}
	h := &health{relayEnabled: cfg.relayEnabled, tables: len(cfg.tables)}
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+livenessPath, func(w http.ResponseWriter, _ *http.Request) {
		_, _ = fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("GET "+readinessPath, func(w http.ResponseWriter, r *http.Request) {
		ready, reason := h.ready(r.Context())
		if !ready {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		_, _ = fmt.Fprintln(w, reason)
	})
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("%w: OUTBOX_HEALTH_ADDR=%q: %w", errUsage, addr, err)
	}
	h.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		if err := h.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			logger.Error("Health server stopped", err, nil)
		}
	}()
	logger.Info("Serving health probes", watermill.LogFields{"addr": ln.Addr().String(), "liveness": livenessPath, "readiness": readinessPath})
	return h, nil
}

// setPool gives readiness the database to ping.
func (h *health) setPool(pool *pgxpool.Pool) {
	if h == nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.pool = pool
}

// addRelay registers a table's subscriber and router handler.
func (h *health) addRelay(t schema.Table, sub leaderer, handler *message.Handler) {
	if h == nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.relays = append(h.relays, tableRelay{table: t, sub: sub, handler: handler})
}

// setRouter registers the router that runs the relays.
func (h *health) setRouter(r *message.Router) {
	if h == nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.router = r
}

// ready reports whether the daemon is ready, with a one-line reason: the
// database answers a ping within readyPingTimeout, and (unless the relay is
// disabled) every table's relay runs, as leader or standby.
func (h *health) ready(ctx context.Context) (bool, string) {
	h.mu.Lock()
	pool, r, relays := h.pool, h.router, append([]tableRelay(nil), h.relays...)
	h.mu.Unlock()
	starting := r == nil || !r.IsRunning()
	if pool == nil {
		return false, "starting: connecting to the database"
	}
	ctx, cancel := context.WithTimeout(ctx, readyPingTimeout)
	defer cancel()
	if err := pool.Ping(ctx); err != nil {
		reason := "database does not answer: " + oneLine(err)
		if starting && h.relayEnabled {
			reason = "starting: waiting for the database: " + oneLine(err)
		}
		return false, reason
	}
	if !h.relayEnabled {
		return true, "ready: cleaner only (OUTBOX_RELAY_ENABLED=false), database answers"
	}
	if r != nil && r.IsClosed() {
		return false, "stopping: the relay is draining"
	}
	if starting {
		return false, fmt.Sprintf("starting: %d of %d table relays subscribed", len(relays), h.tables)
	}
	var leader, standby []string
	for _, tr := range relays {
		select {
		case <-tr.handler.Stopped():
			return false, "relay of table " + tr.table.String() + " stopped"
		default:
		}
		if tr.sub.IsLeader() {
			leader = append(leader, tr.table.String())
		} else {
			standby = append(standby, tr.table.String())
		}
	}
	return true, fmt.Sprintf("ready: leader of [%s], standby for [%s]", strings.Join(leader, " "), strings.Join(standby, " "))
}

// oneLine summarises err for a probe body: one line, no secret, bounded.
func oneLine(err error) string {
	return strings.Join(strings.Fields(redact.Summary(err.Error(), nil, 300)), " ")
}

// Close stops the probe server; it is idempotent.
func (h *health) Close() {
	if h == nil {
		return
	}
	h.closeOnce.Do(func() { _ = h.srv.Close() })
}
