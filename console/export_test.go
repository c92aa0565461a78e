package console

import (
	"net/http"
	"time"
)

// SetCausesTimeout sets the time the grouping by cause of the console h
// may take.
func SetCausesTimeout(h http.Handler, d time.Duration) { h.(*Console).causesTimeout = d }

// NextSample is the wait of the charts' sampler after a pass that took
// took.
func NextSample(every, took time.Duration) time.Duration { return nextSample(every, took) }

// Relative is how the console writes an age: "3m 12s ago", "in 40s".
func Relative(d time.Duration) string { return relative(d) }

// Duration is how the console writes a length in seconds: "2.5s", "3m 12s".
func Duration(seconds float64) string { return duration(seconds) }
