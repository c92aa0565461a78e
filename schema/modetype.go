package schema

// Mode is how a table is relayed; it decides where a row's delivery state
// lives (docs/OPERATIONS.md, "What the numbers mean in each mode").
type Mode string

// The relay modes.
const (
	// ModeDefault: the table relay claims and acks rows; a row's columns
	// (published_at, attempts, last_error, available_at, locked_at,
	// dead_at) hold its state.
	ModeDefault Mode = "default"
	// ModeOrdered: keyed rows are never updated on delivery; a keyed row is
	// done when it is at or below its partition's floor (<table>_partitions)
	// or covered by its key's hold (<table>_holds) as done, and its failures
	// live in the hold. Unkeyed rows of an ordered table are default-mode
	// rows.
	ModeOrdered Mode = "ordered"
	// ModeWAL: the WAL relay never marks rows published; a row is done when
	// it was written before the recorded horizon (<table>_wal) and is not
	// parked behind a held key (<table>_holds); a dead row is parked
	// with dead_at as in the default mode.
	ModeWAL Mode = "wal"
)
