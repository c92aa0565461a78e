// Package subscriber is the lease-based Watermill message.Subscriber over one
// outbox table: the relay's heart.
//
// Each claim is one short autocommitted UPDATE ... FOR UPDATE SKIP LOCKED
// that leases a batch (locked_at = now(), attempts + 1); no transaction is
// open while a handler runs. Messages are delivered without waiting for the
// previous ack, so a router handles them concurrently, and the next batch is
// claimed while the current one is in flight. Acks are grouped into one
// fenced UPDATE per burst; a nack schedules a retry with backoff and records
// last_error (redacted, truncated), or marks the row dead (dead_at = now(),
// parked at available_at = 'infinity') at MaxAttempts or at once for an error
// wrapped with Permanent. A row whose lease expires on its last allowed
// attempt is parked dead by the next claim, and one whose last attempt got no
// verdict before the subscription stopped by the release; dead rows are
// never claimed, whatever MaxAttempts says. Every ack, nack and lease
// renewal is fenced by (id, attempts, locked_at), so a worker whose lease
// expired and whose row was claimed again cannot overwrite the new holder.
//
// A message handled longer than half of LockTTL gets its lease renewed while
// it is in flight, so slow handlers are not delivered twice; a renewal writes
// available_at, never the fence token. Renewals stop DispatchTimeout plus
// LockTTL/2 after delivery: the message's context is cancelled and the
// attempt counts as failed. Message contexts do not derive from the
// Subscribe context: when it is cancelled (a router closing), messages in
// flight keep a live context for CloseTimeout.
//
// A committed enqueue wakes the subscriber through LISTEN/NOTIFY on
// the table's channel ("outbox:" and the qualified name); PollInterval is the safety net. With
// SingleActive (the default) one process per table dispatches: it holds a
// session-level advisory lock on a dedicated connection and claims on that
// connection, so a leader whose connection dropped cannot claim again;
// standbys try to take over every ElectionInterval.
//
// Delivery is at least once and no order is guaranteed: consumers dedup on
// event_id.
package subscriber
