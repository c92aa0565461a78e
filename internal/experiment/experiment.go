// Package experiment holds switches for prototypes that are not part of the
// public API: the benchmark turns them on to measure a prototype beside the
// default behaviour in one run. Every switch is off by default.
package experiment

import "sync/atomic"

// BoundedClaim makes subscriber.New build subscribers whose default-mode
// claims (AllTopics, not ordered) take a lower bound and are backed by a
// periodic unbounded sweep (subscriber/boundedclaim.go, docs/XMIN.md,
// option c). It is read when a subscriber is created.
var BoundedClaim atomic.Bool
