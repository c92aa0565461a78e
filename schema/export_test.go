package schema

// AvailableAtDownSQL exposes availableAtDownSQL to the external tests.
var AvailableAtDownSQL = availableAtDownSQL

// PausedTopicsDownSQL exposes pausedTopicsDownSQL to the external tests.
var PausedTopicsDownSQL = pausedTopicsDownSQL

// ReplayJobsDownSQL exposes replayJobsDownSQL to the external tests.
var ReplayJobsDownSQL = replayJobsDownSQL

// MaxIdentifierBytes exposes maxIdentifierBytes to the external tests.
var MaxIdentifierBytes = maxIdentifierBytes

// OrderedRewriteMaxRows exposes orderedRewriteMaxRows to the external tests.
var OrderedRewriteMaxRows = orderedRewriteMaxRows
