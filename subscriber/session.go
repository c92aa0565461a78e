package subscriber

import (
	"context"
	"os"
	"strconv"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
)

// sessionName is the application_name a relay gives its leader session
// when the pool's connections have none: "outbox-relay <host> <pid>"
// (sqlq.RelayApplicationPrefix), so that the console and the runbook name
// the relay instead of showing an unnamed session. PostgreSQL keeps 63
// bytes of it.
var sessionName = func() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "unknown-host"
	}
	name := sqlq.RelayApplicationPrefix + host + " " + strconv.Itoa(os.Getpid())
	if len(name) > 63 {
		name = name[:63]
	}
	return name
}()

// nameSessionSQL names the session sessionName unless it has a name (the
// pool's application_name, which is kept). Args: the name.
const nameSessionSQL = `SELECT set_config('application_name', $1, false) FROM (SELECT current_setting('application_name') AS n) AS s WHERE s.n = ''`

// resetSessionNameSQL gives the session back its connection's name.
const resetSessionNameSQL = `RESET application_name`

// nameSession names conn's session, best effort, and reports whether it
// did (and so must reset it before the connection goes back to the pool).
func nameSession(ctx context.Context, conn *pgxpool.Conn) bool {
	var set string
	return conn.QueryRow(ctx, nameSessionSQL, sessionName).Scan(&set) == nil
}

// unnameSession undoes nameSession, best effort.
func unnameSession(ctx context.Context, conn *pgxpool.Conn) {
	_, _ = conn.Exec(ctx, resetSessionNameSQL)
}
