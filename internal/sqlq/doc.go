// Package sqlq holds every SQL statement the relays, the runbook, the
// cleaner and the watermill-sql adapters run, rendered once per table with
// its name sanitized (pgx.Identifier): the default relay's claim and
// verdicts (Queries), ordered mode (OrderedQueries), the WAL relay
// (WALQueries), the state of rows in each mode (StateQueries), the
// runbook's statements and the adapters' (Adapter). It is internal: package
// schema is the public table contract, and statements are not API.
// Statements with many arguments take them as a struct (FailArgs,
// AdvanceArgs, NackArgs) and render a Statement that runs itself.
package sqlq
