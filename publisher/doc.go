// Package publisher writes events into an outbox table inside the caller's
// transaction, so that the business rows and their events commit or roll
// back together.
//
// Enqueue and EnqueueBatch take a pgx.Tx (or a *sql.Tx wrapped with
// StdlibTx). TxPublisher is a Watermill message.Publisher bound to one
// transaction. Every enqueue is idempotent on event_id and wakes the relays
// of the table through NOTIFY on the table's channel ("outbox:" and the qualified table name),
// which PostgreSQL delivers at commit and drops at rollback.
package publisher
