package walrelay

// SetFenceHook sets the hook that runs before each fenced write (phase
// "before") and, in a transaction, between the write's statement and its
// commit (phase "checked"). Set it before Subscribe.
func SetFenceHook(s *Subscriber, hook func(op, phase string)) { s.hooks.fence = hook }

// ReplicationConnString is the relay's replication connection string for
// a pool.
var ReplicationConnString = replicationConnString

// PeakRows is the most rows a session of s held read and not settled
// (queued, in flight, or buffered in a transaction not yet committed).
func PeakRows(s *Subscriber) int64 { return s.peakRows.Load() }

// Spilled is the number of keys whose backlog the relay spilled to a
// retrying hold.
func Spilled(s *Subscriber) int64 { return s.spilled.Load() }

// Unseen is the number of times s put a statement off until a streamed
// transaction was visible (a dead write waits for its row to be visible).
func Unseen(s *Subscriber) int64 { return s.unseen.Load() }
