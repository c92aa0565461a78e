package console

import (
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"net"
	"net/http"
	"net/url"
	"path"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode"
	"unicode/utf8"
)

// role is what a request may do.
type role int

const (
	roleNone   role = iota // nothing but the health and the login page
	roleReader             // read every page, change nothing
	roleAdmin              // read and act
)

// session is one login: a random id (the cookie), its role, its own CSRF
// token and its end. Sessions live in the console's memory: a restart logs
// everyone out.
type session struct {
	role    role
	csrf    string
	expires time.Time
}

// sessions is the server-side store of the logins, keyed by the SHA-256 of
// the cookie value so that the map never holds a usable session id.
type sessions struct {
	mu  sync.Mutex
	ttl time.Duration
	m   map[[32]byte]*session
}

// maxSessions bounds the logins the console remembers; the oldest goes
// first.
const maxSessions = 10000

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b) // crypto/rand.Read never fails (Go 1.24+: it crashes the program instead)
	return hex.EncodeToString(b)
}

// create starts a session of role r and returns its id and CSRF token.
func (s *sessions) create(r role, now time.Time) (id string, sess *session) {
	id = randomHex(32)
	sess = &session{role: r, csrf: randomHex(32), expires: now.Add(s.ttl)}
	s.mu.Lock()
	defer s.mu.Unlock()
	for k, v := range s.m {
		if !now.Before(v.expires) {
			delete(s.m, k)
		}
	}
	if len(s.m) >= maxSessions {
		var (
			oldest [32]byte
			when   time.Time
		)
		for k, v := range s.m {
			if when.IsZero() || v.expires.Before(when) {
				oldest, when = k, v.expires
			}
		}
		delete(s.m, oldest)
	}
	s.m[sha256.Sum256([]byte(id))] = sess
	return id, sess
}

// get returns the live session of id, or nil.
func (s *sessions) get(id string, now time.Time) *session {
	if id == "" {
		return nil
	}
	k := sha256.Sum256([]byte(id))
	s.mu.Lock()
	defer s.mu.Unlock()
	sess := s.m[k]
	if sess == nil {
		return nil
	}
	if !now.Before(sess.expires) {
		delete(s.m, k)
		return nil
	}
	return sess
}

// end forgets the session of id.
func (s *sessions) end(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.m, sha256.Sum256([]byte(id)))
}

// limiter slows down failed logins per client address: the first
// loginFreeFailures failures cost nothing, each one after locks the address
// out of every authentication (login form and bearer token) for a delay that
// doubles, from loginBaseDelay up to loginMaxDelay. A success clears the
// address.
type limiter struct {
	mu sync.Mutex
	m  map[string]*failures
}

type failures struct {
	n     int
	until time.Time // locked out before this
	last  time.Time
}

const (
	loginFreeFailures = 3
	loginBaseDelay    = time.Second
	loginMaxDelay     = 5 * time.Minute
	maxLimited        = 10000 // client addresses the limiter remembers
)

// wait returns how long ip must still wait before trying again, 0 when it
// may try now.
func (l *limiter) wait(ip string, now time.Time) time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	f := l.m[ip]
	if f == nil || !now.Before(f.until) {
		return 0
	}
	return f.until.Sub(now)
}

// fail records a failed attempt of ip.
func (l *limiter) fail(ip string, now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	f := l.m[ip]
	if f == nil {
		if len(l.m) >= maxLimited {
			for k, v := range l.m {
				if now.Sub(v.last) > loginMaxDelay && !now.Before(v.until) {
					delete(l.m, k)
				}
			}
		}
		if len(l.m) >= maxLimited {
			// Every remembered address failed recently: make room with
			// the oldest rather than forget a new one.
			var oldest string
			var when time.Time
			for k, v := range l.m {
				if when.IsZero() || v.last.Before(when) {
					oldest, when = k, v.last
				}
			}
			delete(l.m, oldest)
		}
		f = &failures{}
		l.m[ip] = f
	}
	f.n++
	f.last = now
	if over := f.n - loginFreeFailures; over > 0 {
		d := loginMaxDelay
		if over < 20 {
			d = min(loginBaseDelay<<(over-1), loginMaxDelay)
		}
		f.until = now.Add(d)
	}
}

// ok clears ip after a successful authentication.
func (l *limiter) ok(ip string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.m, ip)
}

// equalSecret compares two secrets in constant time, their lengths
// included.
func equalSecret(a, b string) bool {
	ha, hb := sha256.Sum256([]byte(a)), sha256.Sum256([]byte(b))
	return subtle.ConstantTimeCompare(ha[:], hb[:]) == 1
}

// bearer returns the credentials of an "Authorization: Bearer <token>"
// header (the scheme in any case) and whether the header is there at all.
func bearer(r *http.Request) (token string, present bool) {
	a := r.Header.Get("Authorization")
	if a == "" {
		return "", false
	}
	scheme, cred, _ := strings.Cut(strings.TrimSpace(a), " ")
	if !strings.EqualFold(scheme, "bearer") {
		return "", true
	}
	return strings.TrimSpace(cred), true
}

// clientIP is the address failed logins are counted against: the peer, or
// with TrustProxy the last address the proxy appended to X-Forwarded-For.
func (h *handler) clientIP(r *http.Request) string {
	if h.cfg.TrustProxy {
		if xff := r.Header.Values("X-Forwarded-For"); len(xff) > 0 {
			last := xff[len(xff)-1]
			if i := strings.LastIndexByte(last, ','); i >= 0 {
				last = last[i+1:]
			}
			if ip := net.ParseIP(strings.TrimSpace(last)); ip != nil {
				return ip.String()
			}
		}
	}
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return r.RemoteAddr
	}
	return host
}

// secure reports whether the client reached the console over TLS: directly,
// or through a trusted proxy that says so in X-Forwarded-Proto.
func (h *handler) secure(r *http.Request) bool {
	if r.TLS != nil {
		return true
	}
	return h.cfg.TrustProxy && strings.EqualFold(strings.TrimSpace(r.Header.Get("X-Forwarded-Proto")), "https")
}

// hostAllowed reports whether the Host header names this console, so that
// a page of another site whose name resolves to the console's address (DNS
// rebinding) gets nothing. Allowed: the names of Config.AllowedHosts; the
// host of Config.Addr; loopback names and addresses when Addr is a loopback
// or unspecified address; any IP address when Addr is unspecified (a
// rebinding page cannot make the browser send an IP literal as Host). The
// port is not compared. With neither Addr nor AllowedHosts the Host is not
// checked (the console mounted on a mux of its owner).
func (h *handler) hostAllowed(r *http.Request) bool {
	if h.cfg.Addr == "" && len(h.cfg.AllowedHosts) == 0 {
		return true
	}
	host := strings.ToLower(r.Host)
	if hh, _, err := net.SplitHostPort(host); err == nil {
		host = hh
	}
	host = strings.TrimSuffix(strings.TrimSuffix(strings.TrimPrefix(host, "["), "]"), ".")
	if host == "" {
		return false
	}
	for _, a := range h.cfg.AllowedHosts {
		if strings.TrimSuffix(strings.ToLower(a), ".") == host {
			return true
		}
	}
	if h.cfg.Addr == "" {
		return false
	}
	bind, _, err := net.SplitHostPort(h.cfg.Addr)
	if err != nil {
		bind = h.cfg.Addr
	}
	bind = strings.ToLower(strings.Trim(bind, "[]"))
	bindIP := net.ParseIP(bind)
	unspecified := bind == "" || (bindIP != nil && bindIP.IsUnspecified())
	loopback := bind == "localhost" || (bindIP != nil && bindIP.IsLoopback())
	if host == bind && !unspecified {
		return true
	}
	ip := net.ParseIP(host)
	if (loopback || unspecified) && (host == "localhost" || (ip != nil && ip.IsLoopback())) {
		return true
	}
	if bindIP != nil && ip != nil && ip.Equal(bindIP) {
		return true
	}
	return unspecified && ip != nil
}

// localPath returns back as a path of this console, or "/" when it is not
// one: only a path that starts with one "/" (not "//", not "/\"), without
// control characters, backslashes, scheme or host; dot segments are
// resolved.
func localPath(back string) string {
	if back == "" || len(back) > 2048 || !utf8.ValidString(back) || strings.ContainsRune(back, '\\') {
		return "/"
	}
	for _, c := range back {
		if unicode.IsControl(c) || unicode.IsSpace(c) && c != ' ' {
			return "/"
		}
	}
	if !strings.HasPrefix(back, "/") || strings.HasPrefix(back, "//") {
		return "/"
	}
	u, err := url.Parse(back)
	if err != nil || u.Scheme != "" || u.Host != "" || u.User != nil || u.Opaque != "" {
		return "/"
	}
	p := path.Clean(u.Path)
	if !strings.HasPrefix(p, "/") || strings.HasPrefix(p, "//") {
		return "/"
	}
	out := (&url.URL{Path: p, RawQuery: u.RawQuery}).String()
	if !strings.HasPrefix(out, "/") || strings.HasPrefix(out, "//") {
		return "/"
	}
	return out
}

// flashes are the only messages ?done= can show: a code, never text.
var flashes = map[string]string{
	"replayed":       "the event was replayed: it is pending again",
	"skip-requested": "skip requested: the relay skips the row and the key goes on",
	"skipped":        "the event was skipped: it is set aside, not dead, never delivered unless replayed",
	"logged-out":     "logged out",
	"paused":         "topic paused: the relays stop taking its rows at their next wake-up; rows in flight finish",
	"resumed":        "topic resumed: the relays take its rows again at their next wake-up",
}

// flash returns the message of a ?done= code, "" for any other value.
func flash(r *http.Request) string { return flashes[r.URL.Query().Get("done")] }

// retryAfter formats a wait as Retry-After seconds, at least 1.
func retryAfter(d time.Duration) string {
	s := int64((d + time.Second - 1) / time.Second)
	if s < 1 {
		s = 1
	}
	return strconv.FormatInt(s, 10)
}
