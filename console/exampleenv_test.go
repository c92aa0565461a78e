package console_test

import (
	"os"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
)

// The Example functions connect as a service does, to OUTBOX_DATABASE_URL;
// here it is the test database.
func init() { _ = os.Setenv("OUTBOX_DATABASE_URL", testdb.URL()) }
