package sqlq

import (
	"context"
	"fmt"

	"github.com/outboxkit/watermill-outbox/schema"
)

// SwitchedAway reads t's recorded mode and reports whether it is recorded
// and not own: the table was switched away from the caller's mode. A
// relay that finds it so claims and streams nothing more (subscriber's
// mode fence, walrelay's standby); rec names the mode and who recorded it.
func SwitchedAway(ctx context.Context, q schema.Querier, t schema.Table, own schema.Mode) (rec schema.ModeRecord, away bool, err error) {
	rec, ok, err := schema.RecordedMode(ctx, q, t)
	if err != nil {
		return rec, false, fmt.Errorf("read the relay mode of %s: %w", t, err)
	}
	return rec, ok && rec.Mode != own, nil
}
