package doccheck

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// machineChanges are what only the test setup may do to a machine:
// install packages, reconfigure or restart PostgreSQL, start services.
var machineChanges = []string{"services.sh", "apt-get", "ALTER SYSTEM", "pg_ctlcluster", "rabbitmq-server", "make up"}

// TestDemoNeedsOnlyADatabase: `make demo` runs the demo and nothing else
// (`make -n demo` lists no setup script, no apt-get, no ALTER SYSTEM, no
// restart), the README's "Try it" leads with `make demo`, and `make up`,
// which may change the machine, says what it may change before its first
// step and never reconfigures or restarts the shared PostgreSQL.
func TestDemoNeedsOnlyADatabase(t *testing.T) {
	t.Parallel()
	cmd := exec.Command("make", "-n", "--no-print-directory", "demo")
	cmd.Dir = root
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("make -n demo: %v\n%s", err, out)
	}
	for _, c := range machineChanges {
		if strings.Contains(string(out), c) {
			t.Errorf("make demo runs %q, which changes the machine:\n%s", c, out)
		}
	}
	if !strings.Contains(string(out), "go run ./examples/demo") {
		t.Errorf("make demo does not run the demo:\n%s", out)
	}

	readme, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	tryIt := string(readme)
	start := strings.Index(tryIt, "\n## Try it\n")
	if start < 0 {
		t.Fatal(`README.md has no "## Try it" section`)
	}
	tryIt = tryIt[start+1:]
	if end := strings.Index(tryIt[1:], "\n## "); end >= 0 {
		tryIt = tryIt[:end+1]
	}
	first := regexp.MustCompile("(?m)^```sh\n(.*)$").FindStringSubmatch(tryIt)
	if first == nil || !strings.HasPrefix(first[1], "make demo") {
		t.Errorf("the first command of the README's \"Try it\" is %q, want make demo:\n%s", first, tryIt)
	}

	script, err := os.ReadFile(filepath.Join(root, "scripts", "services.sh"))
	if err != nil {
		t.Fatal(err)
	}
	up := regexp.MustCompile(`(?m)^up\)\n\t(\S+)`).FindStringSubmatch(string(script))
	if up == nil || up[1] != "announce" {
		t.Errorf("scripts/services.sh up starts with %q, want announce (say what it may change before changing it)", up)
	}
	announce := regexp.MustCompile(`(?ms)^announce\(\) \{.*?^\}`).FindString(string(script))
	for _, c := range []string{"apt-get", "private PostgreSQL cluster", "initdb", "never reconfigures or restarts the shared PostgreSQL", "make demo"} {
		if !strings.Contains(announce, c) {
			t.Errorf("services.sh's announce does not mention %q:\n%s", c, announce)
		}
	}
	// The shared server is never reconfigured or restarted (issue 57): when
	// it falls short, the tests get a private cluster instead.
	rest := strings.Replace(string(script), announce, "", 1)
	for _, re := range []string{`(?i)ALTER\s+SYSTEM`, `pg_ctlcluster[^\n]*\b(restart|reload)\b`, `pg_reload_conf`} {
		if m := regexp.MustCompile(re).FindString(rest); m != "" {
			t.Errorf("scripts/services.sh runs %q: make up must not reconfigure or restart the shared PostgreSQL", m)
		}
	}
}
