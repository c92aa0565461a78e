package main

import (
	"errors"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
)

// unhealable returns what to check when err is a connection error that
// retrying cannot cure (a wrong user, password or database name, a role
// without CONNECT), and false for anything that may heal, such as a
// database that is restarting.
func unhealable(err error) (string, bool) {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return "", false
	}
	switch pgErr.Code {
	case "28P01": // invalid_password
		return "the server rejected the password: check the password in OUTBOX_DATABASE_URL", true
	case "28000": // invalid_authorization_specification: unknown role, or pg_hba.conf refuses it
		return "the server refused the role: check the user name in OUTBOX_DATABASE_URL and the server's pg_hba.conf", true
	case "3D000": // invalid_catalog_name
		return "the database does not exist: check the database name in OUTBOX_DATABASE_URL", true
	case "42501": // insufficient_privilege
		return "the role may not connect to the database: GRANT CONNECT to it, or use another role in OUTBOX_DATABASE_URL", true
	}
	return "", false
}

// parseProblem says what is wrong with a connection string that pgx could
// not parse, without quoting the string: pgx's own message, and url.Parse's,
// repeat it, password included.
func parseProblem(err error) string {
	msg := err.Error()
	if strings.HasPrefix(msg, "cannot parse `") {
		if i := strings.Index(msg, "`: "); i > 0 {
			msg = msg[i+3:]
		}
	}
	if i := strings.Index(msg, " ("); i > 0 {
		msg = msg[:i] // pgx's reason; the cause in parentheses may quote the string
	}
	return msg + "; the form is postgres://user:password@host:5432/database?sslmode=disable or host=... user=... dbname=..."
}

// backendAddressVar names the variable that holds the address of a backend.
func backendAddressVar(kind string) string {
	switch kind {
	case "kafka":
		return "OUTBOX_KAFKA_BROKERS"
	case "amqp":
		return "OUTBOX_AMQP_URL (user, password, host and vhost)"
	}
	return "OUTBOX_BACKEND"
}
