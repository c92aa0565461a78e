package subscriber

// Abandon makes the ordered relays of s stop, at Close, like a killed
// process: without giving their partitions back or leaving the membership.
func Abandon(s *Subscriber) { s.abandon.Store(true) }
