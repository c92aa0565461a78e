// Package fault holds the fault-injection test of the relay (build tag
// fault): relays run as separate `outbox relay` processes while producers
// enqueue, and the test kills relays with SIGKILL, restarts PostgreSQL, takes
// RabbitMQ away, and runs several relays with single-active on and off. It
// then compares a consumer's record of event_ids with the table. The
// PostgreSQL it restarts and the RabbitMQ it stops are private instances it
// starts itself (internal/pgtest, internal/rmqtest), never the shared
// services: `make test` runs it at CI size, `make fault` at full size.
//
// TestFaultPartition (partition_test.go) cuts a relay leader off the network
// in its own network namespace and checks that a standby takes over within
// 30 s and nothing is lost. It needs root and iproute2, and touches no shared
// service: it starts its own PostgreSQL cluster and Kafka cluster.
package fault
