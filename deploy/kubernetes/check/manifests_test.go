// Package check decodes the Kubernetes manifests of deploy/kubernetes
// strictly into the typed API objects and checks them against the daemon:
// probe paths and ports, metrics annotations, the environment variables
// docs/OPERATIONS.md documents, the Dockerfile's user. It is a module of its own so that
// the Kubernetes API types stay out of the main module's go.sum.
package check

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/yaml"
)

const (
	manifestDir = ".."
	repoRoot    = "../../.."
)

// manifests are the decoded objects of deploy/kubernetes, one kind each.
type manifests struct {
	deployment *appsv1.Deployment
	configMap  *corev1.ConfigMap
	secret     *corev1.Secret
	pdb        *policyv1.PodDisruptionBudget
}

// decode reads every *.yaml of deploy/kubernetes and decodes each document
// strictly (unknown or duplicate fields are errors) into its typed object.
func decode(t *testing.T) manifests {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(manifestDir, "*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no manifests in %s: %v", manifestDir, err)
	}
	var m manifests
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for i, doc := range regexp.MustCompile(`(?m)^---\s*$`).Split(string(data), -1) {
			if strings.TrimSpace(stripComments(doc)) == "" {
				continue
			}
			var tm metav1.TypeMeta
			if err := yaml.Unmarshal([]byte(doc), &tm); err != nil {
				t.Fatalf("%s document %d: %v", f, i, err)
			}
			var obj any
			switch tm.APIVersion + " " + tm.Kind {
			case "apps/v1 Deployment":
				m.deployment = &appsv1.Deployment{}
				obj = m.deployment
			case "v1 ConfigMap":
				m.configMap = &corev1.ConfigMap{}
				obj = m.configMap
			case "v1 Secret":
				m.secret = &corev1.Secret{}
				obj = m.secret
			case "policy/v1 PodDisruptionBudget":
				m.pdb = &policyv1.PodDisruptionBudget{}
				obj = m.pdb
			default:
				t.Fatalf("%s document %d: unexpected %q %q; add its type to this check", f, i, tm.APIVersion, tm.Kind)
			}
			if err := yaml.UnmarshalStrict([]byte(doc), obj); err != nil {
				t.Fatalf("%s document %d (%s): %v", f, i, tm.Kind, err)
			}
		}
	}
	if m.deployment == nil || m.configMap == nil || m.secret == nil || m.pdb == nil {
		t.Fatalf("want a Deployment, a ConfigMap, a Secret and a PodDisruptionBudget, got %+v", m)
	}
	return m
}

func stripComments(doc string) string {
	var b strings.Builder
	for _, l := range strings.Split(doc, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(l), "#") {
			b.WriteString(l + "\n")
		}
	}
	return b.String()
}

// readmeVariables returns the daemon's variables from the configuration
// table of docs/OPERATIONS.md ("The daemon's configuration"), with their
// documented defaults.
func readmeVariables(t *testing.T) map[string]string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(repoRoot, "docs", "OPERATIONS.md"))
	if err != nil {
		t.Fatal(err)
	}
	section := string(data)
	start := strings.Index(section, "\n## The daemon's configuration\n")
	if start < 0 {
		t.Fatal(`docs/OPERATIONS.md has no section "## The daemon's configuration"; has its format changed?`)
	}
	section = section[start+1:]
	if end := strings.Index(section, "\n## "); end >= 0 {
		section = section[:end]
	}
	data = []byte(section)
	row := regexp.MustCompile("(?m)^\\| `([A-Z][A-Z0-9_]+)` \\|([^|]*)\\|")
	vars := map[string]string{}
	for _, m := range row.FindAllStringSubmatch(string(data), -1) {
		vars[m[1]] = strings.Trim(strings.TrimSpace(m[2]), "`")
	}
	if len(vars) < 10 {
		t.Fatalf("found %d variables in the configuration table of docs/OPERATIONS.md; has its format changed?", len(vars))
	}
	return vars
}

// daemonConst returns the value of a string constant of package cmd/outbox.
func daemonConst(t *testing.T, name string) string {
	t.Helper()
	dir := filepath.Join(repoRoot, "cmd", "outbox")
	files, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		file, err := parser.ParseFile(fset, f, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, decl := range file.Decls {
			gd, ok := decl.(*ast.GenDecl)
			if !ok || gd.Tok != token.CONST {
				continue
			}
			for _, spec := range gd.Specs {
				vs := spec.(*ast.ValueSpec)
				for i, n := range vs.Names {
					if n.Name != name || i >= len(vs.Values) {
						continue
					}
					lit, ok := vs.Values[i].(*ast.BasicLit)
					if !ok || lit.Kind != token.STRING {
						t.Fatalf("constant %s of cmd/outbox is not a string literal", name)
					}
					v, _ := strconv.Unquote(lit.Value)
					return v
				}
			}
		}
	}
	t.Fatalf("cmd/outbox has no constant %s", name)
	return ""
}

// env is the container's effective environment as far as the manifests set
// it: the ConfigMap's keys, then the container's own entries ("<secret>"
// for values from a Secret).
func env(t *testing.T, m manifests, c corev1.Container) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, from := range c.EnvFrom {
		switch {
		case from.ConfigMapRef != nil:
			if from.ConfigMapRef.Name != m.configMap.Name {
				t.Fatalf("envFrom names ConfigMap %q; the manifest's is %q", from.ConfigMapRef.Name, m.configMap.Name)
			}
			for k, v := range m.configMap.Data {
				out[from.Prefix+k] = v
			}
		case from.SecretRef != nil:
			if from.SecretRef.Name != m.secret.Name {
				t.Fatalf("envFrom names Secret %q; the manifest's is %q", from.SecretRef.Name, m.secret.Name)
			}
			for k := range secretKeys(m.secret) {
				out[from.Prefix+k] = "<secret>"
			}
		}
	}
	for _, e := range c.Env {
		switch {
		case e.ValueFrom == nil:
			out[e.Name] = e.Value
		case e.ValueFrom.SecretKeyRef != nil:
			ref := e.ValueFrom.SecretKeyRef
			if ref.Name != m.secret.Name || !secretKeys(m.secret)[ref.Key] {
				t.Fatalf("env %s reads Secret %q key %q, which secret.example.yaml does not have", e.Name, ref.Name, ref.Key)
			}
			out[e.Name] = "<secret>"
		default:
			t.Fatalf("env %s: only plain values and secretKeyRef are checked here", e.Name)
		}
	}
	return out
}

func secretKeys(s *corev1.Secret) map[string]bool {
	keys := map[string]bool{}
	for k := range s.StringData {
		keys[k] = true
	}
	for k := range s.Data {
		keys[k] = true
	}
	return keys
}

// setting is the effective value of a daemon variable: the manifest's, else
// the documented default.
func setting(vars, env map[string]string, name string) string {
	if v, ok := env[name]; ok {
		return v
	}
	return vars[name]
}

func portOf(t *testing.T, name, addr string) int32 {
	t.Helper()
	_, p, err := net.SplitHostPort(addr)
	n, err2 := strconv.Atoi(p)
	if err != nil || err2 != nil {
		t.Fatalf("%s=%q is not host:port", name, addr)
	}
	return int32(n)
}

// containerPort resolves a probe's port (a name or a number) to the number.
func containerPort(t *testing.T, c corev1.Container, ref string) int32 {
	t.Helper()
	for _, cp := range c.Ports {
		if cp.Name == ref || strconv.Itoa(int(cp.ContainerPort)) == ref {
			return cp.ContainerPort
		}
	}
	t.Fatalf("port %q is not a port of container %s", ref, c.Name)
	return 0
}

func relayContainer(t *testing.T, d *appsv1.Deployment) corev1.Container {
	t.Helper()
	cs := d.Spec.Template.Spec.Containers
	if len(cs) != 1 {
		t.Fatalf("want one container, got %d", len(cs))
	}
	return cs[0]
}

// TestManifestsDecodeStrictly: each manifest is a valid typed object with
// no unknown field.
func TestManifestsDecodeStrictly(t *testing.T) {
	decode(t)
}

// TestProbesMatchTheDaemon: liveness and readiness probe the daemon's paths
// on the port of OUTBOX_HEALTH_ADDR, and their timeout leaves room for the
// readiness ping (1s).
func TestProbesMatchTheDaemon(t *testing.T) {
	m := decode(t)
	c := relayContainer(t, m.deployment)
	e := env(t, m, c)
	vars := readmeVariables(t)
	addr := setting(vars, e, "OUTBOX_HEALTH_ADDR")
	if addr == "" || strings.HasPrefix(addr, "(") {
		t.Fatalf("OUTBOX_HEALTH_ADDR is not set (documented default %q): the probes would find nothing", vars["OUTBOX_HEALTH_ADDR"])
	}
	port := portOf(t, "OUTBOX_HEALTH_ADDR", addr)
	for _, p := range []struct {
		name  string
		probe *corev1.Probe
		path  string
	}{
		{"liveness", c.LivenessProbe, daemonConst(t, "livenessPath")},
		{"readiness", c.ReadinessProbe, daemonConst(t, "readinessPath")},
	} {
		if p.probe == nil || p.probe.HTTPGet == nil {
			t.Fatalf("no HTTP %s probe", p.name)
		}
		if p.probe.HTTPGet.Path != p.path {
			t.Errorf("%s probe path %q, the daemon serves %q", p.name, p.probe.HTTPGet.Path, p.path)
		}
		if got := containerPort(t, c, p.probe.HTTPGet.Port.String()); got != port {
			t.Errorf("%s probe port %d, OUTBOX_HEALTH_ADDR=%q", p.name, got, addr)
		}
		if p.probe.TimeoutSeconds < 2 {
			t.Errorf("%s probe timeout %ds: readiness pings the database for up to 1s", p.name, p.probe.TimeoutSeconds)
		}
	}
}

// TestMetricsMatchTheDaemon: metrics are enabled, and the Prometheus
// annotations and the metrics port name the daemon's address and path.
func TestMetricsMatchTheDaemon(t *testing.T) {
	m := decode(t)
	c := relayContainer(t, m.deployment)
	e := env(t, m, c)
	vars := readmeVariables(t)
	if enabled := setting(vars, e, "PROMETHEUS_METRICS_ENABLED"); enabled != "true" {
		t.Fatalf("PROMETHEUS_METRICS_ENABLED=%q", enabled)
	}
	port := portOf(t, "PROMETHEUS_METRICS_ADDR", setting(vars, e, "PROMETHEUS_METRICS_ADDR"))
	path := setting(vars, e, "PROMETHEUS_METRICS_PATH")
	ann := m.deployment.Spec.Template.Annotations
	if ann["prometheus.io/scrape"] != "true" || ann["prometheus.io/port"] != strconv.Itoa(int(port)) || ann["prometheus.io/path"] != path {
		t.Fatalf("annotations %v, want scrape true, port %d, path %s", ann, port, path)
	}
	if got := containerPort(t, c, "metrics"); got != port {
		t.Fatalf("metrics container port %d, want %d", got, port)
	}
}

// TestEnvironmentIsDocumented: every variable the manifests set is in the
// documented configuration table, and the backend's broker variable is set.
func TestEnvironmentIsDocumented(t *testing.T) {
	m := decode(t)
	c := relayContainer(t, m.deployment)
	e := env(t, m, c)
	vars := readmeVariables(t)
	for name := range e {
		if _, ok := vars[name]; !ok {
			t.Errorf("the manifests set %s, which the configuration table of docs/OPERATIONS.md does not list", name)
		}
	}
	// Commented-out suggestions count too.
	for _, name := range regexp.MustCompile(`(?m)^\s*#\s*([A-Z][A-Z0-9_]+):`).FindAllStringSubmatch(mustRead(t, filepath.Join(manifestDir, "configmap.yaml")), -1) {
		if _, ok := vars[name[1]]; !ok {
			t.Errorf("configmap.yaml suggests %s, which the configuration table of docs/OPERATIONS.md does not list", name[1])
		}
	}
	for _, req := range []string{"OUTBOX_DATABASE_URL", "OUTBOX_RELAY_TABLES", "OUTBOX_BACKEND"} {
		if e[req] == "" {
			t.Errorf("%s is required and not set", req)
		}
	}
	broker := map[string]string{"kafka": "OUTBOX_KAFKA_BROKERS", "amqp": "OUTBOX_AMQP_URL"}[e["OUTBOX_BACKEND"]]
	if broker != "" && e[broker] == "" {
		t.Errorf("OUTBOX_BACKEND=%s needs %s", e["OUTBOX_BACKEND"], broker)
	}
	for _, ev := range c.Env {
		if ev.ValueFrom == nil && (strings.Contains(ev.Name, "URL") || strings.Contains(ev.Name, "BROKERS")) {
			t.Errorf("%s is a plain value; take it from the Secret", ev.Name)
		}
	}
}

func mustRead(t *testing.T, f string) string {
	t.Helper()
	b, err := os.ReadFile(f)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestDeploymentShape: two replicas for takeover, a PodDisruptionBudget that
// keeps one, non-root read-only containers as the Dockerfile's user, resource
// requests and limits, the image's entrypoint with the relay command, and a
// grace period longer than the drain.
func TestDeploymentShape(t *testing.T) {
	m := decode(t)
	d := m.deployment
	if d.Spec.Replicas == nil || *d.Spec.Replicas != 2 {
		t.Errorf("replicas %v, want 2 (a leader and a standby)", d.Spec.Replicas)
	}
	sel, err := selectorOf(d.Spec.Selector)
	if err != nil || !sel.Matches(labels.Set(d.Spec.Template.Labels)) {
		t.Errorf("the Deployment's selector does not select its pods: %v", err)
	}
	pdbSel, err := selectorOf(m.pdb.Spec.Selector)
	if err != nil || !pdbSel.Matches(labels.Set(d.Spec.Template.Labels)) {
		t.Errorf("the PodDisruptionBudget does not select the relay's pods: %v", err)
	}
	if mu := m.pdb.Spec.MinAvailable; mu == nil || mu.IntValue() != 1 {
		t.Errorf("PodDisruptionBudget minAvailable %v, want 1", mu)
	}

	user := dockerfileUser(t)
	ps := d.Spec.Template.Spec.SecurityContext
	if ps == nil || ps.RunAsNonRoot == nil || !*ps.RunAsNonRoot || ps.RunAsUser == nil || *ps.RunAsUser != user {
		t.Errorf("pod securityContext %+v, want runAsNonRoot and runAsUser %d (the Dockerfile's USER)", ps, user)
	}
	c := relayContainer(t, d)
	cs := c.SecurityContext
	if cs == nil || cs.ReadOnlyRootFilesystem == nil || !*cs.ReadOnlyRootFilesystem || cs.AllowPrivilegeEscalation == nil ||
		*cs.AllowPrivilegeEscalation || cs.RunAsNonRoot == nil || !*cs.RunAsNonRoot || cs.Capabilities == nil ||
		len(cs.Capabilities.Drop) != 1 || cs.Capabilities.Drop[0] != "ALL" {
		t.Errorf("container securityContext %+v", cs)
	}
	for _, r := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
		req, okReq := c.Resources.Requests[r]
		lim, okLim := c.Resources.Limits[r]
		if !okReq || !okLim || req.Cmp(lim) > 0 {
			t.Errorf("%s: request %v, limit %v", r, req.String(), lim.String())
		}
	}
	if len(c.Command) != 0 || len(c.Args) != 1 || c.Args[0] != "relay" {
		t.Errorf("command %v args %v, want the image's entrypoint with args [relay]", c.Command, c.Args)
	}
	dispatch, err := time.ParseDuration(setting(readmeVariables(t), env(t, m, c), "OUTBOX_RELAY_DISPATCH_TIMEOUT"))
	if err != nil {
		t.Fatal(err)
	}
	grace := d.Spec.Template.Spec.TerminationGracePeriodSeconds
	if drain := dispatch + 5*time.Second; grace == nil || time.Duration(*grace)*time.Second <= drain {
		t.Errorf("terminationGracePeriodSeconds is not above the drain, which takes up to %s", drain)
	}
}

func selectorOf(s *metav1.LabelSelector) (labels.Selector, error) {
	if s == nil {
		return nil, fmt.Errorf("no selector")
	}
	return metav1.LabelSelectorAsSelector(s)
}

// dockerfileUser is the numeric USER of the Dockerfile's final stage.
func dockerfileUser(t *testing.T) int64 {
	t.Helper()
	var user string
	for _, l := range strings.Split(mustRead(t, filepath.Join(repoRoot, "Dockerfile")), "\n") {
		if f := strings.Fields(l); len(f) == 2 && f[0] == "USER" {
			user = strings.SplitN(f[1], ":", 2)[0]
		}
	}
	n, err := strconv.ParseInt(user, 10, 64)
	if err != nil {
		t.Fatalf("the Dockerfile's USER %q is not numeric", user)
	}
	return n
}
