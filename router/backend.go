package router

import "strings"

// Backend kinds of the daemon (OUTBOX_BACKEND). The publishers live in
// router/kafkabackend and router/amqpbackend, so that a program links only
// the client of the broker it uses; the in-process backend is InProcess.
const (
	BackendKafka     = "kafka"
	BackendAMQP      = "amqp"
	BackendGoChannel = "gochannel"
)

// MetadataPartitionKey is the metadata entry the forwarder sets to the
// chosen partition key; the Kafka backend uses it as the record key.
const MetadataPartitionKey = "partition_key"

// ParseBrokers splits a comma-separated broker list.
func ParseBrokers(s string) []string {
	var out []string
	for _, b := range strings.Split(s, ",") {
		if b = strings.TrimSpace(b); b != "" {
			out = append(out, b)
		}
	}
	return out
}
