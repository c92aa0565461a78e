package runbook

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/schema"
)

// ListFilter selects the rows of ListRows. A zero field does not filter,
// but State is required.
type ListFilter struct {
	// State is the rows' state in the table's relay mode: pending,
	// retrying, dead, delivered (newest first) or all (a search).
	State ListState
	// Topic keeps the rows of one topic.
	Topic string
	// EventID keeps the row of one event.
	EventID uuid.UUID
	// TenantID keeps the rows of one tenant.
	TenantID uuid.UUID
	// OrderingKey keeps the rows of one ordering key.
	OrderingKey string
	// CreatedFrom and CreatedTo keep the rows created at or after
	// CreatedFrom and before CreatedTo.
	CreatedFrom, CreatedTo time.Time
	// ErrorContains keeps the rows whose last_error contains it, ignoring
	// case (a held row's is its hold's).
	ErrorContains string
	// Cause keeps the rows whose normalised cause (sqlq.CauseOf their
	// last_error) equals it, as DeadCauses groups them. It costs some 20 µs
	// a row: on a large table narrow by State and Topic too, or run under
	// a statement timeout.
	Cause string
	// After is the cursor of the next page: the last Sequence of a page
	// (RowPage.Next). Before is the cursor of the previous page: the first
	// Sequence of a page (RowPage.Prev). At most one of them.
	After, Before int64
	// Limit bounds the rows of a page. Defaults to DefaultLimit.
	Limit int
}

// RowPage is one page of ListRows and where it sits in the list.
type RowPage struct {
	// Rows are the page's rows in the list's order: ascending sequence,
	// or descending for the delivered rows.
	Rows []Row `json:"rows"`
	// Total counts every matching row; Before those that come before the
	// page. Both are 0 when the page is empty.
	Total  int64 `json:"total"`
	Before int64 `json:"before"`
	// Next and Prev are the cursors of the next and previous pages (After
	// and Before of ListFilter), 0 when there is none.
	Next int64 `json:"next,omitempty"`
	Prev int64 `json:"prev,omitempty"`
}

// ListRows lists a page of the rows of the table in state f.State matching
// f, in the table's relay mode (sqlq.StateQueries): what is pending,
// retrying, dead or delivered, or every row matching a search. The total and
// the position count every matching row.
func (r *Runbook) ListRows(ctx context.Context, f ListFilter) (RowPage, error) {
	if err := r.check(); err != nil {
		return RowPage{}, err
	}
	db, t := r.db, r.table
	limit, err := checkLimit(f.Limit)
	if err != nil {
		return RowPage{}, err
	}
	switch {
	case !sqlq.ListState(f.State).Valid():
		return RowPage{}, fmt.Errorf("runbook: list rows of %s: unknown state %q; use pending, retrying, dead, delivered or all", t, f.State)
	case f.After < 0 || f.Before < 0:
		return RowPage{}, fmt.Errorf("runbook: list rows of %s: a negative cursor; pass the Sequence of a listed row", t)
	case f.After > 0 && f.Before > 0:
		return RowPage{}, fmt.Errorf("runbook: list rows of %s: both After and Before are set; keep one", t)
	case !f.CreatedFrom.IsZero() && !f.CreatedTo.IsZero() && !f.CreatedFrom.Before(f.CreatedTo):
		return RowPage{}, fmt.Errorf("runbook: list rows of %s: the time range ends (%s) before it starts (%s)", t,
			f.CreatedTo.UTC().Format(time.RFC3339), f.CreatedFrom.UTC().Format(time.RFC3339))
	}
	sq, err := stateOf(ctx, db, t)
	if err != nil {
		return RowPage{}, err
	}
	sf := sqlq.RowListFilter{State: sqlq.ListState(f.State), Topic: f.Topic, OrderingKey: f.OrderingKey, CreatedFrom: f.CreatedFrom, CreatedTo: f.CreatedTo,
		ErrorContains: f.ErrorContains, Cause: f.Cause}
	if f.EventID != uuid.Nil {
		sf.EventID = f.EventID.String()
	}
	if f.TenantID != uuid.Nil {
		sf.TenantID = f.TenantID.String()
	}
	rows, err := queryStateRows(ctx, db, t, "list rows of", sq.ListRows(sf, f.After, f.Before, limit+1))
	if err != nil {
		return RowPage{}, err
	}
	p := RowPage{Rows: rows}
	more := len(p.Rows) > limit
	if more {
		p.Rows = p.Rows[:limit]
	}
	if f.Before > 0 {
		slices.Reverse(p.Rows)
	}
	if len(p.Rows) == 0 {
		return p, nil
	}
	first, last := p.Rows[0].Sequence, p.Rows[len(p.Rows)-1].Sequence
	if f.Before > 0 || more {
		p.Next = last
	}
	if f.After > 0 || (f.Before > 0 && more) {
		p.Prev = first
	}
	st := sq.CountRows(sf, first)
	if err := db.QueryRow(ctx, st.SQL, st.Args...).Scan(&p.Total, &p.Before); err != nil {
		return RowPage{}, dbError(t, "count the rows of", err)
	}
	return p, nil
}

// DeadCause is one group of dead rows: those whose last_error normalises
// alike (sqlq.CauseOf).
type DeadCause struct {
	// Cause is the normalised cause, "" for the rows without an error.
	Cause string `json:"cause"`
	// Rows counts the group's rows.
	Rows int64 `json:"rows"`
	// FirstDeadAt and LastDeadAt are the earliest and latest dead_at of
	// its rows.
	FirstDeadAt time.Time `json:"first_dead_at"`
	LastDeadAt  time.Time `json:"last_dead_at"`
	// LatestEventID, LatestTopic and LatestError are its latest row's
	// (the highest sequence).
	LatestEventID uuid.UUID `json:"latest_event_id"`
	LatestTopic   string    `json:"latest_topic"`
	LatestError   string    `json:"latest_error"`
}

// DeadCauses is DeadCausesOf's answer.
type DeadCauses struct {
	// Causes are the largest groups, the largest first.
	Causes []DeadCause `json:"causes"`
	// Groups counts every group, Rows every dead row matching the filter.
	Groups int64 `json:"groups"`
	Rows   int64 `json:"rows"`
}

// DeadCausesOf groups the dead rows of the table matching f (its Topic,
// TenantID, ErrorContains and AfterSequence; its Cause is ignored), in the
// table's relay mode (the rows Dead lists: in an ordered table the keyed
// rows a dead hold holds too, with the hold's error), by their normalised
// cause, and returns the limit (DefaultLimit when 0) largest groups. The
// cause costs some 20 µs a row: on a large table narrow by Topic, or run it
// under a statement timeout.
func (r *Runbook) DeadCausesOf(ctx context.Context, f DeadFilter, limit int) (DeadCauses, error) {
	if err := r.check(); err != nil {
		return DeadCauses{}, err
	}
	db, t := r.db, r.table
	limit, err := checkLimit(limit)
	if err != nil {
		return DeadCauses{}, err
	}
	sf, err := f.schemaFilter()
	if err != nil {
		return DeadCauses{}, err
	}
	sq, err := stateOf(ctx, db, t)
	if err != nil {
		return DeadCauses{}, err
	}
	st := sq.DeadCauses(sf, limit)
	rows, err := db.Query(ctx, st.SQL, st.Args...)
	if err != nil {
		return DeadCauses{}, dbError(t, "group the dead rows of", err)
	}
	defer rows.Close()
	out := DeadCauses{Causes: []DeadCause{}}
	for rows.Next() {
		var (
			c  DeadCause
			id string
		)
		if err := rows.Scan(&c.Cause, &c.Rows, &c.FirstDeadAt, &c.LastDeadAt, &out.Groups, &out.Rows, &id, &c.LatestTopic, &c.LatestError); err != nil {
			return DeadCauses{}, dbError(t, "group the dead rows of", err)
		}
		if c.LatestEventID, err = uuid.Parse(id); err != nil {
			return DeadCauses{}, fmt.Errorf("runbook: group the dead rows of %s: event_id %q: %w", t, id, err)
		}
		out.Causes = append(out.Causes, c)
	}
	if err := rows.Err(); err != nil {
		return DeadCauses{}, dbError(t, "group the dead rows of", err)
	}
	return out, nil
}

// RelayProcess is one relay process as its database sessions show it,
// grouped by application_name (the `outbox relay` daemon names its
// sessions "outbox-relay <host> <pid> <version>").
type RelayProcess struct {
	// ApplicationName is the sessions' application_name. A relay embedded
	// in an application names its leader session "outbox-relay <host>
	// <pid>" unless the pool's connections have a name of their own; ""
	// for a session without any.
	ApplicationName string `json:"application_name"`
	// Sessions counts its database sessions.
	Sessions int `json:"sessions"`
	// Since is the start of its oldest session.
	Since time.Time `json:"since"`
	// ClientAddrs are its client addresses, comma-separated; empty for a
	// Unix socket, or without the pg_read_all_stats role.
	ClientAddrs string `json:"client_addrs,omitempty"`
	// Leader is true when one of its sessions holds the table's
	// single-active lock (default mode): it is the active relay, the
	// others are standbys or relays of other tables.
	Leader bool `json:"leader"`
	// PID is the server process id of the session holding the lock, else
	// of its oldest session: PostgreSQL's pid, not the relay's.
	PID int32 `json:"pid"`
}

// PartitionOwner is an ordered relay and the partitions it owns.
type PartitionOwner struct {
	// Owner is the relay's id (host-pid-random).
	Owner string `json:"owner"`
	// Partitions are the partitions it owns.
	Partitions []int32 `json:"partitions"`
	// LeaseUntil is when its latest lease ends.
	LeaseUntil time.Time `json:"lease_until"`
	// Live is false when one of its leases expired: the relay stopped
	// renewing, and another takes its partitions.
	Live bool `json:"live"`
}

// WALSlot is the replication slot a WAL relay reads and who reads it.
type WALSlot struct {
	// Name is the slot's name.
	Name string `json:"name"`
	// Active is true when a relay reads it now.
	Active bool `json:"active"`
	// ActivePID is the server pid of the reading session, 0 when none.
	ActivePID int32 `json:"active_pid,omitempty"`
	// ApplicationName and ClientAddr are the reading session's.
	ApplicationName string `json:"application_name,omitempty"`
	ClientAddr      string `json:"client_addr,omitempty"`
}

// RelayList is every relay alive on a table as the database shows it.
type RelayList struct {
	// Mode is the table's relay mode.
	Mode schema.Mode `json:"mode"`
	// Processes are the relay processes connected to the database (every
	// table's: a relay of another table shows too) and the holder of this
	// table's single-active lock, the leader first.
	Processes []RelayProcess `json:"processes"`
	// Owners are the ordered relays owning partitions (ordered mode).
	Owners []PartitionOwner `json:"owners,omitempty"`
	// Slot is the table's replication slot under its default name
	// (schema.WALSlotName), nil when there is none (WAL mode).
	Slot *WALSlot `json:"slot,omitempty"`
}

// Relays lists the relays alive on the table: the relay processes' sessions
// (pg_stat_activity) with the holder of the single-active lock, the ordered
// relays owning partitions, and the session reading the WAL slot. Reading
// other sessions' client address needs the pg_read_all_stats role or
// superuser.
func (r *Runbook) Relays(ctx context.Context) (RelayList, error) {
	if err := r.check(); err != nil {
		return RelayList{}, err
	}
	db, t := r.db, r.table
	sq, err := stateOf(ctx, db, t)
	if err != nil {
		return RelayList{}, err
	}
	out := RelayList{Mode: sq.Mode}
	st := sqlq.RelaySessions(t)
	rows, err := db.Query(ctx, st.SQL, st.Args...)
	if err != nil {
		return RelayList{}, dbError(t, "list the relay sessions of", err)
	}
	out.Processes, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (RelayProcess, error) {
		var p RelayProcess
		var since *time.Time
		err := r.Scan(&p.ApplicationName, &p.Sessions, &since, &p.ClientAddrs, &p.Leader, &p.PID)
		if since != nil {
			p.Since = *since
		}
		return p, err
	})
	if err != nil {
		return RelayList{}, dbError(t, "list the relay sessions of", err)
	}
	switch sq.Mode {
	case schema.ModeOrdered:
		rows, err := db.Query(ctx, sqlq.PartitionOwners(t))
		if err != nil {
			return RelayList{}, dbError(t, "list the partition owners of", err)
		}
		out.Owners, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (PartitionOwner, error) {
			var o PartitionOwner
			var until *time.Time
			var live *bool
			err := r.Scan(&o.Owner, &o.Partitions, &until, &live)
			if until != nil {
				o.LeaseUntil = *until
			}
			o.Live = live != nil && *live
			return o, err
		})
		if err != nil {
			return RelayList{}, dbError(t, "list the partition owners of", err)
		}
	case schema.ModeWAL:
		if out.Slot, err = r.WALSlotReader(ctx); err != nil {
			return RelayList{}, err
		}
	}
	return out, nil
}

// WALSlotReader returns the table's replication slot under its default name
// (schema.WALSlotName) and the session reading it, nil when there is no
// such slot.
func (r *Runbook) WALSlotReader(ctx context.Context) (*WALSlot, error) {
	if err := r.check(); err != nil {
		return nil, err
	}
	db, t := r.db, r.table
	var (
		s   WALSlot
		pid *int32
	)
	err := db.QueryRow(ctx, sqlq.WALSlotReader, schema.WALSlotName(t)).Scan(&s.Name, &s.Active, &pid, &s.ApplicationName, &s.ClientAddr)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, dbError(t, "read the replication slot of", err)
	}
	if pid != nil {
		s.ActivePID = *pid
	}
	return &s, nil
}
