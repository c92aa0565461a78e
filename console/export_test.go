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
