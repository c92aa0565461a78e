package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/console"
	"github.com/outboxkit/watermill-outbox/schema"
)

func init() {
	registerCommand("console", "serve the web console on OUTBOX_CONSOLE_ADDR (127.0.0.1:8080); with OUTBOX_CONSOLE_TOKEN reads and actions need it", runConsole)
}

// consoleAddrDefault is where the console listens unless OUTBOX_CONSOLE_ADDR
// says otherwise: loopback only.
const consoleAddrDefault = "127.0.0.1:8080"

// checkConsoleAddr refuses a non-loopback address without a token, unless
// the console is read-only on purpose. standalone tells `outbox console`
// (which has --read-only) from the relay daemon (which reads only the
// environment), so that the message names what exists.
func checkConsoleAddr(addr string, protected, readOnly, standalone bool) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("%w: OUTBOX_CONSOLE_ADDR=%q is not host:port", errUsage, addr)
	}
	ip := net.ParseIP(host)
	loopback := host == "localhost" || (ip != nil && ip.IsLoopback())
	if !loopback && !protected && !readOnly {
		how := "set OUTBOX_CONSOLE_READ_ONLY=true"
		if standalone {
			how = "pass --read-only (or set OUTBOX_CONSOLE_READ_ONLY=true)"
		}
		return fmt.Errorf("%w: the console would listen on %s, not a loopback address, without OUTBOX_CONSOLE_TOKEN; "+
			"set a token (OUTBOX_CONSOLE_TOKEN for actions, OUTBOX_CONSOLE_READ_TOKEN for reads only), or %s to let anyone who reaches it read it",
			errUsage, addr, how)
	}
	return nil
}

// consoleConfig is the console's part of the environment, for `outbox
// console` and for the relay daemon when OUTBOX_CONSOLE_ADDR is set.
type consoleConfig struct {
	addr         string
	token        string
	readToken    string
	readOnly     bool // no actions: the token reads, as the read token does
	publicRead   bool
	allowedHosts []string
	trustProxy   bool
	traceURL     string
	tables       []schema.Table
}

// loadConsoleConfig reads OUTBOX_CONSOLE_*. In the daemon (standalone
// false) an unset OUTBOX_CONSOLE_ADDR means no console. OUTBOX_CONSOLE_READ_ONLY
// (`outbox console --read-only`) turns the actions off: OUTBOX_CONSOLE_TOKEN
// then only lets its holder read, as OUTBOX_CONSOLE_READ_TOKEN does (both
// are accepted), unless OUTBOX_CONSOLE_PUBLIC_READ opens the reads.
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
	if c.publicRead, err = env.Bool("OUTBOX_CONSOLE_PUBLIC_READ", false); err != nil {
		return c, err
	}
	if c.trustProxy, err = env.Bool("OUTBOX_CONSOLE_TRUST_PROXY", false); err != nil {
		return c, err
	}
	for _, h := range strings.Split(env.String("OUTBOX_CONSOLE_ALLOWED_HOSTS", ""), ",") {
		if h = strings.TrimSpace(h); h != "" {
			if strings.ContainsAny(h, "/:@ ") {
				return c, fmt.Errorf("%w: OUTBOX_CONSOLE_ALLOWED_HOSTS: %q is not a host name; list names without scheme or port, e.g. console.example.com", errUsage, h)
			}
			c.allowedHosts = append(c.allowedHosts, h)
		}
	}
	if c.traceURL = strings.TrimSpace(env.String("OUTBOX_CONSOLE_TRACE_URL", "")); c.traceURL != "" {
		if err := console.CheckTraceURL(c.traceURL); err != nil {
			return c, fmt.Errorf("%w: %w", errUsage, err)
		}
	}
	c.token = env.String("OUTBOX_CONSOLE_TOKEN", "")
	c.readToken = env.String("OUTBOX_CONSOLE_READ_TOKEN", "")
	for _, tok := range []struct{ name, value string }{{"OUTBOX_CONSOLE_TOKEN", c.token}, {"OUTBOX_CONSOLE_READ_TOKEN", c.readToken}} {
		if tok.value != "" && len(tok.value) < console.MinTokenBytes {
			return c, fmt.Errorf("%w: %s is %d bytes, fewer than %d; use a random token of at least %d bytes, such as the output of `openssl rand -hex 32`",
				errUsage, tok.name, len(tok.value), console.MinTokenBytes, console.MinTokenBytes)
		}
	}
	c.readOnly = readOnly // the console token still guards the reads, beside the read token
	if err := checkConsoleAddr(c.addr, c.token != "" || c.readToken != "", readOnly, standalone); err != nil {
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

// mode says who may do what in the console, for its start-up line.
func (c consoleConfig) mode() string {
	switch {
	case c.readOnly && c.publicRead, c.readOnly && c.token == "" && c.readToken == "":
		return "read-only, anyone who reaches it reads it"
	case c.readOnly && c.token != "" && c.readToken != "":
		return "read-only, reads need OUTBOX_CONSOLE_READ_TOKEN or OUTBOX_CONSOLE_TOKEN"
	case c.readOnly:
		return "read-only, reads need the token"
	case c.token != "" && c.publicRead:
		return "anyone reads, actions need OUTBOX_CONSOLE_TOKEN"
	case c.token != "" && c.readToken != "":
		return "reads need OUTBOX_CONSOLE_READ_TOKEN or OUTBOX_CONSOLE_TOKEN, actions need OUTBOX_CONSOLE_TOKEN"
	case c.token != "":
		return "reads and actions need OUTBOX_CONSOLE_TOKEN"
	case c.readToken != "":
		return "read-only, reads need the token"
	}
	return "read-only, anyone who reaches it reads it"
}

// consoleServer is the console's HTTP server and the console, whose charts'
// sampling Shutdown stops after the server.
type consoleServer struct {
	srv *http.Server
	c   *console.Console
}

// Shutdown shuts the server down, then stops the console's sampling.
func (s consoleServer) Shutdown(ctx context.Context) error {
	err := s.srv.Shutdown(ctx)
	_ = s.c.Close()
	return err
}

// serveConsole starts the console's HTTP server on c.addr.
func serveConsole(pool *pgxpool.Pool, c consoleConfig, logger watermill.LoggerAdapter, stdout io.Writer) (consoleServer, error) {
	h, err := console.New(pool, console.Config{Tables: c.tables, Token: c.token, ReadToken: c.readToken, ReadOnly: c.readOnly, PublicRead: c.publicRead,
		Addr: c.addr, AllowedHosts: c.allowedHosts, TrustProxy: c.trustProxy, TraceURL: c.traceURL, Logger: logger, ChartInterval: console.ChartIntervalDaemon})
	if err != nil {
		return consoleServer{}, err
	}
	ln, err := net.Listen("tcp", c.addr)
	if err != nil {
		_ = h.Close()
		return consoleServer{}, fmt.Errorf("console: listen on OUTBOX_CONSOLE_ADDR=%s: %w", c.addr, err)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	mode := c.mode()
	fmt.Fprintf(stdout, "outbox console on http://%s (%s)\n", ln.Addr(), mode)
	logger.Info("Serving the console", watermill.LogFields{"addr": ln.Addr().String(), "mode": mode})
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			logger.Error("Console server stopped", err, nil)
		}
	}()
	return consoleServer{srv: srv, c: h}, nil
}

func runConsole(ctx context.Context, env Env, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("console", flag.ContinueOnError)
	fs.SetOutput(stderr)
	readOnly := fs.Bool("read-only", false, "no actions (OUTBOX_CONSOLE_READ_ONLY); a set OUTBOX_CONSOLE_TOKEN still guards the reads; without a token, required to listen on a non-loopback address")
	fs.Usage = func() { consoleUsage(stdout, fs) }
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

// consoleVars lists the environment `outbox console` reads, for its --help:
// the database, the tables and every OUTBOX_CONSOLE_* variable of the relay
// daemon's list (relayVars), with the defaults of the standalone console.
func consoleVars() [][3]string {
	vars := [][3]string{
		{"OUTBOX_DATABASE_URL", "(required)", "PostgreSQL URL or DSN"},
		{"OUTBOX_RELAY_TABLES", "(none)", "the tables shown when OUTBOX_CONSOLE_TABLES is unset"},
	}
	for _, v := range relayVars {
		if !strings.HasPrefix(v[0], "OUTBOX_CONSOLE_") {
			continue
		}
		switch v[0] {
		case "OUTBOX_CONSOLE_ADDR":
			v[1], v[2] = consoleAddrDefault, "the address the console listens on"
		case "OUTBOX_CONSOLE_TABLES":
			v[1] = "OUTBOX_RELAY_TABLES"
		}
		vars = append(vars, v)
	}
	return vars
}

func consoleUsage(w io.Writer, fs *flag.FlagSet) {
	fmt.Fprintln(w, "usage: outbox console [--read-only]\n\nServes the web console until SIGTERM.\n\nflags:")
	fs.SetOutput(w)
	fs.PrintDefaults()
	fmt.Fprintln(w, "\nIt reads the environment:")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "\n  VARIABLE\tDEFAULT\tMEANING")
	for _, v := range consoleVars() {
		fmt.Fprintf(tw, "  %s\t%s\t%s\n", v[0], v[1], v[2])
	}
	_ = tw.Flush()
	fmt.Fprintln(w, "\nA bad value stops the console with exit code 2 and the variable's name.")
}
