// Package redact turns an error into the summary that may be stored in
// last_error or logged: secrets removed, the payload cut out, the length
// bounded on a UTF-8 boundary.
package redact

import (
	"bytes"
	"regexp"
	"unicode/utf8"
)

// DefaultMaxBytes is the default bound on a summary (OUTBOX_LAST_ERROR_MAX_BYTES).
const DefaultMaxBytes = 2048

var secretPatterns = []struct {
	re   *regexp.Regexp
	repl string
}{
	// scheme://user:password@host -> scheme://user:***@host
	{regexp.MustCompile(`([a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s]*):[^@\s]*@`), `$1:***@`},
	// password=secret, pwd: secret, "password":"secret" (keyword/value forms)
	{regexp.MustCompile(`(?i)((?:password|passwd|pwd|secret|token|api[_-]?key|access[_-]?key)"?\s*[=:]\s*"?)[^\s"&,;]+`), `${1}***`},
	// Authorization: Bearer xxx / Basic xxx
	{regexp.MustCompile(`(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{8,}`), `$1 ***`},
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
	for _, p := range secretPatterns {
		text = p.re.ReplaceAllString(text, p.repl)
	}
	return Truncate(text, maxBytes)
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
