package runbook

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/schema"
)

// HoldState is where the hold of an ordering key is in its lifecycle, in
// either keyed mode: the ordered relay and the WAL relay keep their holds
// in one table (<table>_holds), whose state column HeldKeys reads; Allows says
// which operator actions it accepts. The runbook (SkipEvent, ReplayEvent),
// the CLI (`outbox keys held`, `outbox dead skip|replay`) and the console
// (the held keys page, the event page) all decide with Allows, so they
// cannot disagree. docs/ORDERING.md, docs/WAL.md and docs/OPERATIONS.md
// carry the same table, rendered from the rules and checked by a test.
//
// It encodes as a lowercase word in JSON and text.
type HoldState int

// The hold states. Each says what the relay does next and whether it waits
// for an operator.
const (
	// HoldRetrying: the held row failed and is tried again; the key's
	// later rows wait. Ordered mode: at AvailableAt. WAL: the relay keeps
	// a retry in memory and writes this hold only when the key's backlog
	// behind the retrying row grows past its read-ahead (the rows are
	// spilled to the table); it retries the row at its backoff, or at once
	// after a restart, and a replay delivers it now.
	HoldRetrying HoldState = iota + 1
	// HoldDead: the held row failed for good (MaxAttempts, or a permanent
	// error); the key waits for an operator: replay or skip.
	HoldDead
	// HoldSkipRequested: an operator asked to skip the held row; the
	// relay that owns the key applies it at its next tick and the hold
	// moves on (ordered) or drains (WAL).
	HoldSkipRequested
	// HoldReplay: an operator's replay is pending, delivered before the
	// key's next row. Ordered mode: a replay hold, the replay of a row
	// already relayed (it covers nothing). WAL: the dead row that holds
	// the key was reset by a replay and is being delivered again (its
	// retries are in memory until it is dead again). A skip does not
	// recall a copy already in a handler (or, WAL, already streamed).
	HoldReplay
	// HoldDraining (WAL only): the held row was delivered again or
	// skipped, and the key's parked rows are being delivered from the
	// table; then the hold is resolved. The ordered relay moves a hold
	// straight to the key's next row instead.
	HoldDraining
	// HoldResolved: a tombstone. The held row succeeded or was skipped
	// and its key's rows up to the hold are done; it is kept until the
	// relay's progress passes it (ordered: the partition's written floor;
	// WAL: the confirmed position after the drain), then deleted. HeldKeys
	// does not list it; ListHolds with Resolved does.
	HoldResolved
)

// holdStates are the hold states in lifecycle order.
var holdStates = []HoldState{HoldRetrying, HoldDead, HoldSkipRequested, HoldReplay, HoldDraining, HoldResolved}

var holdStateWords = map[HoldState]string{
	HoldRetrying:      sqlq.HoldWordRetrying,
	HoldDead:          sqlq.HoldWordDead,
	HoldSkipRequested: sqlq.HoldWordSkipRequested,
	HoldReplay:        sqlq.HoldWordReplay,
	HoldDraining:      sqlq.HoldWordDraining,
	HoldResolved:      sqlq.HoldWordResolved,
}

// String returns the state's lowercase word ("retrying", "dead",
// "skip_requested", "replay", "draining", "resolved"), or "unknown".
func (s HoldState) String() string {
	if w, ok := holdStateWords[s]; ok {
		return w
	}
	return "unknown"
}

// Label is the state as the console and the CLI's table show it: the word
// with spaces ("skip requested").
func (s HoldState) Label() string { return strings.ReplaceAll(s.String(), "_", " ") }

// MarshalText writes the state's word.
func (s HoldState) MarshalText() ([]byte, error) {
	if _, ok := holdStateWords[s]; !ok {
		return nil, fmt.Errorf("runbook: hold state %d has no name", int(s))
	}
	return []byte(s.String()), nil
}

// UnmarshalText reads a state's word.
func (s *HoldState) UnmarshalText(b []byte) error {
	p, err := parseHoldState(string(b))
	if err != nil {
		return err
	}
	*s = p
	return nil
}

// parseHoldState returns the state named by word (String's output).
func parseHoldState(word string) (HoldState, error) {
	for s, w := range holdStateWords {
		if w == word {
			return s, nil
		}
	}
	return 0, fmt.Errorf("runbook: unknown hold state %q", word)
}

// inMode reports whether mode m has the state: ordered mode has every
// state but draining, the WAL relay every state; the default mode holds no
// key.
func (s HoldState) inMode(m schema.Mode) bool {
	switch m {
	case schema.ModeOrdered:
		return s != HoldDraining && s.valid()
	case schema.ModeWAL:
		return s.valid()
	}
	return false
}

func (s HoldState) valid() bool { _, ok := holdStateWords[s]; return ok }

// HoldOp is an operator's action on a held key's row.
type HoldOp int

// The operator actions on a hold.
const (
	// OpSkip drops the held row from its key's order (SkipEvent, `outbox
	// dead skip`, the console's Skip button).
	OpSkip HoldOp = iota + 1
	// OpReplay delivers the held row again (ReplayEvent, `outbox dead
	// replay`, the console's Replay button).
	OpReplay
)

// holdOps are the operator actions, in the order of the rules table.
var holdOps = []HoldOp{OpSkip, OpReplay}

// String returns "skip" or "replay".
func (o HoldOp) String() string {
	switch o {
	case OpSkip:
		return "skip"
	case OpReplay:
		return "replay"
	}
	return "unknown"
}

// ErrHoldRefused is matched (errors.Is) by every *HoldRuleError: the
// hold's state does not accept the action. Nothing was changed.
var ErrHoldRefused = errors.New("runbook: the hold's state does not accept this action")

// HoldRuleError is why a hold's state refuses an action, and what to do
// instead. It matches ErrHoldRefused, and ErrNotHeld for a skip of a
// resolved hold (the row holds its key no more).
type HoldRuleError struct {
	// State is the hold's state, Op the action refused.
	State HoldState
	Op    HoldOp
	// Why says why, Do what to do instead.
	Why, Do string
}

// Error says the state, why the action is refused and what to do.
func (e *HoldRuleError) Error() string {
	return fmt.Sprintf("its ordering key is held by a hold in state %s, which refuses %s: %s; %s", e.State, e.Op, e.Why, e.Do)
}

// Is matches ErrHoldRefused, and ErrNotHeld for a skip of a resolved hold.
func (e *HoldRuleError) Is(target error) bool {
	return target == ErrHoldRefused || (target == ErrNotHeld && e.Op == OpSkip && e.State == HoldResolved)
}

// holdRule is one refusal of the rules table.
type holdRule struct {
	why, do string
}

// holdRefusals is the rules table: every (state, action) pair not in it is
// allowed. It is the only place that decides.
var holdRefusals = map[HoldState]map[HoldOp]holdRule{
	HoldSkipRequested: {
		OpSkip: {"a skip was already requested", "the relay applies it at its next tick; list the held keys again"},
		OpReplay: {"the relay is applying a skip",
			"once the hold is resolved (the skip applied) replay the row: it is then delivered once more"},
	},
	HoldReplay: {
		OpReplay: {"a replay is already pending", "the relay delivers the row before its key's next row; if it fails for good the hold is dead and can be replayed again"},
	},
	HoldDraining: {
		OpSkip: {"the held row was already delivered again or skipped, and its key's parked rows are being delivered",
			"wait until the hold is resolved; a later row that fails for good holds the key again and can be skipped then"},
		OpReplay: {"the key's parked rows are being delivered",
			"wait until the hold is resolved, then replay the row: a replay is then delivered as new work"},
	},
	HoldResolved: {
		OpSkip: {"it holds nothing any more: the key's rows up to it are done", "nothing to skip"},
	},
}

// Allows returns nil when a hold in state s accepts the action op, and
// otherwise a *HoldRuleError that says why not and what to do. The rules
// (docs/ORDERING.md, "Hold states"):
//
//	state           skip     replay
//	retrying        yes      yes (due now, attempts reset)
//	dead            yes      yes
//	skip_requested  no       no
//	replay          yes      no
//	draining        no       no
//	resolved        no       yes
//
// A state a mode does not have is never read there. An allowed action can
// still be refused for a reason of the row's own (ReplayEvent: a row a
// relay leases; ordered mode: a resolved hold above its partition's
// written floor, ErrNotRelayedYet, until the relay writes its floor: at its next
// tick, or up to LockTTL/10 later while the xmin horizon is pinned).
func (s HoldState) Allows(op HoldOp) error {
	if !s.valid() {
		return &HoldRuleError{State: s, Op: op, Why: "the state is unknown", Do: "upgrade the outbox command or library"}
	}
	if op != OpSkip && op != OpReplay {
		return &HoldRuleError{State: s, Op: op, Why: "the action is unknown", Do: "use skip or replay"}
	}
	if r, ok := holdRefusals[s][op]; ok {
		return &HoldRuleError{State: s, Op: op, Why: r.why, Do: r.do}
	}
	return nil
}

// walReplayRule is the one hold rule of a replay in a WAL table, which
// every replay path applies (ReplayEvent, and so the CLI and the console's
// ticked rows; ReplayDead by topic, by cause or with a preview's snapshot,
// through the guard of its statement, walReplayGuard): a row whose key
// has a hold in state s may be replayed when the hold's state allows a
// replay (Allows) if the row is the held one (held), and otherwise unless
// the hold drains: its key's parked rows are being delivered from the
// table, and the relay would take the row's replay for the stream's copy
// of a drained row (docs/WAL.md, "Hold states"). It refuses with Allows'
// error.
func walReplayRule(s HoldState, held bool) error {
	if !held && s != HoldDraining {
		return nil
	}
	return s.Allows(OpReplay)
}

// walReplayGuard is walReplayRule as the states a replay statement of the
// WAL table t accepts (sqlq.WALReplayRule).
func walReplayGuard(t schema.Table) sqlq.WALReplayRule {
	r := sqlq.WALReplayRule{Table: t}
	for _, s := range holdStates {
		if walReplayRule(s, true) == nil {
			r.Held = append(r.Held, s.String())
		}
		if walReplayRule(s, false) == nil {
			r.Others = append(r.Others, s.String())
		}
	}
	return r
}

// statesAllowing lists the words of the states that accept op, for the
// guards of the statements that apply it.
func statesAllowing(op HoldOp) []string {
	var out []string
	for _, s := range holdStates {
		if s.Allows(op) == nil {
			out = append(out, s.String())
		}
	}
	return out
}

// holdRulesTable renders the rules as the Markdown table that
// docs/ORDERING.md, docs/WAL.md and docs/OPERATIONS.md carry (a test
// checks that each of them contains it).
func holdRulesTable() string {
	var b strings.Builder
	b.WriteString("| state | ordered | WAL | skip | replay |\n|---|---|---|---|---|\n")
	yes := func(ok bool) string {
		if ok {
			return "yes"
		}
		return "no"
	}
	for _, s := range holdStates {
		fmt.Fprintf(&b, "| `%s` | %s | %s |", s, yes(s.inMode(schema.ModeOrdered)), yes(s.inMode(schema.ModeWAL)))
		for _, op := range holdOps {
			if err := s.Allows(op); err != nil {
				var re *HoldRuleError
				_ = errors.As(err, &re)
				fmt.Fprintf(&b, " refused: %s |", re.Why)
			} else {
				b.WriteString(" allowed |")
			}
		}
		b.WriteString("\n")
	}
	return b.String()
}

// skipWALDeadRow is SkipEvent for a dead keyed row of a WAL table with no
// hold at it (a tombstone at it refuses the skip by the hold rules until
// the relay deletes it): the WAL relay parks a failed replay
// of a row its key went past dead without holding the key (a failed
// replay holds only its own row), and keeps nothing of it but the row's
// columns, so the skip is applied on the row at once (skipped_at,
// EventSkip.Applied), as the row's state machine says: dead -> skipped.
// ok is false when the row is not such a row (nothing changed); the
// caller then refuses as for a row that holds no key.
func skipWALDeadRow(ctx context.Context, db DB, t schema.Table, eventID uuid.UUID, dryRun bool) (res EventSkip, ok bool, err error) {
	res = EventSkip{Table: t.String(), Applied: !dryRun, DryRun: dryRun,
		Statement: Statement{SQL: sqlq.WALSkipDeadRow(t), Args: []any{eventID.String()}}}
	sql := res.Statement.SQL
	if dryRun {
		sql = sqlq.WALDeadRowUnheld(t)
	}
	err = db.QueryRow(ctx, sql, eventID.String()).Scan(&res.Key, &res.Sequence)
	if errors.Is(err, pgx.ErrNoRows) {
		return EventSkip{}, false, nil
	}
	if err != nil {
		return EventSkip{}, false, dbError(t, "skip event "+eventID.String()+" of", err)
	}
	if !dryRun {
		res.Changed = 1
	}
	return res, true, nil
}
