package runbook

import "github.com/outboxkit/watermill-outbox/schema"

// What the package keeps to itself, named for its external tests
// (package runbook_test).
var (
	HoldStates     = holdStates
	ParseHoldState = parseHoldState
	HoldRulesTable = holdRulesTable
)

// HoldStateIn is s.inMode(m): whether mode m has the state.
func HoldStateIn(s HoldState, m schema.Mode) bool { return s.inMode(m) }
