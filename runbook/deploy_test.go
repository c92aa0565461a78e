package runbook_test

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/outboxkit/watermill-outbox/metrics"
	"github.com/outboxkit/watermill-outbox/walrelay"
)

const (
	alertsFile    = "../deploy/prometheus/outbox-alerts.yml"
	dashboardFile = "../deploy/grafana/outbox-dashboard.json"
)

// metricRef finds metric names: outbox_ not preceded by a word character
// (so org_outbox_x is not one).
var metricRef = regexp.MustCompile(`(^|[^A-Za-z0-9_])(outbox_[a-z0-9_]+)`)

// mentionedMetrics returns the outbox_* metric names text mentions, with the
// histogram suffixes _bucket, _sum and _count removed.
func mentionedMetrics(text string) map[string]bool {
	out := map[string]bool{}
	for _, m := range metricRef.FindAllStringSubmatch(text, -1) {
		name := m[2]
		for _, suffix := range []string{"_bucket", "_sum", "_count"} {
			if base, ok := strings.CutSuffix(name, suffix); ok && slices.Contains(metrics.Names, base) {
				name = base
			}
		}
		out[name] = true
	}
	return out
}

func readDeployFile(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.FromSlash(path))
	if err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	return b
}

// checkMetricNames fails for every outbox_* name in text that metrics.Names
// does not list, and for every name of want that text does not mention.
func checkMetricNames(t *testing.T, file, text string, want []string) {
	t.Helper()
	found := mentionedMetrics(text)
	if len(found) == 0 {
		t.Fatalf("%s mentions no outbox_* metric", file)
	}
	for name := range found {
		if !slices.Contains(metrics.Names, name) && !slices.Contains(walrelay.MetricNames, name) {
			t.Errorf("%s mentions %s, which is not in metrics.Names %v nor walrelay.MetricNames", file, name, metrics.Names)
		}
	}
	for _, name := range want {
		if !found[name] {
			t.Errorf("%s does not use %s", file, name)
		}
	}
}

func TestMentionedMetrics(t *testing.T) {
	t.Parallel()
	got := mentionedMetrics(`rate(outbox_dispatch_latency_seconds_bucket[5m]) outbox_delivery_lag_seconds_count
		table="public.org_outbox_x" outbox_nonexistent_count outbox_pending`)
	want := map[string]bool{"outbox_dispatch_latency_seconds": true, "outbox_delivery_lag_seconds": true,
		"outbox_nonexistent_count": true, "outbox_pending": true}
	if len(got) != len(want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	for k := range want {
		if !got[k] {
			t.Fatalf("got %v, want %v", got, want)
		}
	}
}

// promRules is the shape of a Prometheus rule file; unknown keys fail the
// decode.
type promRules struct {
	Groups []struct {
		Name     string `yaml:"name"`
		Interval string `yaml:"interval"`
		Rules    []struct {
			Alert         string            `yaml:"alert"`
			Record        string            `yaml:"record"`
			Expr          string            `yaml:"expr"`
			For           string            `yaml:"for"`
			KeepFiringFor string            `yaml:"keep_firing_for"`
			Labels        map[string]string `yaml:"labels"`
			Annotations   map[string]string `yaml:"annotations"`
		} `yaml:"rules"`
	} `yaml:"groups"`
}

func TestAlertRules(t *testing.T) {
	t.Parallel()
	raw := readDeployFile(t, alertsFile)
	dec := yaml.NewDecoder(bytes.NewReader(raw))
	dec.KnownFields(true)
	var rules promRules
	if err := dec.Decode(&rules); err != nil {
		t.Fatalf("%s is not a valid Prometheus rule file: %v", alertsFile, err)
	}
	if len(rules.Groups) == 0 {
		t.Fatalf("%s has no rule group", alertsFile)
	}
	ops := string(readDeployFile(t, "../docs/OPERATIONS.md"))
	alerts := map[string]string{}
	var exprs strings.Builder
	for _, g := range rules.Groups {
		if g.Name == "" || len(g.Rules) == 0 {
			t.Errorf("group %q has no name or no rules", g.Name)
		}
		for _, r := range g.Rules {
			if r.Alert == "" || strings.TrimSpace(r.Expr) == "" || r.For == "" {
				t.Errorf("rule %+v needs alert, expr and for", r)
				continue
			}
			if _, dup := alerts[r.Alert]; dup {
				t.Errorf("alert %s defined twice", r.Alert)
			}
			alerts[r.Alert] = r.Expr
			exprs.WriteString(r.Expr + "\n")
			if sev := r.Labels["severity"]; sev != "critical" && sev != "warning" && sev != "info" {
				t.Errorf("alert %s: severity %q, want critical, warning or info", r.Alert, sev)
			}
			if r.Annotations["summary"] == "" || r.Annotations["description"] == "" {
				t.Errorf("alert %s needs summary and description annotations", r.Alert)
			}
			anchor, ok := strings.CutPrefix(r.Annotations["runbook"], "docs/OPERATIONS.md#")
			if !ok || anchor == "" || !strings.Contains(strings.ToLower(ops), "\n### "+anchor+"\n") {
				t.Errorf("alert %s: runbook annotation %q does not point at a section of docs/OPERATIONS.md", r.Alert, r.Annotations["runbook"])
			}
			if strings.Count(r.Expr, "(") != strings.Count(r.Expr, ")") || strings.Count(r.Expr, "{") != strings.Count(r.Expr, "}") {
				t.Errorf("alert %s: unbalanced brackets in %q", r.Alert, r.Expr)
			}
		}
	}
	// The alerts the runbook promises, on the metrics they must use.
	required := map[string]string{
		"OutboxBacklogAgeHigh":           "outbox_oldest_pending_age_seconds",
		"OutboxDeadEvents":               "increase(outbox_dead_total",
		"OutboxNoRelayLeader":            "max by (table) (outbox_relay_leader) == 0",
		"OutboxDispatchFailureRatioHigh": `outbox_dispatch_total{result="failure"}`,
	}
	for name, fragment := range required {
		if expr, ok := alerts[name]; !ok || !strings.Contains(expr, fragment) {
			t.Errorf("alert %s missing or not using %q: %q", name, fragment, expr)
		}
	}
	checkMetricNames(t, alertsFile, string(raw), nil)
	checkMetricNames(t, alertsFile+" (expressions)", exprs.String(), []string{
		"outbox_oldest_pending_age_seconds", "outbox_dead_total", "outbox_relay_leader", "outbox_dispatch_total",
		"outbox_wal_slot_retained_bytes", "outbox_wal_oldest_unsettled_age_seconds"})
}

type grafanaDashboard struct {
	Title         string `json:"title"`
	UID           string `json:"uid"`
	SchemaVersion int    `json:"schemaVersion"`
	Panels        []struct {
		ID      int    `json:"id"`
		Type    string `json:"type"`
		Title   string `json:"title"`
		GridPos *struct {
			X, Y, W, H int
		} `json:"gridPos"`
		Targets []struct {
			RefID string `json:"refId"`
			Expr  string `json:"expr"`
		} `json:"targets"`
	} `json:"panels"`
	Templating struct {
		List []struct {
			Name string `json:"name"`
			Type string `json:"type"`
		} `json:"list"`
	} `json:"templating"`
}

func TestGrafanaDashboard(t *testing.T) {
	t.Parallel()
	raw := readDeployFile(t, dashboardFile)
	var d grafanaDashboard
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatalf("%s is not valid JSON: %v", dashboardFile, err)
	}
	if d.Title == "" || d.UID == "" || d.SchemaVersion < 30 || len(d.Panels) == 0 {
		t.Fatalf("%s: title %q, uid %q, schemaVersion %d, %d panels", dashboardFile, d.Title, d.UID, d.SchemaVersion, len(d.Panels))
	}
	vars := map[string]string{}
	for _, v := range d.Templating.List {
		vars[v.Name] = v.Type
	}
	if vars["datasource"] != "datasource" || vars["table"] != "query" {
		t.Errorf("templating variables %v, want datasource and table", vars)
	}
	ids := map[int]bool{}
	var exprs strings.Builder
	for _, p := range d.Panels {
		if ids[p.ID] {
			t.Errorf("panel id %d used twice", p.ID)
		}
		ids[p.ID] = true
		if p.Title == "" || p.Type == "" || p.GridPos == nil || p.GridPos.W == 0 || p.GridPos.H == 0 {
			t.Errorf("panel %d (%q) needs a title, a type and a gridPos", p.ID, p.Title)
		}
		if p.Type == "row" {
			continue
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, q := range p.Targets {
			if q.RefID == "" || strings.TrimSpace(q.Expr) == "" {
				t.Errorf("panel %q: a target without refId or expr", p.Title)
			}
			exprs.WriteString(q.Expr + "\n")
		}
	}
	checkMetricNames(t, dashboardFile, string(raw), nil)
	// Every metric listed in docs/OPERATIONS.md is on the dashboard.
	checkMetricNames(t, dashboardFile+" (queries)", exprs.String(), []string{
		"outbox_enqueue_total", "outbox_dispatch_total", "outbox_dead_total", "outbox_dispatch_latency_seconds",
		"outbox_pending", "outbox_locked", "outbox_relay_leader", "outbox_oldest_pending_age_seconds", "outbox_delivery_lag_seconds"})
}
