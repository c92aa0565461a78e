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
