// Package schema is the single home of the outbox table contract: validated
// table identifiers, the DDL and its embedded migrations, the column and
// metadata names, every SQL statement the project runs, and Adapter, which
// lets watermill-sql v3's stock publisher and subscriber work on an outbox
// table (package schema/sqlv4 does the same for watermill-sql v4 with
// Adapter's statements).
//
// Table names are never concatenated from input: ParseTable validates them
// and every statement renders them with pgx.Identifier.Sanitize.
package schema
