// Package fault holds the fault-injection test of the relay (build tag
// fault): relays run as separate `outbox relay` processes while producers
// enqueue, and the test kills relays with SIGKILL, restarts PostgreSQL, takes
// RabbitMQ away, and runs several relays with single-active on and off. It
// then compares a consumer's record of event_ids with the table. It restarts
// the machine's PostgreSQL and RabbitMQ, so it runs on its own, after the
// other tests: `make test` runs it at CI size, `make fault` at full size.
package fault
