package schema

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/outboxkit/watermill-outbox/internal/pgmeta"
)

// MaxIdentifierBytes is PostgreSQL's limit on the length of one identifier
// (NAMEDATALEN - 1).
const maxIdentifierBytes = 63

// DefaultSchemaName is the schema assumed for an unqualified table name when
// the relay derives its advisory-lock key and its notification channel.
const defaultSchemaName = "public"

// ErrInvalidTable is returned (wrapped) by ParseTable for every name it
// refuses.
var ErrInvalidTable = errors.New("invalid outbox table name")

// Table is a validated outbox table identifier, such as org_outbox or
// public.org_outbox. The zero Table is invalid; build one with ParseTable or
// MustParseTable.
type Table struct {
	schema string // empty when the name was unqualified
	name   string
	full   string // String(), built once: messages carry it
}

// ParseTable validates s as an outbox table name: "table" or "schema.table",
// each part starting with a lowercase letter or underscore and made of
// lowercase letters, digits and underscores, at most 63 bytes. Anything else
// (quotes, spaces, semicolons, uppercase, three parts, empty parts) is refused
// with an error that says what is allowed.
func ParseTable(s string) (Table, error) {
	parts := strings.Split(s, ".")
	if len(parts) > 2 {
		return Table{}, fmt.Errorf("%w %q: has %d dot-separated parts; use \"table\" or \"schema.table\"", ErrInvalidTable, s, len(parts))
	}
	offset := 0 // of the part in s, so that a bad byte is named where it is in s
	for _, p := range parts {
		if err := validIdentifier(p, offset); err != nil {
			return Table{}, fmt.Errorf("%w %q: %w", ErrInvalidTable, s, err)
		}
		offset += len(p) + 1
	}
	name := parts[len(parts)-1]
	if len(name)+len(longestSuffix) > maxIdentifierBytes {
		return Table{}, fmt.Errorf("%w %q: table part is %d bytes; at most %d fit so that its index and constraint names (such as %s) stay within PostgreSQL's %d-byte limit",
			ErrInvalidTable, s, len(name), maxIdentifierBytes-len(longestSuffix), name+longestSuffix, maxIdentifierBytes)
	}
	if len(parts) == 1 {
		return Table{name: parts[0], full: parts[0]}, nil
	}
	return Table{schema: parts[0], name: parts[1], full: parts[0] + "." + parts[1]}, nil
}

// MustParseTable is ParseTable that panics on an invalid name. Use it for
// names fixed in code.
func MustParseTable(s string) Table {
	t, err := ParseTable(s)
	if err != nil {
		panic(err)
	}
	return t
}

// validIdentifier checks one part of a table name; offset is where p
// starts in the whole name, for the byte an error names.
func validIdentifier(p string, offset int) error {
	if p == "" {
		return errors.New("empty name part; use \"table\" or \"schema.table\"")
	}
	if len(p) > maxIdentifierBytes {
		return fmt.Errorf("name part is %d bytes, PostgreSQL allows at most %d", len(p), maxIdentifierBytes)
	}
	for i := 0; i < len(p); i++ {
		c := p[i]
		switch {
		case c >= 'a' && c <= 'z', c == '_':
		case c >= '0' && c <= '9' && i > 0:
		default:
			return fmt.Errorf("character %q at byte %d is not allowed; use lowercase letters, digits and underscores, starting with a letter or underscore", c, offset+i)
		}
	}
	return nil
}

// IsZero reports whether t is the zero (invalid) Table.
func (t Table) IsZero() bool { return t.name == "" }

// Name is the unqualified table name.
func (t Table) Name() string { return t.name }

// Schema is the schema part of the name, or "" when it was unqualified.
func (t Table) Schema() string { return t.schema }

// Identifier returns the table as a pgx.Identifier.
func (t Table) Identifier() pgx.Identifier {
	if t.schema == "" {
		return pgx.Identifier{t.name}
	}
	return pgx.Identifier{t.schema, t.name}
}

// Sanitize renders the table for SQL, quoted by pgx.Identifier.Sanitize.
func (t Table) Sanitize() string { return t.Identifier().Sanitize() }

// String returns the name as it was given: "table" or "schema.table".
func (t Table) String() string {
	return t.full
}

// Qualified returns "schema.table", using DefaultSchemaName for an
// unqualified name. It is the name used for lock keys, notification channels
// and metric labels, so that org_outbox and public.org_outbox agree.
func (t Table) Qualified() string {
	if t.schema == "" {
		return defaultSchemaName + "." + t.name
	}
	return t.String()
}

// migrateLockKey serialises concurrent Migrate calls on the same table.
func (t Table) migrateLockKey() int64 { return pgmeta.Migrate(t.Qualified()) }

// ident renders a derived object name (index or constraint) of the table:
// its unqualified name plus suffix, as one sanitized identifier.
func (t Table) ident(suffix string) string {
	return pgx.Identifier{t.name + suffix}.Sanitize()
}
func itoa(n int) string { return strconv.Itoa(n) }
