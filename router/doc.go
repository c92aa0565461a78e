// Package router is what a Watermill user adds to a router to relay an outbox
// well: the middleware stack (error capture, poison copy, recoverer,
// per-message timeout, optional in-process retry), the publishing backends
// selected by configuration (Kafka, AMQP, in-process), and metrics.
package router
