package walrelay

// SetFenceHook sets the hook that runs before each fenced write (phase
// "before") and, in a transaction, between the write's statement and its
// commit (phase "checked"). Set it before Subscribe.
func SetFenceHook(s *Subscriber, hook func(op, phase string)) { s.fenceHook = hook }

// ReplicationConnString is the relay's replication connection string for
// a pool.
var ReplicationConnString = replicationConnString
