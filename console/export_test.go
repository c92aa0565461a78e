package console

import (
	"net/http"
	"time"
)

// SetCausesTimeout sets the time the grouping by cause of the console h
// may take.
func SetCausesTimeout(h http.Handler, d time.Duration) { h.(*Console).causesTimeout = d }
