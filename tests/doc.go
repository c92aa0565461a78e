// Package tests holds the end-to-end tests of watermill-outbox against real
// services: PostgreSQL, RabbitMQ, and the Kafka protocol through an
// in-process kfake cluster. A missing service fails the tests; none skips.
package tests
