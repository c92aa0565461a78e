package subscriber

// Abandon makes the ordered relays of s stop, at Close, like a killed
// process: without giving their partitions back or leaving the membership.
func Abandon(s *Subscriber) { s.abandon.Store(true) }

// SetBeforeIdle makes f run each time a subscription of s found nothing and
// is about to try the idle lock. Set it before Subscribe.
func SetBeforeIdle(s *Subscriber, f func()) { s.beforeIdle = f }
