package redact

import (
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
