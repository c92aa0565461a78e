package main

import (
	"net"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/outboxkit/watermill-outbox/internal/pgtest"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
)

// TestRelayFailsFastOnErrorsThatCannotHeal: a wrong password, an unknown
// role or a missing database stops the daemon at once (not after the 60s
// start-up wait) with what to check, and never prints the password. "At
// once" is read from what the daemon did, not from the clock: the error
// says "not retried" and no start-up step was retried.
func TestRelayFailsFastOnErrorsThatCannotHeal(t *testing.T) {
	t.Parallel()
	shared, err := url.Parse(testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	withUser := func(u *url.URL, user, pw, db string) string {
		c := *u
		c.User = url.UserPassword(user, pw)
		if db != "" {
			c.Path = "/" + db
		}
		return c.String()
	}
	cluster := pgtest.Start(t, pgtest.Options{PasswordRoles: map[string]string{"relay": "right-pw"}})
	private := &url.URL{Scheme: "postgres", Host: net.JoinHostPort(cluster.Host, strconv.Itoa(cluster.Port)), Path: "/postgres", RawQuery: "sslmode=disable"}

	cases := []struct {
		name, url, hint string
	}{
		{"bad password (28P01)", withUser(private, "relay", "wrong-pw-s3cret", ""), "check the password in OUTBOX_DATABASE_URL"},
		{"unknown role (28000)", withUser(shared, "no_such_role_outbox", "pw-s3cret", ""), "check the user name in OUTBOX_DATABASE_URL"},
		{"missing database (3D000)", withUser(shared, "postgres", "pw-s3cret", "no_such_db_outbox"), "check the database name in OUTBOX_DATABASE_URL"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			env := map[string]string{
				"OUTBOX_DATABASE_URL":    c.url,
				"OUTBOX_RELAY_TABLES":    "public.org_outbox",
				"OUTBOX_BACKEND":         "amqp",
				"OUTBOX_AMQP_URL":        "amqp://guest:guest@127.0.0.1:5672/",
				"OUTBOX_CLEANER_ENABLED": "false",
			}
			start := time.Now()
			r := rbRun(t, env, "relay")
			took := time.Since(start)
			r.expect(t, 1, nil, []string{"connect to OUTBOX_DATABASE_URL", c.hint, "not retried"})
			if strings.Contains(r.stderr, "Start-up step failed; retrying") {
				t.Fatalf("the relay retried an error that cannot heal (gave up after %s); it must stop at once:\n%s", took, r.stderr)
			}
			t.Logf("the relay gave up after %s", took.Round(time.Millisecond))
			if strings.Contains(r.stderr+r.stdout, "s3cret") {
				t.Fatalf("password printed:\n%s", r.stderr)
			}
			// The runbook commands say the same.
			r = rbRun(t, map[string]string{"OUTBOX_DATABASE_URL": c.url}, "stats", "--table=public.org_outbox")
			r.expect(t, 1, nil, []string{c.hint})
		})
	}
}
