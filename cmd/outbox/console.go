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

	"github.com/outboxkit/watermill-outbox/console"
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

func runConsole(ctx context.Context, env Env, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("console", flag.ContinueOnError)
	fs.SetOutput(stderr)
	readOnly := fs.Bool("read-only", false, "serve read-only even when OUTBOX_CONSOLE_TOKEN is set; required to listen on a non-loopback address without a token")
	if err := fs.Parse(args); err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	addr := env.String("OUTBOX_CONSOLE_ADDR", consoleAddrDefault)
	token := env.String("OUTBOX_CONSOLE_TOKEN", "")
	if *readOnly {
		token = ""
	}
	if err := checkConsoleAddr(addr, token, *readOnly); err != nil {
		return err
	}
	relayTables, err := env.Tables("OUTBOX_RELAY_TABLES", nil)
	if err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	tables, err := env.Tables("OUTBOX_CONSOLE_TABLES", relayTables)
	if err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	if len(tables) == 0 {
		return fmt.Errorf("%w: no tables to show; set OUTBOX_CONSOLE_TABLES (or OUTBOX_RELAY_TABLES), e.g. public.app_outbox", errUsage)
	}
	pool, err := openRunbookDB(ctx, env)
	if err != nil {
		return err
	}
	defer pool.Close()
	logger := watermill.NewSlogLogger(nil)
	h, err := console.New(pool, console.Config{Tables: tables, Token: token, Logger: logger})
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("console: listen on %s: %w", addr, err)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	mode := "read-only"
	if token != "" {
		mode = "actions need the token"
	}
	fmt.Fprintf(stdout, "outbox console on http://%s (%s)\n", ln.Addr(), mode)
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	select {
	case err := <-done:
		return fmt.Errorf("console: %w", err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		return fmt.Errorf("console: shut down: %w", err)
	}
	if err := <-done; !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("console: %w", err)
	}
	return nil
}
