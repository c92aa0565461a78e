package schema

import (
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
)

// MaxIdentifierBytes is PostgreSQL's limit on the length of one identifier
// (NAMEDATALEN - 1).
const MaxIdentifierBytes = 63

// DefaultSchemaName is the schema assumed for an unqualified table name when
// the relay derives its advisory-lock key and its notification channel.
const DefaultSchemaName = "public"

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
	for _, p := range parts {
		if err := validIdentifier(p); err != nil {
			return Table{}, fmt.Errorf("%w %q: %w", ErrInvalidTable, s, err)
		}
	}
	name := parts[len(parts)-1]
	if len(name)+len(longestSuffix) > MaxIdentifierBytes {
		return Table{}, fmt.Errorf("%w %q: table part is %d bytes; at most %d fit so that its index and constraint names (such as %s) stay within PostgreSQL's %d-byte limit",
			ErrInvalidTable, s, len(name), MaxIdentifierBytes-len(longestSuffix), name+longestSuffix, MaxIdentifierBytes)
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

func validIdentifier(p string) error {
	if p == "" {
		return errors.New("empty name part; use \"table\" or \"schema.table\"")
	}
	if len(p) > MaxIdentifierBytes {
		return fmt.Errorf("name part is %d bytes, PostgreSQL allows at most %d", len(p), MaxIdentifierBytes)
	}
	for i := 0; i < len(p); i++ {
		c := p[i]
		switch {
		case c >= 'a' && c <= 'z', c == '_':
		case c >= '0' && c <= '9' && i > 0:
		default:
			return fmt.Errorf("character %q at byte %d is not allowed; use lowercase letters, digits and underscores, starting with a letter or underscore", c, i)
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
		return DefaultSchemaName + "." + t.name
	}
	return t.String()
}

// LockKey is the stable int64 advisory-lock key of the table: FNV-64a of
// "outbox:" + Qualified().
func (t Table) LockKey() int64 { return fnvKey("outbox:" + t.Qualified()) }

// IdleLockKey is the advisory-lock key of the table's wake-up handshake
// (docs/ARCHITECTURE.md, "Wake-up"): a relay with nothing to claim holds it
// exclusively, and an enqueue sends NOTIFY only when it cannot take it in
// shared mode. FNV-64a of "outbox-idle:" + Qualified().
func (t Table) IdleLockKey() int64 { return fnvKey("outbox-idle:" + t.Qualified()) }

// OrderedIdleLockKey is the idle lock of the ordered relays of the table:
// writers of keyed rows try it instead of IdleLockKey, so that an idle
// claim loop (for unkeyed rows) does not make every keyed commit notify,
// and the reverse (docs/ARCHITECTURE.md, "Wake-up").
func (t Table) OrderedIdleLockKey() int64 { return fnvKey("outbox-idle-ordered:" + t.Qualified()) }

// RelayModeLockKey is the advisory-lock key that every relay of one mode
// (ordered, or the default mode) holds in shared mode while it has a
// subscription on the table, so that a relay of the other mode sees it and
// refuses to start (CheckRelayMode). FNV-64a of "outbox-relay-ordered:" or
// "outbox-relay-default:" + Qualified().
func (t Table) RelayModeLockKey(ordered bool) int64 {
	if ordered {
		return fnvKey("outbox-relay-ordered:" + t.Qualified())
	}
	return fnvKey("outbox-relay-default:" + t.Qualified())
}

// migrateLockKey serialises concurrent Migrate calls on the same table.
func (t Table) migrateLockKey() int64 { return fnvKey("outbox-migrate:" + t.Qualified()) }

func fnvKey(s string) int64 {
	return int64(fnvSum(s)) //nolint:gosec // the key is a bit pattern; wrapping to negative values is intended
}

func fnvSum(s string) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(s))
	return h.Sum64()
}

// NotifyChannel is the LISTEN/NOTIFY channel on which enqueues of this table
// wake relays: "outbox:" + Qualified(), or, when that exceeds the 63 bytes
// PostgreSQL allows for a channel, "outbox:" followed by the hexadecimal
// LockKey.
func (t Table) NotifyChannel() string {
	ch := "outbox:" + t.Qualified()
	if len(ch) <= MaxIdentifierBytes {
		return ch
	}
	return "outbox:" + strconv.FormatUint(fnvSum("outbox:"+t.Qualified()), 16)
}

// ident renders a derived object name (index or constraint) of the table:
// its unqualified name plus suffix, as one sanitized identifier.
func (t Table) ident(suffix string) string {
	return pgx.Identifier{t.name + suffix}.Sanitize()
}
