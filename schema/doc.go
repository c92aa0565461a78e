// Package schema is the single home of the outbox table contract: validated
// table identifiers, the DDL and its embedded migrations, the column and
// metadata names, every SQL statement the project runs, and Adapter, the
// configuration and statements of the watermill-sql adapters. The adapters
// themselves, which let watermill-sql's stock publisher and subscriber work
// on an outbox table, live in packages schema/sqlv3 (watermill-sql v3) and
// schema/sqlv4 (watermill-sql v4), so that only their users link
// watermill-sql.
//
// Table names are never concatenated from input: ParseTable validates them
// and every statement renders them with pgx.Identifier.Sanitize.
package schema
