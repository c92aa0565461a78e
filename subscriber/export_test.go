package subscriber

// Abandon makes the ordered relays of s stop, at Close, like a killed
// process: without giving their partitions back or leaving the membership.
func Abandon(s *Subscriber) { s.abandon.Store(true) }

// AfterClaimQuery makes s run fn after each claim statement was sent and
// before its rows are read.
func AfterClaimQuery(s *Subscriber, fn func()) { s.afterClaimQuery = fn }
