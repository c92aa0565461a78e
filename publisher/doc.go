// Package publisher writes events into an outbox table inside the caller's
// transaction, so that the business rows and their events commit or roll
// back together.
//
// There are four ways to enqueue, one per situation:
//
//   - Enqueue and EnqueueBatch write publisher.Message values inside a
//     pgx.Tx (or a *sql.Tx wrapped with StdlibTx) with the default
//     settings: use them when your code writes the business rows itself.
//   - An Enqueuer (NewEnqueuer) does the same with an EnqueuerConfig of
//     your own: another topic rule, a payload limit, no NOTIFY for a
//     prepared transaction, metrics.
//   - TxPublisher is a Watermill message.Publisher bound to one
//     transaction: use it when the code that emits events speaks
//     Watermill (a CQRS event bus, a handler's publisher).
//   - DBPublisher is a Watermill message.Publisher that commits each
//     Publish in a transaction of its own: use it when there is no
//     business write to join (tools, tests, events that stand alone).
//
// Only a transaction is accepted: publisher.Tx asks for Commit and Rollback,
// so passing a *pgxpool.Pool, *pgxpool.Conn or *pgx.Conn to Enqueue,
// EnqueueBatch or NewTxPublisher (or a *sql.DB or *sql.Conn to StdlibTx) is
// a compile error. An event enqueued outside the business transaction would
// commit on its own, and the outbox's one promise would be lost.
//
// Every enqueue is idempotent on event_id and wakes the relays of the table
// through NOTIFY on the table's channel ("outbox:" and the qualified table
// name), which PostgreSQL delivers at commit and drops at rollback.
package publisher
