package subscriber

import "context"

// ReadPausedTopics makes s read the paused topics now, as it does at the
// wake-up of a pause, and returns them.
func ReadPausedTopics(ctx context.Context, s *Subscriber) []string {
	s.paused.readAt.Store(0)
	if p := s.pausedTopics(ctx); p != nil {
		return p.topics
	}
	return nil
}
