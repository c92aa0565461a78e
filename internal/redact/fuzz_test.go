package redact

import (
	"encoding/json"
	"strings"
	"testing"
	"unicode/utf8"
)

// secretForms are the secret forms the docs name (README, DESIGN 5,
// Summary's comment): a password in a URL, in a DSN (unquoted and quoted),
// key=value and key: value credentials, a JSON credential, a credential in
// a URL query, and bearer tokens. Each builds the text that carries secret
// in its own syntax, or reports that secret cannot be written in it.
var secretForms = []struct {
	name  string
	build func(secret string) (string, bool)
}{
	{"URL password", func(s string) (string, bool) {
		return "postgres://app:" + s + "@db:5432/x", !strings.ContainsAny(s, "/") && !hasSpace(s)
	}},
	{"DSN password", func(s string) (string, bool) {
		return "host=db password=" + s + " dbname=x", !hasSpace(s) && s[0] != '\'' && s[0] != '"'
	}},
	{"DSN quoted password", func(s string) (string, bool) {
		return "host=db password='" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(s) + "' dbname=x", true
	}},
	{"JSON credential", func(s string) (string, bool) {
		b, _ := json.Marshal(s)
		return `{"client_secret":` + string(b) + `,"x":1}`, true
	}},
	{"key: value", func(s string) (string, bool) {
		return "token: " + s, !hasSpace(s) && s[0] != '\'' && s[0] != '"'
	}},
	{"URL query", func(s string) (string, bool) {
		return "https://api.example/v1?x=1&api_key=" + s, !hasSpace(s) && s[0] != '\'' && s[0] != '"'
	}},
	{"bearer token", func(s string) (string, bool) {
		return "Authorization: Bearer " + s, strings.Trim(s, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~+/=") == ""
	}},
}

func hasSpace(s string) bool { return strings.IndexFunc(s, isSpace) >= 0 }

func isSpace(r rune) bool {
	return r == ' ' || r == '\t' || r == '\n' || r == '\r' || r == '\f' || r == '\v'
}

// FuzzRedaction asserts that for every secret form the docs name, no part
// of the secret (no 4-byte piece of it that the text around it does not
// hold) survives Summary, whatever the secret and the text around it.
// Its seed corpus holds the secrets issue 46 found surviving.
func FuzzRedaction(f *testing.F) {
	for i := range secretForms {
		for _, s := range []string{";Tr0ub4dor&3", "correct horse battery", "s3cr3t, really", "p@ss:w0rd", "&AbC123xyz", "my s3cret pw", `it's "quoted"\`, "hunter2"} {
			f.Add(uint8(i), s, "connect failed:", "(retrying)")
		}
	}
	f.Fuzz(func(t *testing.T, form uint8, secret, before, after string) {
		fm := secretForms[int(form)%len(secretForms)]
		if len(secret) > 512 || len(before)+len(after) > 1024 { // the check is quadratic in the secret
			return
		}
		if secret == "" || strings.Contains(secret, "*") || !utf8.ValidString(secret+before+after) ||
			strings.ContainsAny(before+after, `'"\@:=`) {
			return
		}
		carrier, ok := fm.build(secret)
		if !ok {
			return
		}
		text := before + " " + carrier + " " + after
		got := Summary(text, nil, 1<<20)
		// What the text holds besides the secret: a piece found there may
		// survive.
		template, _ := fm.build("\x01")
		context := before + " " + template + " " + after + "\x00***"
		pieces := []string{secret}
		if len(secret) > 4 {
			pieces = pieces[:0]
			for i := 0; i+4 <= len(secret); i++ {
				pieces = append(pieces, secret[i:i+4])
			}
		}
		for _, p := range pieces {
			if strings.Contains(got, p) && !strings.Contains(context, p) {
				t.Fatalf("%s: %q of the secret survives:\n text %q\n got  %q", fm.name, p, text, got)
			}
		}
	})
}
