// Package console is a web page over the outbox tables: an overview of every
// table (counts, delivery rate, active relay, held keys), the dead rows
// grouped by cause, the held keys of ordered mode, the backlog by topic and
// one event; and the actions replay one event, skip a held key's row and
// replay dead rows in bulk (preview, confirm the exact count, follow the
// progress). It sits on package runbook, so its rules are the CLI's.
//
// Mount the handler on your own mux, behind your own authentication:
//
//	h, err := console.New(pool, console.Config{Tables: tables, Token: token})
//	mux.Handle("/outbox/", http.StripPrefix("/outbox", h))
//
// Without Config.Token the console is read-only. With it, a state-changing
// request (POST only) needs the token (an Authorization: Bearer header, or
// the session cookie that POST /login sets), a CSRF token and the same
// origin; anything else is refused and changes nothing.
package console

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

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
	// Token, when set, lets its holder change state (replay); without it
	// the console is read-only.
	Token string
	// Logger records every action (who, what); defaults to a no-op logger.
	Logger watermill.LoggerAdapter
}

// sessionCookie is the cookie POST /login sets: an HMAC of the token, never
// the token itself.
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

	jobsMu sync.Mutex
	jobs   map[string]*job // bulk replays, by id
	order  []string        // job ids, oldest first
}

// maxJobs bounds the bulk replays whose progress the console remembers.
const maxJobs = 50

// New returns the console's handler over pool.
func New(pool *pgxpool.Pool, cfg Config) (http.Handler, error) {
	if pool == nil {
		return nil, errors.New("console: nil pool")
	}
	if len(cfg.Tables) == 0 {
		return nil, errors.New("console: invalid config: no tables; set Config.Tables (OUTBOX_CONSOLE_TABLES)")
	}
	h := &handler{pool: pool, cfg: cfg, tables: map[string]schema.Table{}, logger: cfg.Logger, jobs: map[string]*job{}}
	if h.logger == nil {
		h.logger = watermill.NopLogger{}
	}
	for _, t := range cfg.Tables {
		if t.IsZero() {
			return nil, errors.New("console: invalid config: a zero table; build tables with schema.ParseTable")
		}
		h.tables[t.String()] = t
		h.names = append(h.names, t.String())
	}
	sort.Strings(h.names)
	tmpl, err := template.New("").Funcs(template.FuncMap{
		"ago": func(t *time.Time) string {
			if t == nil {
				return "-"
			}
			return time.Since(*t).Round(time.Second).String() + " ago"
		},
		"ts": func(t *time.Time) string {
			if t == nil {
				return "-"
			}
			return t.UTC().Format(time.RFC3339)
		},
		"perSecond": func(perMinute int64) string { return strconv.FormatFloat(float64(perMinute)/60, 'f', 1, 64) },
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
	mux.HandleFunc("GET /t/{table}/topics", h.topics)
	mux.HandleFunc("GET /t/{table}/event/{id}", h.event)
	mux.HandleFunc("GET /t/{table}/replay", h.preview)
	mux.HandleFunc("GET /t/{table}/replay/{job}", h.jobPage)
	mux.HandleFunc("GET /api/counts", h.counts)
	mux.HandleFunc("GET /api/replay/{job}", h.jobProgress)
	mux.HandleFunc("POST /login", h.login)
	mux.HandleFunc("POST /t/{table}/event/{id}/replay", h.replay)
	mux.HandleFunc("POST /t/{table}/event/{id}/skip", h.skip)
	mux.HandleFunc("POST /t/{table}/replay", h.bulkReplay)
	h.mux = mux
	return h, nil
}

// ServeHTTP sets the security headers and routes.
func (h *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	hd := w.Header()
	hd.Set("Content-Security-Policy", contentSecurityPolicy)
	hd.Set("X-Content-Type-Options", "nosniff")
	hd.Set("Referrer-Policy", "no-referrer")
	hd.Set("X-Frame-Options", "DENY")
	hd.Set("Cache-Control", "no-store")
	h.mux.ServeHTTP(w, r)
}

func (h *handler) table(w http.ResponseWriter, r *http.Request) (schema.Table, bool) {
	t, ok := h.tables[r.PathValue("table")]
	if !ok {
		http.Error(w, "unknown table: the console shows only its configured tables", http.StatusNotFound)
	}
	return t, ok
}

// page is what every template gets.
type page struct {
	Title    string
	ReadOnly bool
	LoggedIn bool
	CSRF     string
	Data     any
}

func (h *handler) render(w http.ResponseWriter, r *http.Request, name, title string, data any) {
	p := page{Title: title, ReadOnly: h.cfg.Token == "", LoggedIn: h.authorized(r), Data: data}
	if p.LoggedIn {
		p.CSRF = h.csrf()
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	if err := h.tmpl.ExecuteTemplate(w, name, p); err != nil {
		h.logger.Error("Console page failed", err, watermill.LogFields{"page": name})
	}
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
	OrderedRelays int    `json:"ordered_relays"`
	Err           string `json:"-"`
}

// maxHeldShown bounds the held keys the console lists and counts.
const maxHeldShown = 1000

func (h *handler) stats(ctx context.Context) []tableView {
	out := make([]tableView, 0, len(h.names))
	for _, n := range h.names {
		t := h.tables[n]
		st, err := runbook.Stats(ctx, h.pool, t)
		v := tableView{Name: n, Stats: st}
		var held []runbook.HeldKey
		if err == nil {
			held, err = runbook.HeldKeys(ctx, h.pool, t, maxHeldShown)
			v.Held = len(held)
		}
		if err == nil {
			v.Leader, err = runbook.Leader(ctx, h.pool, t)
		}
		if err == nil {
			v.OrderedRelays, err = runbook.OrderedRelays(ctx, h.pool, t)
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
	h.render(w, r, "overview.html", "Outbox", h.stats(r.Context()))
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

// maxDeadShown bounds the dead rows one page lists.
const maxDeadShown = 1000

// cause is one group of dead rows: those whose last_error starts alike.
type cause struct {
	Head        string
	Count       int
	First, Last *time.Time
	Rows        []runbook.Row
}

// causeHead is the head of a last_error that groups dead rows.
func causeHead(s *string) string {
	if s == nil || *s == "" {
		return "(no error recorded)"
	}
	head := *s
	if i := strings.IndexAny(head, "\n:"); i > 0 {
		head = head[:i]
	}
	if len(head) > 80 {
		head = head[:80]
	}
	return head
}

func (h *handler) dead(w http.ResponseWriter, r *http.Request) {
	t, ok := h.table(w, r)
	if !ok {
		return
	}
	q := r.URL.Query()
	rows, err := runbook.Dead(r.Context(), h.pool, t, runbook.DeadFilter{Topic: q.Get("topic"), ErrorContains: q.Get("error"), Limit: maxDeadShown})
	if err != nil {
		h.logger.Error("Console could not list dead rows", err, watermill.LogFields{"table": t.String()})
		http.Error(w, "cannot list the dead rows (see the console's log)", http.StatusInternalServerError)
		return
	}
	groups := map[string]*cause{}
	for _, row := range rows {
		head := causeHead(row.LastError)
		g := groups[head]
		if g == nil {
			g = &cause{Head: head}
			groups[head] = g
		}
		g.Count++
		if d := row.DeadAt; d != nil {
			if g.First == nil || d.Before(*g.First) {
				g.First = d
			}
			if g.Last == nil || d.After(*g.Last) {
				g.Last = d
			}
		}
		g.Rows = append(g.Rows, row)
	}
	list := make([]*cause, 0, len(groups))
	for _, g := range groups {
		list = append(list, g)
	}
	sort.Slice(list, func(i, j int) bool {
		return list[i].Count > list[j].Count || (list[i].Count == list[j].Count && list[i].Head < list[j].Head)
	})
	h.render(w, r, "dead.html", "Dead rows of "+t.String(), struct {
		Table        string
		Total        int
		Capped       bool
		Topic, Error string
		Causes       []*cause
	}{t.String(), len(rows), len(rows) == maxDeadShown, q.Get("topic"), q.Get("error"), list})
}

func (h *handler) event(w http.ResponseWriter, r *http.Request) {
	t, ok := h.table(w, r)
	if !ok {
		return
	}
	id, err := uuid.Parse(r.PathValue("id"))
	if err != nil {
		http.Error(w, "the event id must be a UUID", http.StatusBadRequest)
		return
	}
	row, err := runbook.Event(r.Context(), h.pool, t, id)
	if errors.Is(err, runbook.ErrEventNotFound) {
		http.Error(w, "no such event in this table", http.StatusNotFound)
		return
	}
	if err != nil {
		h.logger.Error("Console could not read an event", err, watermill.LogFields{"table": t.String()})
		http.Error(w, "cannot read the event (see the console's log)", http.StatusInternalServerError)
		return
	}
	var payload string
	if r.URL.Query().Get("payload") == "1" {
		if err := h.pool.QueryRow(r.Context(), `SELECT payload::text FROM `+t.Sanitize()+` WHERE event_id = $1`, id).Scan(&payload); err != nil {
			payload = "(cannot read the payload)"
		}
	}
	h.render(w, r, "event.html", "Event "+id.String(), struct {
		Table   string
		Row     runbook.Row
		Payload string
		Flash   string
	}{t.String(), row, payload, r.URL.Query().Get("done")})
}

// mac is an HMAC of what with the token as key.
func (h *handler) mac(what string) string {
	m := hmac.New(sha256.New, []byte(h.cfg.Token))
	m.Write([]byte(what))
	return hex.EncodeToString(m.Sum(nil))
}

func (h *handler) csrf() string { return h.mac("csrf") }

// authorized reports whether r carries the token (header) or the session
// cookie.
func (h *handler) authorized(r *http.Request) bool {
	if h.cfg.Token == "" {
		return false
	}
	if a := r.Header.Get("Authorization"); strings.HasPrefix(a, "Bearer ") {
		return subtle.ConstantTimeCompare([]byte(strings.TrimPrefix(a, "Bearer ")), []byte(h.cfg.Token)) == 1
	}
	c, err := r.Cookie(sessionCookie)
	return err == nil && subtle.ConstantTimeCompare([]byte(c.Value), []byte(h.mac("session"))) == 1
}

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
// false when the request may not change anything.
func (h *handler) allow(w http.ResponseWriter, r *http.Request) bool {
	switch {
	case h.cfg.Token == "":
		http.Error(w, "read-only console: set OUTBOX_CONSOLE_TOKEN (console.Config.Token) to allow actions", http.StatusForbidden)
	case !sameOrigin(r):
		http.Error(w, "cross-origin request refused", http.StatusForbidden)
	case !h.authorized(r):
		http.Error(w, "log in with the console token first", http.StatusUnauthorized)
	case subtle.ConstantTimeCompare([]byte(r.PostFormValue("csrf")), []byte(h.csrf())) != 1:
		http.Error(w, "missing or wrong CSRF token: reload the page and try again", http.StatusForbidden)
	default:
		return true
	}
	return false
}

func (h *handler) login(w http.ResponseWriter, r *http.Request) {
	if h.cfg.Token == "" {
		http.Error(w, "read-only console: there is nothing to log in to", http.StatusForbidden)
		return
	}
	if !sameOrigin(r) {
		http.Error(w, "cross-origin request refused", http.StatusForbidden)
		return
	}
	if subtle.ConstantTimeCompare([]byte(r.PostFormValue("token")), []byte(h.cfg.Token)) != 1 {
		h.logger.Info("Console login refused", watermill.LogFields{"remote": r.RemoteAddr})
		http.Error(w, "wrong token", http.StatusUnauthorized)
		return
	}
	//nolint:gosec // Secure follows the connection: the console listens on plain HTTP on localhost by default
	http.SetCookie(w, &http.Cookie{Name: sessionCookie, Value: h.mac("session"), Path: "/", HttpOnly: true,
		SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil})
	h.logger.Info("Console login", watermill.LogFields{"remote": r.RemoteAddr})
	back := r.PostFormValue("back")
	if !strings.HasPrefix(back, "/") || strings.HasPrefix(back, "//") || strings.HasPrefix(back, "/\\") {
		back = "/" // only a path of this console, never another host
	}
	http.Redirect(w, r, back, http.StatusSeeOther) //nolint:gosec // back is a local path, checked above
}

func (h *handler) replay(w http.ResponseWriter, r *http.Request) {
	t, id, fields, ok := h.eventAction(w, r, "replay")
	if !ok {
		return
	}
	res, err := runbook.ReplayEvent(r.Context(), h.pool, t, id, runbook.ReplayOptions{})
	if err != nil {
		h.logger.Info("Console replay refused", fields)
		http.Error(w, "not replayed: "+err.Error(), http.StatusConflict)
		return
	}
	fields["changed"] = res.Changed
	h.logger.Info("Console replay", fields)
	http.Redirect(w, r, "/t/"+url.PathEscape(t.String())+"/event/"+id.String()+"?done=replayed", http.StatusSeeOther) //nolint:gosec // a configured table and a parsed UUID
}
