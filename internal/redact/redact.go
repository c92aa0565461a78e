// Package redact turns an error into the summary that may be stored in
// last_error or logged: secrets removed, the payload cut out, the length
// bounded on a UTF-8 boundary.
package redact

import (
	"bytes"
	"errors"
	"net/url"
	"regexp"
	"strings"
	"unicode/utf8"
)

// DefaultMaxBytes is the default bound on a summary (OUTBOX_LAST_ERROR_MAX_BYTES).
const DefaultMaxBytes = 2048

// Each secret's value ends where its syntax ends, never at the first odd
// character: a quoted value at its closing quote (or the end of the text),
// a URL's password at the last @ before the host, an unquoted value at the
// next white space.
var (
	// scheme://user:password@host -> scheme://user:***@host. The user
	// part stops at the first colon; the password runs to the last @
	// before white space or a slash (libpq and RFC 3986 allow neither
	// unescaped in it), so a password holding @ or : is cut whole.
	urlPassword = regexp.MustCompile(`([a-zA-Z][a-zA-Z0-9+.-]*://[^:/\s]*):[^\s/]*@`)
	// password=secret, pwd: secret, "password":"secret", password='a b',
	// ?api_key=secret&...: a keyword, an optional closing quote of a key,
	// = or :, then a value: double-quoted (JSON, with \ escapes),
	// single-quoted (libpq, with \ escapes), or unquoted up to white space.
	keyValue = regexp.MustCompile(`(?is)((?:password|passwd|pwd|secret|token|api[_-]?key|access[_-]?key)["']?\s*[=:]\s*)("(?:[^"\\]|\\.)*(?:"|\\?$)|'(?:[^'\\]|\\.)*(?:'|\\?$)|\S+)`)
	// Authorization: Bearer xxx / Basic xxx
	authScheme = regexp.MustCompile(`(?i)\b(bearer|basic)(\s+)[A-Za-z0-9._~+/=-]{8,}`)
	bearer     = regexp.MustCompile(`(?i)\b(bearer)(\s+)[A-Za-z0-9._~+/=-]+`)
)

// redactSecrets replaces every secret of text by ***, keeping the quotes
// of a quoted value.
func redactSecrets(text string) string {
	text = urlPassword.ReplaceAllString(text, `$1:***@`)
	text = keyValue.ReplaceAllStringFunc(text, func(m string) string {
		sub := keyValue.FindStringSubmatch(m)
		v := sub[2]
		if q := v[0]; q == '"' || q == '\'' {
			return sub[1] + string(q) + "***" + string(q)
		}
		return sub[1] + "***"
	})
	text = bearer.ReplaceAllString(text, `$1$2***`)
	return authScheme.ReplaceAllString(text, `$1$2***`)
}

// Summary returns text with obvious secrets (passwords in URLs and DSNs,
// key=value credentials, bearer tokens) replaced by ***, every occurrence
// of payload (when it is at least 8 bytes) replaced by [payload], and the
// result truncated to maxBytes (DefaultMaxBytes when <= 0) on a UTF-8
// boundary.
func Summary(text string, payload []byte, maxBytes int) string {
	if maxBytes <= 0 {
		maxBytes = DefaultMaxBytes
	}
	if len(payload) >= 8 && len(text) >= len(payload) {
		text = string(bytes.ReplaceAll([]byte(text), payload, []byte("[payload]")))
	}
	return Truncate(redactSecrets(text), maxBytes)
}

// Truncate cuts s to at most maxBytes bytes without splitting a UTF-8
// sequence; invalid UTF-8 is replaced first so the result is always valid.
func Truncate(s string, maxBytes int) string {
	if !utf8.ValidString(s) {
		s = string(bytes.ToValidUTF8([]byte(s), []byte("\uFFFD")))
	}
	if len(s) <= maxBytes {
		return s
	}
	cut := maxBytes
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut]
}

// URL returns raw with the password of its userinfo replaced by ***. The
// password is found by hand, not by url.Parse, so that a URL that does not
// parse (a bad port, a bad escape, an unclosed [) is redacted too: the
// userinfo runs from the scheme's // to the last @ of the authority (the
// text up to the first /, ? or #, or, when that holds no @, up to the last
// @ of raw: a password holding an unescaped / or #), and the password from
// its first colon. A URL without a password is returned as is.
func URL(raw string) string {
	start, end := urlPasswordSpan(raw)
	if start == end {
		return raw
	}
	return raw[:start] + "***" + raw[end:]
}

// WithoutURLPassword returns text with every occurrence of the password of
// the URL raw (as written, and percent-decoded) replaced by ***, and every
// double-quoted fragment that shares a piece with the password (url.Parse
// quotes a bad escape alone, or the port it took from a password holding a
// slash) by "***", then the obvious secrets Summary removes: for an error
// about raw, whose text may quote raw whole (url.Parse's errors do).
func WithoutURLPassword(text, raw string) string {
	start, end := urlPasswordSpan(raw)
	if start < end {
		pw := raw[start:end]
		text = strings.ReplaceAll(text, pw, "***")
		if dec, err := url.PathUnescape(pw); err == nil && dec != "" && dec != pw {
			text = strings.ReplaceAll(text, dec, "***")
		}
		text = quoted.ReplaceAllStringFunc(text, func(q string) string {
			if shares(q[1:len(q)-1], pw) {
				return `"***"`
			}
			return q
		})
	}
	return redactSecrets(text)
}

// URLProblem says what is wrong with raw, a URL that does not parse (err,
// from url.Parse or a parser built on it), without quoting raw (url.Parse's
// message quotes it whole) or any part of its password.
func URLProblem(raw string, err error) string {
	var ue *url.Error
	if errors.As(err, &ue) {
		err = ue.Err
	}
	return WithoutURLPassword(err.Error(), raw)
}

// quoted is a double-quoted fragment of an error message.
var quoted = regexp.MustCompile(`"[^"]*"`)

// urlPasswordSpan returns where the password of raw's userinfo starts and
// ends (start == end when there is none); see URL.
func urlPasswordSpan(raw string) (start, end int) {
	i := strings.Index(raw, "://")
	if i < 0 {
		return 0, 0
	}
	rest := raw[i+3:]
	auth := rest
	if j := strings.IndexAny(rest, "/?#"); j >= 0 {
		auth = rest[:j]
	}
	at := strings.LastIndexByte(auth, '@')
	if at < 0 {
		at = strings.LastIndexByte(rest, '@')
	}
	if at < 0 {
		return 0, 0
	}
	colon := strings.IndexByte(rest[:at], ':')
	if colon < 0 {
		return 0, 0
	}
	return i + 3 + colon + 1, i + 3 + at
}

// shares reports whether fragment and pw have a piece in common: a
// substring of 4 bytes (or the whole of a shorter pw or fragment).
func shares(fragment, pw string) bool {
	k := min(4, len(pw), len(fragment))
	if k == 0 {
		return false
	}
	for i := 0; i+k <= len(fragment); i++ {
		if strings.Contains(pw, fragment[i:i+k]) {
			return true
		}
	}
	return false
}
