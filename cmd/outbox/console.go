package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/console"
	"github.com/outboxkit/watermill-outbox/schema"
)

func init() {
	registerCommand("console", "serve the web console on OUTBOX_CONSOLE_ADDR (127.0.0.1:8080); actions need OUTBOX_CONSOLE_TOKEN", runConsole)
}

// consoleAddrDefault is where the console listens unless OUTBOX_CONSOLE_ADDR
// says otherwise: loopback only.
const consoleAddrDefault = "127.0.0.1:8080"

// checkConsoleAddr refuses a non-loopback address without a token, unless
// the console is read-only on purpose.
func checkConsoleAddr(addr, token string, readOnly bool) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("%w: OUTBOX_CONSOLE_ADDR=%q is not host:port", errUsage, addr)
	}
	ip := net.ParseIP(host)
	loopback := host == "localhost" || (ip != nil && ip.IsLoopback())
	if !loopback && token == "" && !readOnly {
		return fmt.Errorf("%w: the console would listen on %s, not a loopback address, without OUTBOX_CONSOLE_TOKEN; set a token, or pass --read-only to serve it read-only", errUsage, addr)
	}
	return nil
}

// consoleConfig is the console's part of the environment, for `outbox
// console` and for the relay daemon when OUTBOX_CONSOLE_ADDR is set.
type consoleConfig struct {
	addr   string
	token  string
	tables []schema.Table
}

// loadConsoleConfig reads OUTBOX_CONSOLE_*. In the daemon (standalone
// false) an unset OUTBOX_CONSOLE_ADDR means no console; OUTBOX_CONSOLE_READ_ONLY
// is the daemon's --read-only.
func loadConsoleConfig(env Env, relayTables []schema.Table, standalone bool) (consoleConfig, error) {
	var c consoleConfig
	c.addr = env.String("OUTBOX_CONSOLE_ADDR", "")
	if c.addr == "" {
		if !standalone {
			return c, nil
		}
		c.addr = consoleAddrDefault
	}
	readOnly, err := env.Bool("OUTBOX_CONSOLE_READ_ONLY", false)
	if err != nil {
		return c, err
	}
	c.token = env.String("OUTBOX_CONSOLE_TOKEN", "")
	if readOnly {
		c.token = ""
	}
	if err := checkConsoleAddr(c.addr, c.token, readOnly); err != nil {
		return c, err
	}
	if c.tables, err = env.Tables("OUTBOX_CONSOLE_TABLES", relayTables); err != nil {
		return c, err
	}
	if len(c.tables) == 0 {
		return c, fmt.Errorf("%w: no tables to show; set OUTBOX_CONSOLE_TABLES (or OUTBOX_RELAY_TABLES), e.g. public.app_outbox", errUsage)
	}
	return c, nil
}

// serveConsole starts the console's HTTP server on c.addr.
func serveConsole(pool *pgxpool.Pool, c consoleConfig, logger watermill.LoggerAdapter, stdout io.Writer) (*http.Server, error) {
	h, err := console.New(pool, console.Config{Tables: c.tables, Token: c.token, Logger: logger})
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", c.addr)
	if err != nil {
		return nil, fmt.Errorf("console: listen on OUTBOX_CONSOLE_ADDR=%s: %w", c.addr, err)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	mode := "read-only"
	if c.token != "" {
		mode = "actions need the token"
	}
	fmt.Fprintf(stdout, "outbox console on http://%s (%s)\n", ln.Addr(), mode)
	logger.Info("Serving the console", watermill.LogFields{"addr": ln.Addr().String(), "mode": mode})
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			logger.Error("Console server stopped", err, nil)
		}
	}()
	return srv, nil
}

func runConsole(ctx context.Context, env Env, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("console", flag.ContinueOnError)
	fs.SetOutput(stderr)
	readOnly := fs.Bool("read-only", false, "serve read-only even when OUTBOX_CONSOLE_TOKEN is set; required to listen on a non-loopback address without a token")
	if err := fs.Parse(args); err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	if *readOnly {
		env = env.with("OUTBOX_CONSOLE_READ_ONLY", "true")
	}
	relayTables, err := env.Tables("OUTBOX_RELAY_TABLES", nil)
	if err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	c, err := loadConsoleConfig(env, relayTables, true)
	if err != nil {
		if !errors.Is(err, errUsage) {
			err = fmt.Errorf("%w: %w", errUsage, err)
		}
		return err
	}
	pool, err := openRunbookDB(ctx, env)
	if err != nil {
		return err
	}
	defer pool.Close()
	srv, err := serveConsole(pool, c, watermill.NewSlogLogger(nil), stdout)
	if err != nil {
		return err
	}
	<-ctx.Done()
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		return fmt.Errorf("console: shut down: %w", err)
	}
	return nil
}
