package schema

import "github.com/outboxkit/watermill-outbox/internal/pgmeta"

// AvailableAtDownSQL exposes availableAtDownSQL to the external tests.
var AvailableAtDownSQL = availableAtDownSQL

// PausedTopicsDownSQL exposes pausedTopicsDownSQL to the external tests.
var PausedTopicsDownSQL = pausedTopicsDownSQL

// DeadNoticesDownSQL exposes deadNoticesDownSQL to the external tests.
var DeadNoticesDownSQL = deadNoticesDownSQL

// ReplayJobsDownSQL exposes replayJobsDownSQL to the external tests.
var ReplayJobsDownSQL = replayJobsDownSQL

// MaxIdentifierBytes exposes maxIdentifierBytes to the external tests.
var MaxIdentifierBytes = maxIdentifierBytes

// OrderedRewriteMaxRows exposes orderedRewriteMaxRows to the external tests.
var OrderedRewriteMaxRows = orderedRewriteMaxRows

// AvailableAtDefaultOf exposes availableAtDefaultOf to the external tests.
var AvailableAtDefaultOf = availableAtDefaultOf

// AvailableAtDefault is the default migration 000009 sets.
const AvailableAtDefault = pgmeta.ClaimBoundDefault
