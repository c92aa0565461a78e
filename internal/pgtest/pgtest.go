// Package pgtest runs a private PostgreSQL cluster for tests that must stop,
// restart or cut off the database (fault injection, network partitions)
// without touching the shared server that every other test uses. The
// cluster lives in a temporary directory, listens on its own port and
// addresses, trusts the addresses it is told to, and is stopped and removed
// when the test ends, even when it fails.
//
// It needs the PostgreSQL server binaries (initdb, pg_ctl): PG_BIN names
// their directory, else the newest /usr/lib/postgresql/*/bin, else the PATH.
// Run as root, the cluster runs as the user postgres (initdb refuses root).
// A missing binary fails the test loudly; it is never skipped.
package pgtest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// Options configures a cluster.
type Options struct {
	// Listen are the addresses the server listens on. Defaults to 127.0.0.1.
	Listen []string
	// Trust are the client networks (CIDR) allowed in without a password.
	// Defaults to 127.0.0.1/32.
	Trust []string
	// Port is the TCP port. Defaults to a free port.
	Port int
	// Settings are extra server settings (name to value), e.g.
	// max_connections.
	Settings map[string]string
	// PasswordRoles are login roles created with a password (role to
	// password) that must authenticate with it (scram-sha-256) from any
	// address, for tests of authentication failures.
	PasswordRoles map[string]string
}

// Cluster is a running private PostgreSQL cluster.
type Cluster struct {
	// Dir is the data directory.
	Dir string
	// Port is the TCP port.
	Port int
	// Host is the first listen address.
	Host string

	bin   string
	owner *user.User // nil: the current user
	logf  string
	opts  string
	tb    testing.TB
}

// Start initialises and starts a private cluster; it is stopped and removed
// when tb ends.
func Start(tb testing.TB, o Options) *Cluster {
	tb.Helper()
	if len(o.Listen) == 0 {
		o.Listen = []string{"127.0.0.1"}
	}
	if len(o.Trust) == 0 {
		o.Trust = []string{"127.0.0.1/32"}
	}
	pickPort := o.Port == 0
	if pickPort {
		o.Port = freePort(tb, o.Listen[0])
	}
	bin, err := binDir()
	if err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	dir, err := os.MkdirTemp("", "pgtest-")
	if err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	c := &Cluster{Dir: dir, Port: o.Port, Host: o.Listen[0], bin: bin, logf: filepath.Join(dir, "server.log"), tb: tb}
	tb.Cleanup(func() {
		c.stop("immediate")
		_ = os.RemoveAll(dir)
	})
	if os.Geteuid() == 0 {
		if c.owner, err = user.Lookup("postgres"); err != nil {
			tb.Fatalf("pgtest: running as root needs the user postgres to own the cluster: %v", err)
		}
		uid, _ := strconv.Atoi(c.owner.Uid)
		gid, _ := strconv.Atoi(c.owner.Gid)
		if err := os.Chown(dir, uid, gid); err != nil {
			tb.Fatalf("pgtest: %v", err)
		}
	}
	data := filepath.Join(dir, "data")
	c.Dir = data
	if out, err := c.command("initdb", "-D", data, "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync").CombinedOutput(); err != nil {
		tb.Fatalf("pgtest: initdb: %v\n%s", err, out)
	}
	hbaPath := filepath.Join(data, "pg_hba.conf")
	initial, err := os.ReadFile(hbaPath) //nolint:gosec // the cluster's own file
	if err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	var hba strings.Builder
	for r := range o.PasswordRoles { // first match wins: these lines go first
		fmt.Fprintf(&hba, "host all %s 0.0.0.0/0 scram-sha-256\n", r)
	}
	hba.Write(initial)
	for _, n := range o.Trust {
		fmt.Fprintf(&hba, "host all all %s trust\n", n)
	}
	if err := os.WriteFile(hbaPath, []byte(hba.String()), 0o600); err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	settings := map[string]string{
		"listen_addresses":        strings.Join(o.Listen, ","),
		"port":                    strconv.Itoa(o.Port),
		"unix_socket_directories": dir,
		"fsync":                   "off",
		"synchronous_commit":      "off",
		"full_page_writes":        "off",
		"shared_buffers":          "32MB",
		"max_connections":         "100",
	}
	for k, v := range o.Settings {
		settings[k] = v
	}
	render := func() {
		keys := make([]string, 0, len(settings))
		for k := range settings {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		var opts []string
		for _, k := range keys {
			opts = append(opts, fmt.Sprintf("-c %s=%s", k, settings[k]))
		}
		c.opts = strings.Join(opts, " ")
	}
	render()
	// A port FreePort found free can be taken by another process before the
	// server binds it: then the server starts on another free port.
	for tries := 1; ; tries++ {
		err := c.tryStart()
		if err == nil {
			break
		}
		if !pickPort || tries == 5 || !errors.Is(err, errPortTaken) {
			tb.Fatalf("pgtest: %v", err)
		}
		c.Port = freePort(tb, o.Listen[0])
		settings["port"] = strconv.Itoa(c.Port)
		render()
	}
	if len(o.PasswordRoles) > 0 {
		ctx := context.Background()
		conn, err := pgx.Connect(ctx, c.URL("", ""))
		if err != nil {
			tb.Fatalf("pgtest: %v", err)
		}
		defer func() { _ = conn.Close(ctx) }()
		for r, pw := range o.PasswordRoles {
			if _, err := conn.Exec(ctx, `CREATE ROLE `+pgx.Identifier{r}.Sanitize()+` LOGIN PASSWORD `+quoteLiteral(pw)); err != nil {
				tb.Fatalf("pgtest: create role: %v", err)
			}
		}
	}
	return c
}

func quoteLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// URL is a connection URL for database db ("postgres" when empty) at host
// (the first listen address when empty).
func (c *Cluster) URL(host, db string) string {
	if host == "" {
		host = c.Host
	}
	if db == "" {
		db = "postgres"
	}
	u := url.URL{Scheme: "postgres", User: url.User("postgres"), Host: net.JoinHostPort(host, strconv.Itoa(c.Port)), Path: "/" + db, RawQuery: "sslmode=disable"}
	return u.String()
}

// Restart restarts the server (fast shutdown: sessions are ended) and waits
// until it accepts connections.
func (c *Cluster) Restart() {
	c.tb.Helper()
	c.stop("fast")
	c.start()
}

// Stop stops the server (fast shutdown); Start starts it again.
func (c *Cluster) Stop() { c.tb.Helper(); c.stop("fast") }

// Start starts a stopped server.
func (c *Cluster) Start() { c.tb.Helper(); c.start() }

func (c *Cluster) start() {
	c.tb.Helper()
	if err := c.tryStart(); err != nil {
		c.tb.Fatalf("pgtest: %v", err)
	}
}

// errPortTaken is matched by the error of tryStart when the server could
// not bind its port: another process took it.
var errPortTaken = errors.New("the port is taken")

// tryStart starts the server and waits until it accepts connections.
func (c *Cluster) tryStart() error {
	_ = os.Remove(c.logf) // the log of this start only
	out, err := c.command("pg_ctl", "start", "-w", "-t", "60", "-D", c.Dir, "-l", c.logf, "-o", c.opts).CombinedOutput()
	if err != nil {
		log, _ := os.ReadFile(c.logf)
		if strings.Contains(string(log), "Address already in use") {
			return fmt.Errorf("pg_ctl start on port %d: %w: %w\n%s\n%s", c.Port, errPortTaken, err, out, log)
		}
		return fmt.Errorf("pg_ctl start: %w\n%s\n%s", err, out, log)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for {
		conn, err := pgx.Connect(ctx, c.URL("", ""))
		if err == nil {
			_ = conn.Close(ctx)
			return nil
		}
		if ctx.Err() != nil {
			return fmt.Errorf("the cluster does not accept connections at %s: %w", c.URL("", ""), err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (c *Cluster) stop(mode string) {
	if _, err := os.Stat(filepath.Join(c.Dir, "postmaster.pid")); err != nil {
		return
	}
	if out, err := c.command("pg_ctl", "stop", "-w", "-t", "60", "-m", mode, "-D", c.Dir).CombinedOutput(); err != nil {
		c.tb.Errorf("pgtest: pg_ctl stop: %v\n%s", err, out)
	}
}

// command runs a server binary as the cluster's owner.
func (c *Cluster) command(name string, args ...string) *exec.Cmd {
	path := filepath.Join(c.bin, name)
	if c.bin == "" {
		path = name
	}
	if c.owner != nil {
		return exec.Command("runuser", append([]string{"-u", c.owner.Username, "--", path}, args...)...) //nolint:gosec // PostgreSQL's own binaries
	}
	return exec.Command(path, args...) //nolint:gosec // PostgreSQL's own binaries
}

func binDir() (string, error) {
	if d := os.Getenv("PG_BIN"); d != "" {
		return d, nil
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool {
		vi, _ := strconv.Atoi(filepath.Base(filepath.Dir(dirs[i])))
		vj, _ := strconv.Atoi(filepath.Base(filepath.Dir(dirs[j])))
		return vi < vj
	})
	for i := len(dirs) - 1; i >= 0; i-- {
		if _, err := os.Stat(filepath.Join(dirs[i], "initdb")); err == nil {
			return dirs[i], nil
		}
	}
	if _, err := exec.LookPath("initdb"); err == nil {
		return "", nil
	}
	return "", fmt.Errorf("PostgreSQL server binaries (initdb, pg_ctl) not found: install the postgresql package or set PG_BIN")
}

// freePort is FreePort; tests replace it.
var freePort = FreePort

// FreePort returns a TCP port free on host at the time of the call.
func FreePort(tb testing.TB, host string) int {
	tb.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		tb.Fatalf("pgtest: find a free port on %s: %v", host, err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// Crash stops the server without a checkpoint (immediate shutdown, as a
// killed postmaster would) and starts it again: what the server keeps only
// in memory, such as a replication slot's confirmed position when the slot
// was not saved, is lost. Start the cluster with synchronous_commit = on
// for a crash to lose no committed transaction (the default here is off).
func (c *Cluster) Crash() {
	c.tb.Helper()
	c.stop("immediate")
	c.start()
}
