// Package console is a web page over the outbox tables: an overview of every
// table (counts, delivery rate, active relay, held keys, and with
// Config.ChartInterval charts of the counts over time), the dead rows
// grouped by a normalised cause and listed a page at a time, the rows of
// each state, the held keys, the relays, the backlog by topic and one
// event (its payload, headers and trace id, linked to a tracing UI with
// Config.TraceURL); and the actions replay one event, skip a held key's
// row, replay or skip the rows ticked on a list (their count confirmed),
// pause and resume a topic, and replay dead rows in bulk, by filter or by
// cause (preview, confirm the exact count, follow the progress). It sits
// on package runbook, so its rules are the CLI's.
//
// Mount the handler on your own mux:
//
//	h, err := console.New(pool, console.Config{Tables: tables, Token: token, Addr: "127.0.0.1:8080",
//		ChartInterval: console.ChartIntervalDaemon})
//	defer h.Close() // stops the charts' sampling
//	mux.Handle("/outbox/", http.StripPrefix("/outbox", h))
//
// Without Config.Token and Config.ReadToken the console is read-only and
// anyone who reaches it reads it. With a token, nothing but GET /healthz
// (and the login form's static files) answers without it, unless
// Config.PublicRead opens the reads; the read-only token reads and changes
// nothing, and so does the console token of a console with Config.ReadOnly. The token is given as an Authorization: Bearer header or to
// POST /login, which starts a random, expiring session (kept in memory)
// with its own CSRF token; POST /logout ends it. A state-changing request
// (POST only) needs the console token, the same origin and, in a session,
// its CSRF token. Failed logins are slowed down per client address, and a
// Host header that names neither Config.Addr nor Config.AllowedHosts is
// refused.
package console

import (
	"context"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"io"
	"io/fs"
	"math"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
)

//go:embed templates/*.html
var templateFS embed.FS

//go:embed static
var staticFS embed.FS

// Config configures the console.
type Config struct {
	// Tables are the outbox tables shown; at least one.
	Tables []schema.Table
	// Token, when set, lets its holder read every page and change state
	// (replay, skip), and then nothing but GET /healthz answers without a
	// token, unless PublicRead is set. At least MinTokenBytes bytes. Without
	// Token and ReadToken the console is read-only and anyone who reaches
	// it reads it. Defaults to "" (OUTBOX_CONSOLE_TOKEN).
	Token string
	// ReadToken, when set, lets its holder read every page (payloads
	// included) but change nothing; without PublicRead every read then
	// needs it or Token. At least MinTokenBytes bytes, not Token. Defaults
	// to "" (OUTBOX_CONSOLE_READ_TOKEN).
	ReadToken string
	// ReadOnly turns the actions off: Token then lets its holder read every
	// page but change nothing, as ReadToken does (both are accepted). Defaults
	// to false (OUTBOX_CONSOLE_READ_ONLY).
	ReadOnly bool
	// PublicRead lets anyone who reaches the console read every page,
	// payloads included, while Token guards the actions. Cannot be combined
	// with ReadToken. Defaults to false (OUTBOX_CONSOLE_PUBLIC_READ).
	PublicRead bool
	// Addr is the host:port the console is served on. A request whose Host
	// header names neither it nor one of AllowedHosts is refused (421), so
	// that a DNS-rebinding page cannot read the console; a loopback or
	// unspecified Addr also accepts the loopback names. With neither Addr
	// nor AllowedHosts the Host header is not checked. Defaults to ""
	// (OUTBOX_CONSOLE_ADDR).
	Addr string
	// AllowedHosts are more host names a request may name in its Host
	// header (without port), such as the console's DNS name behind a proxy.
	// Defaults to none (OUTBOX_CONSOLE_ALLOWED_HOSTS, comma-separated).
	AllowedHosts []string
	// TrustProxy says a reverse proxy in front of the console sets
	// X-Forwarded-Proto and X-Forwarded-For: the session cookie is Secure
	// when it says https, and failed logins are counted against the last
	// address of X-Forwarded-For. Set it only when clients cannot reach the
	// console but through that proxy. Defaults to false
	// (OUTBOX_CONSOLE_TRUST_PROXY).
	TrustProxy bool
	// ChartInterval is how often the console reads every table's counts
	// for the overview's charts and /api/series (runbook.Runbook.Stats, each
	// bounded by a 5 s statement timeout), in a goroutine that Close
	// stops; after a pass that took more than a quarter of it, the
	// console waits four times the pass instead. 0 reads nothing and draws no charts. Defaults to 0;
	// `outbox console` and the relay daemon use ChartIntervalDaemon.
	ChartInterval time.Duration
	// ChartWindow is how far back the charts go: the console keeps
	// ChartWindow/ChartInterval samples per table in memory (at most
	// 8,640). Defaults to ChartWindowDefault.
	ChartWindow time.Duration
	// TraceURL, when set, links the event page's trace id to a tracing
	// UI: an absolute http or https URL with {trace_id} where the trace id
	// goes, such as "https://tempo.example.com/trace/{trace_id}"
	// (CheckTraceURL says what is accepted; New refuses anything else).
	// The trace id is the one of the row's traceparent column
	// (schema.WithTraceColumns), which the relay puts on the message.
	// Defaults to "" (OUTBOX_CONSOLE_TRACE_URL): the trace id is shown
	// without a link.
	TraceURL string
	// SessionTTL is how long a login lasts. Sessions are kept in the
	// console's memory: a restart logs everyone out. Defaults to
	// SessionTTLDefault.
	SessionTTL time.Duration
	// Logger records every action (who, what); defaults to a no-op logger.
	Logger watermill.LoggerAdapter
}

// MinTokenBytes is the shortest Token or ReadToken New accepts.
const MinTokenBytes = 16

// SessionTTLDefault is the default of Config.SessionTTL.
const SessionTTLDefault = 8 * time.Hour

func (c *Config) setDefaults() {
	if c.SessionTTL == 0 {
		c.SessionTTL = SessionTTLDefault
	}
	if c.ChartWindow == 0 {
		c.ChartWindow = ChartWindowDefault
	}
}

func (c *Config) validate() error {
	if len(c.Tables) == 0 {
		return errors.New("no tables; set Config.Tables (OUTBOX_CONSOLE_TABLES)")
	}
	for _, t := range c.Tables {
		if t.IsZero() {
			return errors.New("a zero table; build tables with schema.ParseTable")
		}
	}
	for _, tok := range []struct{ field, env, value string }{
		{"Token", "OUTBOX_CONSOLE_TOKEN", c.Token}, {"ReadToken", "OUTBOX_CONSOLE_READ_TOKEN", c.ReadToken},
	} {
		if tok.value != "" && len(tok.value) < MinTokenBytes {
			return fmt.Errorf("%s (%s) is %d bytes, fewer than %d: use a random token of at least %d bytes, such as the output of `openssl rand -hex 32`",
				tok.field, tok.env, len(tok.value), MinTokenBytes, MinTokenBytes)
		}
	}
	if c.ReadToken != "" && c.ReadToken == c.Token {
		return errors.New("ReadToken (OUTBOX_CONSOLE_READ_TOKEN) equals Token (OUTBOX_CONSOLE_TOKEN): give the read-only token its own value")
	}
	if c.PublicRead && c.ReadToken != "" {
		return errors.New("PublicRead (OUTBOX_CONSOLE_PUBLIC_READ) and ReadToken (OUTBOX_CONSOLE_READ_TOKEN) conflict: with public reads the read-only token guards nothing; set one of them")
	}
	if c.ChartInterval < 0 || c.ChartWindow < 0 {
		return fmt.Errorf("ChartInterval %s or ChartWindow %s is negative; leave ChartInterval 0 for no charts", c.ChartInterval, c.ChartWindow)
	}
	if c.ChartInterval > 0 && c.ChartWindow < c.ChartInterval {
		return fmt.Errorf("ChartWindow %s is shorter than ChartInterval %s: the charts would hold one sample; make the window longer", c.ChartWindow, c.ChartInterval)
	}
	if c.SessionTTL < 0 {
		return fmt.Errorf("SessionTTL %s is negative; leave it 0 for %s", c.SessionTTL, SessionTTLDefault)
	}
	if c.TraceURL != "" {
		if err := CheckTraceURL(c.TraceURL); err != nil {
			return err
		}
	}
	return nil
}

// TraceIDPlaceholder is what Config.TraceURL has where the trace id goes.
const TraceIDPlaceholder = "{trace_id}"

// CheckTraceURL returns nil when s can be Config.TraceURL: an absolute
// http or https URL with a host name, without user information, spaces or
// control characters, that contains TraceIDPlaceholder outside its host
// and port. The error never
// repeats s (it may carry a secret).
func CheckTraceURL(s string) error {
	const what = "TraceURL (OUTBOX_CONSOLE_TRACE_URL)"
	if !strings.Contains(s, TraceIDPlaceholder) {
		return fmt.Errorf("%s has no %s: put it where your tracing UI takes the trace id, e.g. https://tempo.example.com/trace/%s",
			what, TraceIDPlaceholder, TraceIDPlaceholder)
	}
	if !isText(s) || strings.ContainsAny(s, " \t\r\n") {
		return fmt.Errorf("%s has spaces or control characters", what)
	}
	u, err := url.Parse(strings.ReplaceAll(s, TraceIDPlaceholder, "0"))
	switch {
	case err != nil:
		return fmt.Errorf("%s is not a URL", what)
	case u.Scheme != "http" && u.Scheme != "https":
		return fmt.Errorf("%s must be an http or https URL", what)
	case u.Host == "" || u.Opaque != "":
		return fmt.Errorf("%s must be an absolute URL with a host, such as https://tempo.example.com/trace/%s", what, TraceIDPlaceholder)
	case u.User != nil:
		return fmt.Errorf("%s must not carry a user or password: every reader of the console would see it", what)
	case u.Hostname() == "":
		return fmt.Errorf("%s has no host name, so every trace link would be broken; name the tracing UI's host, such as https://tempo.example.com/trace/%s", what, TraceIDPlaceholder)
	case strings.Contains(authority(s), TraceIDPlaceholder):
		return fmt.Errorf("%s has %s in its host or port; put it in the path, query or fragment, such as https://tempo.example.com/trace/%s", what, TraceIDPlaceholder, TraceIDPlaceholder)
	}
	return nil
}

// authority returns the host and port part of an absolute URL (after
// "scheme://", up to the path, query or fragment).
func authority(s string) string {
	_, rest, ok := strings.Cut(s, "://")
	if !ok {
		return ""
	}
	if i := strings.IndexAny(rest, "/?#"); i >= 0 {
		rest = rest[:i]
	}
	return rest
}

// sessionCookie is the cookie POST /login sets: a random session id, never
// the token.
const sessionCookie = "outbox_console"

// contentSecurityPolicy allows only the console's own script and style.
const contentSecurityPolicy = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; " +
	"form-action 'self'; frame-ancestors 'none'; base-uri 'none'"

type handler struct {
	pool   *pgxpool.Pool
	cfg    Config
	tables map[string]schema.Table
	names  []string
	tmpl   *template.Template
	logger watermill.LoggerAdapter
	mux    *http.ServeMux
	now    func() time.Time

	causesTimeout time.Duration

	series *sampler // nil without charts

	sessions *sessions
	limiter  *limiter

	jobsMu sync.Mutex
	jobs   map[string]*job // bulk replays, by id
	order  []string        // job ids, oldest first
}

// maxJobs bounds the bulk replays whose progress the console keeps, per
// table in <table>_replay_jobs (and in memory when that table is missing).
const maxJobs = 50

// Console is the console's HTTP handler. Close it when Config.ChartInterval
// is set: it stops the sampling.
type Console struct {
	*handler
}

// Close stops the sampling of the charts and waits for it. It is
// idempotent, and does nothing without Config.ChartInterval.
func (c *Console) Close() error {
	if c.series != nil {
		c.series.close()
	}
	return nil
}

// New returns the console's handler over pool. With Config.ChartInterval
// set it starts sampling the counts at once: Close the console when done.
func New(pool *pgxpool.Pool, cfg Config) (*Console, error) {
	if pool == nil {
		return nil, errors.New("console: nil pool")
	}
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("console: invalid config: %w", err)
	}
	h := &handler{pool: pool, cfg: cfg, tables: map[string]schema.Table{}, logger: cfg.Logger, jobs: map[string]*job{}, now: time.Now, causesTimeout: causesTimeoutDefault,
		sessions: &sessions{ttl: cfg.SessionTTL, m: map[[32]byte]*session{}}, limiter: &limiter{m: map[string]*failures{}}}
	if h.logger == nil {
		h.logger = watermill.NopLogger{}
	}
	for _, t := range cfg.Tables {
		h.tables[t.String()] = t
		h.names = append(h.names, t.String())
	}
	sort.Strings(h.names)
	tmpl, err := template.New("").Funcs(template.FuncMap{
		"when":      func(v any) template.HTML { return when(v, time.Now()) },
		"perSecond": func(perMinute int64) string { return strconv.FormatFloat(float64(perMinute)/60, 'f', 1, 64) },
		"plural":    plural,
		"short":     func(s string) string { return shorten(s, 160) },
		"rowState":  rowState,
		"dur":       duration,
		"ranges":    ranges,
		// replayable: the rows page's tick box for a replay.
		"replayable": func(m schema.Mode, row runbook.Row) bool { return whyNoReplay(m, row) == "" },
	}).ParseFS(templateFS, "templates/*.html")
	if err != nil {
		return nil, fmt.Errorf("console: templates: %w", err)
	}
	h.tmpl = tmpl
	static, err := fs.Sub(staticFS, "static")
	if err != nil {
		return nil, fmt.Errorf("console: static files: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /static/", http.StripPrefix("/static/", http.FileServerFS(static)))
	mux.HandleFunc("GET /{$}", h.overview)
	mux.HandleFunc("GET /t/{table}/dead", h.dead)
	mux.HandleFunc("GET /t/{table}/held", h.held)
	mux.HandleFunc("GET /t/{table}/rows", h.rows)
	mux.HandleFunc("GET /t/{table}/relays", h.relays)
	mux.HandleFunc("GET /t/{table}/topics", h.topics)
	mux.HandleFunc("GET /t/{table}/event/{id}", h.event)
	mux.HandleFunc("GET /t/{table}/replay", h.preview)
	mux.HandleFunc("GET /t/{table}/replay/{job}", h.jobPage)
	mux.HandleFunc("GET /api/counts", h.counts)
	mux.HandleFunc("GET /api/series", h.apiSeries)
	mux.HandleFunc("GET /api/replay/{job}", h.jobProgress)
	mux.HandleFunc("POST /login", h.login)
	mux.HandleFunc("POST /logout", h.logout)
	mux.HandleFunc("POST /t/{table}/event/{id}/replay", h.replay)
	mux.HandleFunc("POST /t/{table}/event/{id}/skip", h.skip)
	mux.HandleFunc("POST /t/{table}/skip", h.bulkSkip)
	mux.HandleFunc("POST /t/{table}/replay-ticked", h.bulkReplayTicked)
	mux.HandleFunc("POST /t/{table}/replay", h.bulkReplay)
	mux.HandleFunc("POST /t/{table}/topics/pause", func(w http.ResponseWriter, r *http.Request) { h.pauseTopic(w, r, false) })
	mux.HandleFunc("POST /t/{table}/topics/resume", func(w http.ResponseWriter, r *http.Request) { h.pauseTopic(w, r, true) })
	h.mux = mux
	if cfg.ChartInterval > 0 {
		h.startSampler()
	}
	return &Console{h}, nil
}

// maxBody bounds the body of a request (forms are small).
const maxBody = 64 << 10

// ServeHTTP sets the security headers, checks the Host, the input and who
// asks, and routes. GET /healthz always answers; the static files and the
// login and logout forms answer anyone with the right Host; every other
// page needs a token when the console has one (unless PublicRead).
func (h *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	hd := w.Header()
	hd.Set("Content-Security-Policy", contentSecurityPolicy)
	hd.Set("X-Content-Type-Options", "nosniff")
	hd.Set("Referrer-Policy", "no-referrer")
	hd.Set("X-Frame-Options", "DENY")
	hd.Set("Cache-Control", "no-store")
	if r.URL.Path == "/healthz" {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
			return
		}
		hd.Set("Content-Type", "text/plain; charset=utf-8")
		_, _ = io.WriteString(w, "ok\n")
		return
	}
	if !h.hostAllowed(r) {
		http.Error(w, "the Host header does not name this console: add the name you use to OUTBOX_CONSOLE_ALLOWED_HOSTS (console.Config.AllowedHosts)", http.StatusMisdirectedRequest)
		return
	}
	r.Body = http.MaxBytesReader(w, r.Body, maxBody)
	if msg := checkInput(r); msg != "" {
		h.fail(w, r, http.StatusBadRequest, msg, "", "")
		return
	}
	id, ok := h.authenticate(w, r)
	if !ok {
		return
	}
	r = r.WithContext(context.WithValue(r.Context(), identityKey{}, id))
	public := strings.HasPrefix(r.URL.Path, "/static/") || r.URL.Path == "/login" || r.URL.Path == "/logout"
	if !public && id.role == roleNone && !h.readsOpen() {
		if strings.HasPrefix(r.URL.Path, "/api/") || r.Method != http.MethodGet {
			http.Error(w, "this console needs its token: an Authorization: Bearer header, or log in", http.StatusUnauthorized)
			return
		}
		h.renderStatus(w, r, http.StatusUnauthorized, "login.html", "Log in", nil)
		return
	}
	h.mux.ServeHTTP(w, r)
}

// checkInput refuses a query or form that is not text: bad escapes,
// invalid UTF-8, NUL or other control characters (tab and newline aside).
// It returns the refusal, "" when the input is fine.
func checkInput(r *http.Request) string {
	q, err := url.ParseQuery(r.URL.RawQuery)
	if err != nil {
		return "the query string is malformed"
	}
	if !textValues(q) {
		return "the query string must be UTF-8 text without control characters"
	}
	if r.Method == http.MethodPost {
		if err := r.ParseForm(); err != nil {
			return "the form is malformed or too large"
		}
		if !textValues(r.PostForm) {
			return "the form must be UTF-8 text without control characters"
		}
	}
	return ""
}

func textValues(v url.Values) bool {
	for k, vs := range v {
		if !isText(k) {
			return false
		}
		for _, s := range vs {
			if !isText(s) {
				return false
			}
		}
	}
	return true
}

func isText(s string) bool {
	if !utf8.ValidString(s) {
		return false
	}
	for _, c := range s {
		if c < 0x20 && c != '\t' && c != '\n' && c != '\r' || c == 0x7f {
			return false
		}
	}
	return true
}

func (h *handler) table(w http.ResponseWriter, r *http.Request) (schema.Table, bool) {
	t, ok := h.tables[r.PathValue("table")]
	if !ok {
		h.fail(w, r, http.StatusNotFound, "Unknown table: the console shows only its configured tables.", "", "")
	}
	return t, ok
}

// page is what every template gets.
type page struct {
	Title string
	// LoggedIn: the viewer may act (the console token); the action
	// buttons show.
	LoggedIn bool
	// Reader: the viewer holds the read-only token.
	Reader bool
	// Session: the viewer came with a session cookie (the logout button
	// shows).
	Session bool
	// CanLogIn: the console has a token the viewer has not given.
	CanLogIn bool
	// ReadOnly: the viewer cannot act and cannot log in to.
	ReadOnly bool
	// CSRF is the session's CSRF token, "" without a session.
	CSRF string
	// Refresh is the seconds between the page's refreshes in place, 0
	// for a page that does not refresh.
	Refresh int
	// Follows is the seconds between the reads of a page that follows
	// something itself (a bulk replay's progress), 0 for the others.
	Follows int
	Data    any
}

// refreshSeconds are the pages that refresh in place, and how often: every
// page that shows the table's state. The others are the login form,
// refusals and the reports of a bulk action (a POST's answer: reading it
// again would act again), and the bulk replay's progress, which follows
// itself (followSeconds).
var refreshSeconds = map[string]int{"overview.html": 2, "dead.html": 10, "held.html": 5, "topics.html": 5, "event.html": 5, "rows.html": 5, "relays.html": 5,
	"preview.html": 5}

// followSeconds are the pages that follow something themselves, and how
// often; the header's pause toggle holds them too.
var followSeconds = map[string]int{"job.html": 1}

func (h *handler) render(w http.ResponseWriter, r *http.Request, name, title string, data any) {
	h.renderStatus(w, r, http.StatusOK, name, title, data)
}

func (h *handler) renderStatus(w http.ResponseWriter, r *http.Request, status int, name, title string, data any) {
	id := identityOf(r)
	p := page{Title: title, LoggedIn: id.role == roleAdmin, Reader: id.role == roleReader, Session: id.sess != nil, Data: data, Refresh: refreshSeconds[name], Follows: followSeconds[name]}
	p.CanLogIn = id.role == roleNone && h.authEnabled()
	p.ReadOnly = !p.LoggedIn && !p.CanLogIn
	if id.sess != nil {
		p.CSRF = id.sess.csrf
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	if err := h.tmpl.ExecuteTemplate(w, name, p); err != nil {
		h.logger.Error("Console page failed", err, watermill.LogFields{"page": name})
	}
}

// failure is what the error page shows.
type failure struct {
	Status int
	// Message says what went wrong and what to do.
	Message string
	// Back and BackLabel are the link back, "" for the overview.
	Back, BackLabel string
}

// fail answers a refused or failed request: a page with the layout, the
// message and a link back (back, or the overview when ""), or plain text
// for /api/ paths. Never a payload or a secret in msg.
func (h *handler) fail(w http.ResponseWriter, r *http.Request, status int, msg, back, backLabel string) {
	if strings.HasPrefix(r.URL.Path, "/api/") {
		http.Error(w, msg, status)
		return
	}
	if back == "" {
		back, backLabel = "/", "the overview"
	}
	h.renderStatus(w, r, status, "error.html", http.StatusText(status), failure{Status: status, Message: msg, Back: back, BackLabel: backLabel})
}

// tableView is one table's line of the overview and of /api/counts.
type tableView struct {
	Name  string             `json:"-"`
	Stats runbook.TableStats `json:"stats"`
	// Held counts the held keys (ordered mode), up to maxHeldShown.
	Held int `json:"held_keys"`
	// Leader is the active relay's session, nil when no relay holds the
	// single-active lock.
	Leader *runbook.Session `json:"leader"`
	// OrderedRelays counts the ordered relays owning partitions.
	OrderedRelays int `json:"ordered_relays"`
	// WALSlot is a WAL table's replication slot and who reads it (the
	// WAL relay holds no single-active lock), nil in the other modes.
	WALSlot *runbook.WALSlot `json:"wal_slot,omitempty"`
	// Paused lists the topics an operator paused (runbook.Runbook.PausedTopics).
	Paused []string `json:"paused_topics"`
	Err    string   `json:"-"`
}

// maxHeldShown bounds the held keys the console lists and counts.
const maxHeldShown = 1000

func (h *handler) stats(ctx context.Context) []tableView {
	out := make([]tableView, 0, len(h.names))
	for _, n := range h.names {
		rb := runbook.New(h.pool, h.tables[n])
		st, err := rb.Stats(ctx)
		v := tableView{Name: n, Stats: st}
		var held []runbook.HeldKey
		if err == nil {
			held, err = rb.HeldKeys(ctx, maxHeldShown)
			v.Held = len(held)
		}
		if err == nil {
			v.Leader, err = rb.Leader(ctx)
		}
		if err == nil {
			v.OrderedRelays, err = rb.OrderedRelays(ctx)
		}
		if err == nil && st.Mode == schema.ModeWAL {
			v.WALSlot, err = rb.WALSlotReader(ctx)
		}
		if err == nil && st.PausedTopics > 0 {
			var paused []runbook.PausedTopic
			paused, err = rb.PausedTopics(ctx)
			for _, p := range paused {
				v.Paused = append(v.Paused, p.Topic)
			}
		}
		if err != nil {
			v.Err = "cannot read the table's counts (see the console's log)"
			h.logger.Error("Console could not read stats", err, watermill.LogFields{"table": n})
		}
		out = append(out, v)
	}
	return out
}

func (h *handler) overview(w http.ResponseWriter, r *http.Request) {
	views := h.stats(r.Context())
	h.render(w, r, "overview.html", "Outbox", struct {
		Tables []tableView
		Charts []chart
	}{views, h.charts(views)})
}

// counts is the live refresh: every table's counts as JSON.
func (h *handler) counts(w http.ResponseWriter, r *http.Request) {
	out := map[string]tableView{}
	for _, v := range h.stats(r.Context()) {
		out[v.Name] = v
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(out)
}

func (h *handler) event(w http.ResponseWriter, r *http.Request) {
	t, ok := h.table(w, r)
	if !ok {
		return
	}
	id, err := uuid.Parse(r.PathValue("id"))
	if err != nil {
		h.fail(w, r, http.StatusBadRequest, "The event id must be a UUID.", tablePath(t, "dead"), "the dead rows")
		return
	}
	rb := runbook.New(h.pool, t)
	row, err := rb.Event(r.Context(), id)
	if errors.Is(err, runbook.ErrEventNotFound) {
		h.fail(w, r, http.StatusNotFound, "No such event in this table (the cleaner may have deleted it).", tablePath(t, "rows"), "the rows")
		return
	}
	if err != nil {
		h.logger.Error("Console could not read an event", err, watermill.LogFields{"table": t.String()})
		h.fail(w, r, http.StatusInternalServerError, "Cannot read the event (see the console's log).", tablePath(t, "dead"), "the dead rows")
		return
	}
	extras, err := h.eventExtras(r.Context(), t, id, r.URL.Query().Get("payload") == "1")
	if err != nil {
		h.logger.Error("Console could not read an event's payload, headers or trace context", err, watermill.LogFields{"table": t.String()})
		h.fail(w, r, http.StatusInternalServerError, "Cannot read the event (see the console's log).", tablePath(t, "dead"), "the dead rows")
		return
	}
	mode, err := rb.Mode(r.Context())
	if err != nil {
		h.logger.Error("Console could not read a table's relay mode", err, watermill.LogFields{"table": t.String()})
		h.fail(w, r, http.StatusInternalServerError, "Cannot read the event (see the console's log).", tablePath(t, "dead"), "the dead rows")
		return
	}
	noReplay := whyNoReplay(mode, row)
	// The Replay button shows only when the runbook's own rule accepts the
	// replay now (a dry run of it: a hold's state, a keyed row its relay
	// has not recorded as done, a lease); the page says why not instead.
	if noReplay == "" {
		if _, err := rb.ReplayEvent(r.Context(), id, runbook.ReplayOptions{DryRun: true}); err != nil {
			noReplay = "Not replayable now: " + strings.TrimPrefix(err.Error(), "runbook: ") + "."
		}
	}
	// The Skip button shows when the runbook's own rules accept the skip
	// now (a dry run of it), in every mode.
	_, skipErr := rb.SkipEvent(r.Context(), id, true)
	h.render(w, r, "event.html", "Event "+id.String(), struct {
		Table    string
		Row      runbook.Row
		X        eventExtras
		Flash    string
		NoReplay string
		TraceURL bool
		CanSkip  bool
	}{t.String(), row, extras, flash(r), noReplay, h.cfg.TraceURL != "", skipErr == nil})
}

// whyNoReplay says why runbook.Runbook.ReplayEvent would refuse row in a table of
// mode, so that its page shows no Replay button; "" when it may replay it:
// a dead or failed row, or in ordered mode any keyed row not published (a
// held row is retried, a relayed one delivered once more).
func whyNoReplay(mode schema.Mode, row runbook.Row) string {
	switch {
	case row.PublishedAt != nil:
		return "Published: replay only re-delivers dead or failed rows."
	case row.Skipped:
		return ""
	case mode == schema.ModeOrdered && row.OrderingKey != nil:
		return ""
	case row.DeadAt != nil || row.LastError != nil:
		return ""
	case row.Delivered:
		return "Delivered (the " + string(mode) + " relay records no delivery time): replay only re-delivers dead or failed rows."
	}
	return "Pending, and no attempt failed yet (a relay that retries in memory, as the WAL relay does, records none): the relay delivers it when it is due; replay only re-delivers dead or failed rows."
}

// identity is who a request is: its role, and its session when it came with
// the session cookie rather than the bearer token.
type identity struct {
	role role
	sess *session // nil for the bearer token and for anonymous requests
	sid  string
}

type identityKey struct{}

func identityOf(r *http.Request) identity {
	id, _ := r.Context().Value(identityKey{}).(identity)
	return id
}

// roleOf matches a presented secret against the tokens.
func (h *handler) roleOf(secret string) role {
	switch {
	case secret == "":
		return roleNone
	case h.cfg.Token != "" && equalSecret(secret, h.cfg.Token):
		if h.cfg.ReadOnly {
			return roleReader // a read-only console: the console token reads
		}
		return roleAdmin
	case h.cfg.ReadToken != "" && equalSecret(secret, h.cfg.ReadToken):
		return roleReader
	}
	return roleNone
}

// authenticate finds who r is. A bearer header is checked (and a wrong one
// counted as a failed login); otherwise the session cookie. It writes the
// refusal and returns false when r presented a wrong or rate-limited token.
func (h *handler) authenticate(w http.ResponseWriter, r *http.Request) (identity, bool) {
	if !h.authEnabled() {
		return identity{}, true
	}
	if tok, present := bearer(r); present {
		ip := h.clientIP(r)
		if d := h.limiter.wait(ip, h.now()); d > 0 {
			w.Header().Set("Retry-After", retryAfter(d))
			http.Error(w, "too many failed logins from your address: wait "+retryAfter(d)+" s", http.StatusTooManyRequests)
			return identity{}, false
		}
		ro := h.roleOf(tok)
		if ro == roleNone {
			h.limiter.fail(ip, h.now())
			h.logger.Info("Console bearer token refused", watermill.LogFields{"remote": r.RemoteAddr})
			http.Error(w, "wrong token in the Authorization header", http.StatusUnauthorized)
			return identity{}, false
		}
		h.limiter.ok(ip)
		return identity{role: ro}, true
	}
	if c, err := r.Cookie(sessionCookie); err == nil {
		if s := h.sessions.get(c.Value, h.now()); s != nil {
			return identity{role: s.role, sess: s, sid: c.Value}, true
		}
	}
	return identity{}, true
}

// authEnabled reports whether the console has a token at all.
func (h *handler) authEnabled() bool { return h.cfg.Token != "" || h.cfg.ReadToken != "" }

// readsOpen reports whether anyone may read without a token.
func (h *handler) readsOpen() bool { return !h.authEnabled() || h.cfg.PublicRead }

// sameOrigin refuses cross-site requests. Browsers send Sec-Fetch-Site:
// only same-origin (or none: typed by the user) passes. Without it (an older
// browser, or a script with the bearer token), an Origin header must name
// this host; "null" (an opaque origin) is refused.
func sameOrigin(r *http.Request) bool {
	if site := r.Header.Get("Sec-Fetch-Site"); site != "" {
		return site == "same-origin" || site == "none"
	}
	if o := r.Header.Get("Origin"); o != "" {
		u, err := url.Parse(o)
		return err == nil && u.Host == r.Host
	}
	return true
}

// allow checks a state-changing request; it writes the refusal and returns
// false when the request may not change anything. The bearer token needs
// no CSRF token (a browser never sends it by itself); a session needs its
// own CSRF token.
func (h *handler) allow(w http.ResponseWriter, r *http.Request) bool {
	id := identityOf(r)
	switch {
	case h.cfg.Token == "":
		h.fail(w, r, http.StatusForbidden, "read-only console: set OUTBOX_CONSOLE_TOKEN (console.Config.Token) to allow actions", "", "")
	case h.cfg.ReadOnly:
		h.fail(w, r, http.StatusForbidden, "read-only console (OUTBOX_CONSOLE_READ_ONLY, console.Config.ReadOnly): no action is allowed", "", "")
	case !sameOrigin(r):
		h.fail(w, r, http.StatusForbidden, "cross-origin request refused", "", "")
	case id.role == roleReader:
		h.fail(w, r, http.StatusForbidden, "the read-only token cannot change anything: log in with the console token", "", "")
	case id.role != roleAdmin:
		h.fail(w, r, http.StatusUnauthorized, "log in with the console token first", "", "")
	case id.sess != nil && !equalSecret(r.PostFormValue("csrf"), id.sess.csrf):
		h.fail(w, r, http.StatusForbidden, "missing or wrong CSRF token: reload the page and try again", "", "")
	default:
		return true
	}
	return false
}

func (h *handler) login(w http.ResponseWriter, r *http.Request) {
	if !h.authEnabled() {
		h.fail(w, r, http.StatusForbidden, "read-only console: there is nothing to log in to", "", "")
		return
	}
	if !sameOrigin(r) {
		h.fail(w, r, http.StatusForbidden, "cross-origin request refused", "", "")
		return
	}
	ip := h.clientIP(r)
	if d := h.limiter.wait(ip, h.now()); d > 0 {
		w.Header().Set("Retry-After", retryAfter(d))
		h.fail(w, r, http.StatusTooManyRequests, "too many failed logins from your address: wait "+retryAfter(d)+" s and try again", "", "")
		return
	}
	ro := h.roleOf(r.PostFormValue("token"))
	if ro == roleNone {
		h.limiter.fail(ip, h.now())
		h.logger.Info("Console login refused", watermill.LogFields{"remote": r.RemoteAddr})
		h.fail(w, r, http.StatusUnauthorized, "wrong token", "", "")
		return
	}
	h.limiter.ok(ip)
	if c, err := r.Cookie(sessionCookie); err == nil {
		h.sessions.end(c.Value) // a login never reuses a session id
	}
	sid, _ := h.sessions.create(ro, h.now())
	//nolint:gosec // Secure follows the connection (TLS, or a trusted proxy's X-Forwarded-Proto): the console listens on plain HTTP on loopback by default
	http.SetCookie(w, &http.Cookie{Name: sessionCookie, Value: sid, Path: "/", HttpOnly: true,
		SameSite: http.SameSiteStrictMode, Secure: h.secure(r), MaxAge: int(h.cfg.SessionTTL / time.Second)})
	who := "token holder"
	if ro == roleReader {
		who = "read-only token holder"
	}
	h.logger.Info("Console login", watermill.LogFields{"remote": r.RemoteAddr, "who": who})
	http.Redirect(w, r, localPath(r.PostFormValue("back")), http.StatusSeeOther) //nolint:gosec // localPath keeps only a path of this console

}

// logout ends the session of the cookie and clears the cookie.
func (h *handler) logout(w http.ResponseWriter, r *http.Request) {
	if !sameOrigin(r) {
		h.fail(w, r, http.StatusForbidden, "cross-origin request refused", "", "")
		return
	}
	if c, err := r.Cookie(sessionCookie); err == nil {
		if s := h.sessions.get(c.Value, h.now()); s != nil {
			if !equalSecret(r.PostFormValue("csrf"), s.csrf) {
				h.fail(w, r, http.StatusForbidden, "missing or wrong CSRF token: reload the page and try again", "", "")
				return
			}
			h.sessions.end(c.Value)
			h.logger.Info("Console logout", watermill.LogFields{"remote": r.RemoteAddr})
		}
	}
	//nolint:gosec // clears the cookie; Secure follows the connection as at login
	http.SetCookie(w, &http.Cookie{Name: sessionCookie, Value: "", Path: "/", HttpOnly: true,
		SameSite: http.SameSiteStrictMode, Secure: h.secure(r), MaxAge: -1})
	http.Redirect(w, r, "/", http.StatusSeeOther)
}

func (h *handler) replay(w http.ResponseWriter, r *http.Request) {
	t, id, fields, ok := h.eventAction(w, r, "replay")
	if !ok {
		return
	}
	res, err := runbook.New(h.pool, t).ReplayEvent(r.Context(), id, runbook.ReplayOptions{})
	if err != nil {
		h.logger.Info("Console replay refused", fields)
		h.fail(w, r, http.StatusConflict, "not replayed: "+err.Error(), tablePath(t, "event/"+id.String()), "the event")
		return
	}
	fields["changed"] = res.Changed
	h.logger.Info("Console replay", fields)
	http.Redirect(w, r, "/t/"+url.PathEscape(t.String())+"/event/"+id.String()+"?done=replayed", http.StatusSeeOther) //nolint:gosec // a configured table and a parsed UUID
}

// truncate cuts s to at most n bytes, on a rune boundary.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

// plural writes n and the noun, in the plural unless n is 1: "1 row",
// "2 rows".
func plural(n any, one, many string) string {
	s := fmt.Sprint(n)
	if s == "1" {
		return s + " " + one
	}
	return s + " " + many
}

// when renders a time the one way the console shows times: how long ago
// (or in how long) relative to now, "3m 12s ago", "in 40s", which the
// script keeps current, with the exact time, UTC to the second, in its
// title (and datetime). A nil or zero time is "-".
func when(v any, now time.Time) template.HTML {
	var t time.Time
	switch x := v.(type) {
	case time.Time:
		t = x
	case *time.Time:
		if x != nil {
			t = *x
		}
	}
	if t.IsZero() {
		return "-"
	}
	u := t.UTC()
	//nolint:gosec // an RFC 3339 time and a duration: no user text
	return template.HTML(`<time datetime="` + u.Format(time.RFC3339) + `" title="` + u.Format(exactLayout) + `" data-rel>` + relative(now.Sub(t)) + `</time>`)
}

// exactLayout is how the title of a time shows it exactly.
const exactLayout = "2006-01-02 15:04:05 UTC"

// relative writes an age d as "3m 12s ago" ("in 3m 12s" when negative),
// in its two largest units, leaving out a zero second one: 45s, 3m, 3m
// 12s, 2h 5m, 4d 1h.
func relative(d time.Duration) string {
	future := d < 0
	if future {
		d = -d
	}
	out := span(int64(d.Round(time.Second) / time.Second))
	if future {
		return "in " + out
	}
	return out + " ago"
}

// span writes s seconds in their two largest units: 45s, 3m 12s, 2h 5m,
// 4d 1h (a zero second unit left out).
func span(s int64) string {
	units := []struct {
		n    int64
		name string
	}{{86400, "d"}, {3600, "h"}, {60, "m"}, {1, "s"}}
	for i, u := range units {
		if s < u.n && u.n > 1 {
			continue
		}
		out := strconv.FormatInt(s/u.n, 10) + u.name
		if i+1 < len(units) {
			next := units[i+1]
			if rest := s % u.n / next.n; rest > 0 {
				out += " " + strconv.FormatInt(rest, 10) + next.name
			}
		}
		return out
	}
	return "0s"
}

// duration writes an age in seconds readably: "2.5s" under 10 seconds,
// else as span does: "45s", "3m 12s", "2h 5m", "4d 1h".
func duration(seconds float64) string {
	if tenths := math.Round(seconds * 10); tenths < 100 {
		return strconv.FormatFloat(tenths/10, 'f', 1, 64) + "s"
	}
	return span(int64(math.Round(seconds)))
}

// ranges writes sorted partition numbers as ranges: "0–5, 9, 12–13".
func ranges(ps []int32) string {
	var b strings.Builder
	for i := 0; i < len(ps); {
		j := i
		for j+1 < len(ps) && ps[j+1] == ps[j]+1 {
			j++
		}
		if b.Len() > 0 {
			b.WriteString(", ")
		}
		b.WriteString(strconv.Itoa(int(ps[i])))
		if j > i {
			b.WriteString("–" + strconv.Itoa(int(ps[j])))
		}
		i = j + 1
	}
	return b.String()
}

// shorten cuts s to at most n bytes on a rune boundary, marking the cut.
func shorten(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return truncate(s, n) + "…"
}
