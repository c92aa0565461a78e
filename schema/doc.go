// Package schema is the outbox table contract: validated table identifiers
// (ParseTable), the DDL and its migrations (Migrate, MigrationFiles and the
// embedded Migrations for goose and golang-migrate), the relay modes a table
// records (Mode), its optional columns (Columns) and the metadata keys every
// relayed message carries (MetadataEventID and the others).
//
// The SQL the relays, the runbook and the cleaner run is not part of the
// API; the watermill-sql adapters, which let watermill-sql's stock publisher
// and subscriber work on an outbox table, live in packages schema/sqlv3
// (watermill-sql v3) and schema/sqlv4 (watermill-sql v4), so that only their
// users link watermill-sql.
//
// Table names are never concatenated from input: ParseTable validates them
// and every statement renders them with pgx.Identifier.Sanitize.
package schema
