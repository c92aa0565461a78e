package keyed

import (
	"errors"
	"fmt"

	"github.com/outboxkit/watermill-outbox/schema"
)

// Setting is one count or duration field of a relay's configuration.
type Setting struct {
	Name  string // the field's name, as the user writes it
	Value int64  // its value (a time.Duration's nanoseconds)
}

// CheckSettings is the rule every relay's configuration (the default
// relay with ordered mode, and the WAL relay) is checked with: a table
// (ErrNoTable), and for its count and duration fields, 0 takes the field's
// default, a positive value is used, a negative one is refused, with one
// error per field that names it and says what to do.
func CheckSettings(t schema.Table, settings ...Setting) error {
	var errs []error
	if t.IsZero() {
		errs = append(errs, ErrNoTable)
	}
	for _, s := range settings {
		if s.Value < 0 {
			errs = append(errs, fmt.Errorf("%s is negative; leave it 0 for the default or set a positive value", s.Name))
		}
	}
	return errors.Join(errs...)
}

// ErrNoTable is the error of a relay's configuration without a table.
var ErrNoTable = errors.New("config field Table is required; build it with schema.ParseTable")
