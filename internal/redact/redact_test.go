package redact

import (
	"net/url"
	"strings"
	"testing"
	"unicode/utf8"
)

func TestSummary(t *testing.T) {
	t.Parallel()
	cases := map[string]string{
		`dial postgres://app:s3cr3t@db:5432/x failed`:                    `dial postgres://app:***@db:5432/x failed`,
		`amqp://guest:guest@127.0.0.1:5672/: connection refused`:         `amqp://guest:***@127.0.0.1:5672/: connection refused`,
		`connect host=db user=app password=hunter2 dbname=x`:             `connect host=db user=app password=*** dbname=x`,
		`401: Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.e30.abc denied`: `401: Authorization: Bearer *** denied`,
		`{"token":"abcdef123456"} rejected`:                              `{"token":"***"} rejected`,
		`plain error without secrets`:                                    `plain error without secrets`,
	}
	for in, want := range cases {
		if got := Summary(in, nil, 0); got != want {
			t.Errorf("Summary(%q) = %q, want %q", in, got, want)
		}
	}
	payload := []byte(`{"ssn":"123-45-6789"}`)
	if got := Summary(`decode {"ssn":"123-45-6789"}: bad`, payload, 0); strings.Contains(got, "6789") || !strings.Contains(got, "[payload]") {
		t.Errorf("payload not cut: %q", got)
	}
}

func TestTruncateOnUTF8Boundary(t *testing.T) {
	t.Parallel()
	s := strings.Repeat("é", 2000) // 2 bytes each
	for _, n := range []int{1, 2, 3, 2047, 2048} {
		got := Truncate(s, n)
		if len(got) > n || !utf8.ValidString(got) || len(got) < n-1 {
			t.Errorf("Truncate(%d) = %d bytes, valid=%v", n, len(got), utf8.ValidString(got))
		}
	}
	if got := Truncate("a\xffb", 10); !utf8.ValidString(got) {
		t.Errorf("invalid UTF-8 kept: %q", got)
	}
}

// TestSecretEndsWhereItsSyntaxEnds: the forms issue 46 found intact or
// partly intact, and their kin: a value ends at its closing quote, a URL's
// password at the last @ before the host, an unquoted value at white space.
func TestSecretEndsWhereItsSyntaxEnds(t *testing.T) {
	t.Parallel()
	cases := map[string]string{
		`connect: password=;Tr0ub4dor&3 failed`:                          `connect: password=*** failed`,
		`host=db password='correct horse battery' user=app`:              `host=db password='***' user=app`,
		`host=db password="correct horse battery" user=app`:              `host=db password="***" user=app`,
		`host=db password='it\'s my s3cret' user=app`:                    `host=db password='***' user=app`,
		`{"password":"s3cr3t, really"} rejected`:                         `{"password":"***"} rejected`,
		`{"token":"a\"b c, d"} rejected`:                                 `{"token":"***"} rejected`,
		`{'api_key': 'k e y'} rejected`:                                  `{'api_key': '***'} rejected`,
		`dial postgres://app:p@ss:w0rd@db:5432/x failed`:                 `dial postgres://app:***@db:5432/x failed`,
		`dial postgres://app@corp:pw@db/x failed`:                        `dial postgres://app@corp:***@db/x failed`,
		`GET https://api.example/v1?api_key=&AbC123xyz failed`:           `GET https://api.example/v1?api_key=*** failed`,
		`GET https://api.example/v1?x=1&access_key=AbC&y=2 failed`:       `GET https://api.example/v1?x=1&access_key=*** failed`,
		`Authorization: Bearer abc denied`:                               `Authorization: Bearer *** denied`,
		`cut short: password='never closed, the rest is secret`:          `cut short: password='***'`,
		`password=hunter2 and token: t0k3n, secret = "x y" and pwd:p@ss`: `password=*** and token: *** secret = "***" and pwd:***`,
	}
	for in, want := range cases {
		if got := Summary(in, nil, 0); got != want {
			t.Errorf("Summary(%q)\n = %q\nwant %q", in, got, want)
		}
	}
}

// TestURLWhenItDoesNotParse: the password of a URL is found by hand, so a
// URL that url.Parse refuses is redacted too, and an error about it (which
// quotes it, or a fragment of its userinfo) shows no part of the password.
func TestURLWhenItDoesNotParse(t *testing.T) {
	t.Parallel()
	cases := map[string]string{
		"amqp://guest:s3cret@host:notaport/":   "amqp://guest:***@host:notaport/",
		"amqp://guest:s3cret@host:5672/%zz":    "amqp://guest:***@host:5672/%zz",
		"amqp://guest:s3cret@[host:5672/":      "amqp://guest:***@[host:5672/",
		"amqp://guest:s3%zzcret@host:5672/":    "amqp://guest:***@host:5672/",
		"amqp://guest:p@ss:w0rd@host/v":        "amqp://guest:***@host/v",
		"amqp://guest:pa/ss@host:notaport/":    "amqp://guest:***@host:notaport/",
		"amqp://guest:s3cret@host/v?x=a@b":     "amqp://guest:***@host/v?x=a@b",
		"amqp://guest@host:5672/":              "amqp://guest@host:5672/",
		"amqp://host:5672/":                    "amqp://host:5672/",
		"not a url at all: user:pass@nothing":  "not a url at all: user:pass@nothing",
		"https://u:tok@collector:4318/v1/x#f@": "https://u:***@collector:4318/v1/x#f@",
	}
	for in, want := range cases {
		if got := URL(in); got != want {
			t.Errorf("URL(%q) = %q, want %q", in, got, want)
		}
	}
	for _, raw := range []string{"amqp://guest:s3cret@host:notaport/", "amqp://guest:s3%zzcret@host:5672/", "amqp://guest:s3cret@[host:5672/"} {
		_, err := url.Parse(raw)
		if err == nil {
			t.Fatalf("url.Parse(%q) accepted it", raw)
		}
		for _, got := range []string{URLProblem(raw, err), WithoutURLPassword(err.Error(), raw)} {
			if strings.Contains(got, "s3") || strings.Contains(got, "cret") || strings.Contains(got, "%zz") && strings.Contains(raw, "s3%zz") {
				t.Errorf("%q: %q shows part of the password", raw, got)
			}
		}
	}
}
