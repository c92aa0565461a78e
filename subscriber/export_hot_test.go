package subscriber

// CrashAfterCommit makes h's BeginFunc return after each commit without
// handing its events over, like a process killed between its commit and
// the delivery: the events stay leased to the hot path until LockTTL.
func CrashAfterCommit(h *HotPath) { h.crashAfterCommit.Store(true) }
