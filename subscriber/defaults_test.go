package subscriber

import (
	"testing"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
)

// TestDefaultsAreTheStatements: the relay's defaults and AllTopics are the
// values the shared statements (and the watermill-sql adapters) default to.
func TestDefaultsAreTheStatements(t *testing.T) {
	t.Parallel()
	if AllTopics != sqlq.AllTopics || ClaimBatchSizeDefault != sqlq.BatchSizeDefault ||
		LockTTLDefault != sqlq.LockTTLDefault || MaxAttemptsDefault != sqlq.MaxAttemptsDefault {
		t.Fatalf("subscriber defaults (%q, %d, %s, %d) differ from internal/sqlq's (%q, %d, %s, %d)",
			AllTopics, ClaimBatchSizeDefault, LockTTLDefault, MaxAttemptsDefault,
			sqlq.AllTopics, sqlq.BatchSizeDefault, sqlq.LockTTLDefault, sqlq.MaxAttemptsDefault)
	}
}
