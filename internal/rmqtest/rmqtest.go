// Package rmqtest runs a private RabbitMQ node for tests that must stop and
// start the broker (fault injection) without touching the shared node that
// every other test uses. The node has its own name (fault<pid>@localhost),
// AMQP port and distribution port on 127.0.0.1, its own data and log
// directories and no plugins; it shares only the machine's Erlang cookie and
// epmd. It is stopped and its directory removed when the test ends, even when
// it fails.
//
// It needs the RabbitMQ server (rabbitmq-server, rabbitmqctl). Run as root,
// the node runs as the user rabbitmq. A missing server fails the test loudly;
// it is never skipped.
package rmqtest

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"
)

// Node is a private RabbitMQ node.
type Node struct {
	// Name is the Erlang node name, for rabbitmqctl -n.
	Name string
	// Port is the AMQP port on 127.0.0.1.
	Port int

	tb     testing.TB
	dir    string
	server string
	ctl    string
	owner  *user.User // nil: the current user
	env    []string
	cmd    *exec.Cmd
	exited chan struct{}
	starts int
}

// Start starts a private node and waits until it accepts AMQP connections;
// it is stopped and removed when tb ends.
func Start(tb testing.TB) *Node {
	tb.Helper()
	n := &Node{tb: tb, Name: fmt.Sprintf("fault%d@localhost", os.Getpid())}
	var err error
	if n.server, err = serverPath(); err != nil {
		tb.Fatalf("rmqtest: %v", err)
	}
	if n.ctl, err = exec.LookPath("rabbitmqctl"); err != nil {
		tb.Fatalf("rmqtest: rabbitmqctl not found: install the rabbitmq-server package: %v", err)
	}
	if n.dir, err = os.MkdirTemp("", "rmqtest-"); err != nil {
		tb.Fatalf("rmqtest: %v", err)
	}
	tb.Cleanup(func() {
		n.stop(false)
		_ = os.RemoveAll(n.dir)
	})
	n.Port = freePort(tb)
	dist := freePort(tb)
	home, _ := os.UserHomeDir()
	if os.Geteuid() == 0 {
		if n.owner, err = user.Lookup("rabbitmq"); err != nil {
			tb.Fatalf("rmqtest: running as root needs the user rabbitmq to own the node: %v", err)
		}
		home = n.owner.HomeDir
	}
	files := map[string]string{
		"enabled_plugins": "[].\n",
		"rabbitmq.conf":   fmt.Sprintf("listeners.tcp.1 = 127.0.0.1:%d\nloopback_users.guest = true\n", n.Port),
	}
	for name, body := range files {
		if err := os.WriteFile(filepath.Join(n.dir, name), []byte(body), 0o644); err != nil { //nolint:gosec // read by the node's user
			tb.Fatalf("rmqtest: %v", err)
		}
	}
	if n.owner != nil {
		uid, _ := strconv.Atoi(n.owner.Uid)
		gid, _ := strconv.Atoi(n.owner.Gid)
		_ = filepath.Walk(n.dir, func(p string, _ os.FileInfo, err error) error {
			if err == nil {
				err = os.Chown(p, uid, gid) //nolint:gosec // the node's own temporary directory
			}
			return err
		})
	}
	// The AMQP listener is set in the config file: with RABBITMQ_NODE_PORT,
	// RabbitMQ 3.10 cannot start the app again after stop_app (eaddrinuse).
	n.env = []string{
		"HOME=" + home,
		"PATH=" + os.Getenv("PATH"),
		"RABBITMQ_NODENAME=" + n.Name,
		"RABBITMQ_DIST_PORT=" + strconv.Itoa(dist),
		"RABBITMQ_MNESIA_BASE=" + filepath.Join(n.dir, "mnesia"),
		"RABBITMQ_LOG_BASE=" + filepath.Join(n.dir, "log"),
		"RABBITMQ_ENABLED_PLUGINS_FILE=" + filepath.Join(n.dir, "enabled_plugins"),
		"RABBITMQ_CONFIG_FILE=" + filepath.Join(n.dir, "rabbitmq.conf"),
		"RABBITMQ_ADVANCED_CONFIG_FILE=" + filepath.Join(n.dir, "advanced.config"),
		"RABBITMQ_PID_FILE=" + filepath.Join(n.dir, "pid"),
	}
	n.start()
	return n
}

// URL is the node's AMQP URL (user guest, from loopback).
func (n *Node) URL() string { return fmt.Sprintf("amqp://guest:guest@127.0.0.1:%d/", n.Port) }

// Stop stops the node (rabbitmqctl stop); its data stays for Start.
func (n *Node) Stop() { n.tb.Helper(); n.stop(true) }

// Start starts the stopped node again and waits until it accepts AMQP
// connections.
func (n *Node) Start() { n.tb.Helper(); n.start() }

func (n *Node) start() {
	n.tb.Helper()
	n.starts++
	out, err := os.Create(filepath.Join(n.dir, fmt.Sprintf("server-%d.log", n.starts)))
	if err != nil {
		n.tb.Fatalf("rmqtest: %v", err)
	}
	name, args := n.server, []string(nil)
	if n.owner != nil {
		name, args = "runuser", append([]string{"-u", n.owner.Username, "--", "env"}, append(n.env, n.server)...)
	}
	cmd := exec.Command(name, args...) //nolint:gosec // RabbitMQ's own server script
	if n.owner == nil {
		cmd.Env = n.env
	}
	cmd.Dir = n.dir
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // its own group, so that cleanup reaches beam and its children
	if err := cmd.Start(); err != nil {
		n.tb.Fatalf("rmqtest: start %s: %v", n.server, err)
	}
	n.cmd, n.exited = cmd, make(chan struct{})
	exited := n.exited
	go func() { _ = cmd.Wait(); _ = out.Close(); close(exited) }()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		c, err := net.DialTimeout("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(n.Port)), time.Second)
		if err == nil {
			_ = c.Close()
			return
		}
		select {
		case <-exited:
			log, _ := os.ReadFile(out.Name())
			n.tb.Fatalf("rmqtest: the node %s exited while starting:\n%s", n.Name, tail(log))
		default:
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(out.Name())
			n.tb.Fatalf("rmqtest: the node %s does not accept AMQP connections on port %d after 2 minutes:\n%s", n.Name, n.Port, tail(log))
		}
		time.Sleep(250 * time.Millisecond)
	}
}

func (n *Node) stop(report bool) {
	if n.cmd == nil {
		return
	}
	select {
	case <-n.exited:
		n.cmd = nil
		return
	default:
	}
	out, err := exec.Command(n.ctl, "-n", n.Name, "stop").CombinedOutput() //nolint:gosec // rabbitmqctl
	if err != nil && report {
		n.tb.Errorf("rmqtest: rabbitmqctl -n %s stop: %v\n%s", n.Name, err, out)
	}
	select {
	case <-n.exited:
	case <-time.After(30 * time.Second):
		// Only the process group this package started.
		_ = syscall.Kill(-n.cmd.Process.Pid, syscall.SIGKILL)
		<-n.exited
	}
	n.cmd = nil
}

func serverPath() (string, error) {
	// The Debian wrapper /usr/sbin/rabbitmq-server writes to the shared
	// node's log files; the script behind it does not.
	if p := "/usr/lib/rabbitmq/bin/rabbitmq-server"; fileExists(p) {
		return p, nil
	}
	p, err := exec.LookPath("rabbitmq-server")
	if err != nil {
		return "", fmt.Errorf("rabbitmq-server not found: install the rabbitmq-server package: %w", err)
	}
	return p, nil
}

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

func freePort(tb testing.TB) int {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("rmqtest: find a free port: %v", err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

func tail(b []byte) string {
	if len(b) > 3000 {
		b = b[len(b)-3000:]
	}
	return string(b)
}
