package main

import "strings"

// Backend kinds of the daemon (OUTBOX_BACKEND). The publishers live in
// router/kafkabackend and router/amqpbackend; an in-process backend
// (router.InProcess, Watermill's gochannel) is refused: the daemon has no
// consumer in its process.
const (
	backendKafka     = "kafka"
	backendAMQP      = "amqp"
	backendGoChannel = "gochannel"
)

// parseBrokers splits a comma-separated broker list.
func parseBrokers(s string) []string {
	var out []string
	for _, b := range strings.Split(s, ",") {
		if b = strings.TrimSpace(b); b != "" {
			out = append(out, b)
		}
	}
	return out
}
