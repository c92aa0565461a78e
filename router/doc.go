// Package router is what a Watermill user adds to a router to relay an outbox
// well: the middleware stack (error capture, poison copy, recoverer,
// per-message timeout, optional in-process retry), metrics, and InProcess,
// an in-memory pub/sub that, unlike Watermill's gochannel, returns from
// Publish only once every subscriber acked (an outbox relaying to consumers
// in its own process). The broker publishers are in router/kafkabackend and
// router/amqpbackend, so that a program links only the client it uses.
package router
