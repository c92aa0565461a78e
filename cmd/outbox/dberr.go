package main

import (
	"errors"

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
