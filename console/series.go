package console

import (
	"context"
	"encoding/json"
	"html/template"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
)

// The overview's charts: with Config.ChartInterval set, a goroutine reads
// every table's counts (runbook.Runbook.Stats, the overview's own figures) each
// interval into a ring buffer per table, which /api/series serves as JSON
// and the overview draws as inline SVG.

// ChartWindowDefault is the default of Config.ChartWindow.
const ChartWindowDefault = time.Hour

// ChartIntervalDaemon is the sampling interval of `outbox console` and of
// the console in the relay daemon.
const ChartIntervalDaemon = 10 * time.Second

// maxSamples bounds the samples kept per table, whatever the window and
// interval.
const maxSamples = 8640

// chartTimeout bounds one table's sample (PostgreSQL's statement_timeout):
// past it the sample is skipped and the chart has a gap.
const chartTimeout = 5 * time.Second

// sample is one reading of a table's counts.
type sample struct {
	At       time.Time `json:"at"`
	Pending  int64     `json:"pending"`
	Retrying int64     `json:"retrying"`
	Dead     int64     `json:"dead"`
	// PublishedPerMinute counts the rows published in the minute before
	// At (rows with published_at only: see runbook.TableStats).
	PublishedPerMinute int64 `json:"published_per_minute"`
}

// ring keeps the last len(buf) samples.
type ring struct {
	buf  []sample
	next int
	full bool
}

func (r *ring) add(s sample) {
	r.buf[r.next] = s
	r.next = (r.next + 1) % len(r.buf)
	if r.next == 0 {
		r.full = true
	}
}

// list returns the samples, oldest first.
func (r *ring) list() []sample {
	if !r.full {
		return append([]sample(nil), r.buf[:r.next]...)
	}
	return append(append([]sample(nil), r.buf[r.next:]...), r.buf[:r.next]...)
}

// sampler reads the counts of the tables every interval until closed.
type sampler struct {
	every, window time.Duration

	mu    sync.Mutex
	rings map[string]*ring

	cancel    context.CancelFunc
	done      chan struct{}
	closeOnce sync.Once
}

// startSampler starts sampling h's tables every h.cfg.ChartInterval.
func (h *handler) startSampler() {
	n := int(h.cfg.ChartWindow / h.cfg.ChartInterval)
	n = min(max(n, 2), maxSamples)
	s := &sampler{every: h.cfg.ChartInterval, window: h.cfg.ChartWindow, rings: map[string]*ring{}, done: make(chan struct{})}
	for _, name := range h.names {
		s.rings[name] = &ring{buf: make([]sample, n)}
	}
	ctx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	h.series = s
	go func() {
		defer close(s.done)
		for {
			start := time.Now()
			h.sampleAll(ctx)
			t := time.NewTimer(nextSample(s.every, time.Since(start)))
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
		}
	}()
}

// nextSample is the wait after a pass over the tables that took took: the
// interval, or four times the pass when that is longer, so that on tables
// whose counts are slow to read (a large backlog, a WAL table the cleaner
// lags behind) the console samples less often and never spends more than a
// fifth of its time reading them.
func nextSample(every, took time.Duration) time.Duration {
	return max(every, 4*took)
}

// close stops the sampling and waits for it; idempotent.
func (s *sampler) close() {
	s.closeOnce.Do(func() {
		s.cancel()
		<-s.done
	})
}

// sampleAll reads every table's counts once.
func (h *handler) sampleAll(ctx context.Context) {
	for _, name := range h.names {
		if ctx.Err() != nil {
			return
		}
		st, err := h.sampleOne(ctx, h.tables[name])
		if err != nil {
			if ctx.Err() == nil {
				h.logger.Info("Console could not sample the counts for its charts", watermill.LogFields{"table": name, "error": err.Error()})
			}
			continue
		}
		h.series.mu.Lock()
		h.series.rings[name].add(sample{At: h.now().UTC(), Pending: st.Pending, Retrying: st.Retrying, Dead: st.Dead, PublishedPerMinute: st.PublishedLastMinute})
		h.series.mu.Unlock()
	}
}

// sampleOne reads one table's counts in a read-only transaction bounded by
// chartTimeout.
func (h *handler) sampleOne(ctx context.Context, t schema.Table) (runbook.TableStats, error) {
	var st runbook.TableStats
	err := pgx.BeginTxFunc(ctx, h.pool, pgx.TxOptions{AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT set_config('statement_timeout', $1, true)`, strconv.FormatInt(chartTimeout.Milliseconds(), 10)); err != nil {
			return err
		}
		var err error
		st, err = runbook.New(tx, t).Stats(ctx)
		return err
	})
	return st, err
}

// samples returns a table's samples, oldest first; nil without sampling.
func (h *handler) samples(name string) []sample {
	if h.series == nil {
		return nil
	}
	h.series.mu.Lock()
	defer h.series.mu.Unlock()
	if r := h.series.rings[name]; r != nil {
		return r.list()
	}
	return nil
}

// seriesJSON is the answer of /api/series.
type seriesJSON struct {
	// IntervalSeconds is the sampling interval, 0 when the console does
	// not sample (Config.ChartInterval).
	IntervalSeconds float64 `json:"interval_seconds"`
	// WindowSeconds is how far back the samples go at most.
	WindowSeconds float64 `json:"window_seconds"`
	// Tables are each table's samples, oldest first.
	Tables map[string][]sample `json:"tables"`
}

// apiSeries serves every table's samples as JSON.
func (h *handler) apiSeries(w http.ResponseWriter, _ *http.Request) {
	out := seriesJSON{Tables: map[string][]sample{}}
	if h.series != nil {
		out.IntervalSeconds, out.WindowSeconds = h.series.every.Seconds(), h.series.window.Seconds()
	}
	for _, n := range h.names {
		out.Tables[n] = h.samples(n)
		if out.Tables[n] == nil {
			out.Tables[n] = []sample{}
		}
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(out)
}

// chart is one table's charts on the overview.
type chart struct {
	Name               string
	Throughput, States template.HTML
	Samples            int
	Interval, Window   string
	DeliveryTimesKnown bool
	// Last is the latest sample, nil before the first.
	Last *sample
}

// charts renders the charts of the tables in views, nil without sampling.
func (h *handler) charts(views []tableView) []chart {
	if h.series == nil {
		return nil
	}
	now := h.now()
	var out []chart
	for _, v := range views {
		ss := h.samples(v.Name)
		c := chart{Name: v.Name, Samples: len(ss), Interval: h.series.every.String(), Window: duration(h.series.window.Seconds()),
			DeliveryTimesKnown: v.Err != "" || v.Stats.DeliveryTimesKnown}
		if len(ss) > 0 {
			c.Last = &ss[len(ss)-1]
		}
		from := now.Add(-h.series.window)
		pick := func(f func(sample) int64) []point {
			ps := make([]point, 0, len(ss))
			for _, s := range ss {
				if !s.At.Before(from) {
					ps = append(ps, point{s.At, f(s)})
				}
			}
			return ps
		}
		c.Throughput = svgChart("published per minute", from, now, []line{{"published", pick(func(s sample) int64 { return s.PublishedPerMinute })}})
		c.States = svgChart("rows by state", from, now, []line{
			{"pending", pick(func(s sample) int64 { return s.Pending })},
			{"retrying", pick(func(s sample) int64 { return s.Retrying })},
			{"dead", pick(func(s sample) int64 { return s.Dead })},
		})
		out = append(out, c)
	}
	return out
}

// point is one value of a line at a time.
type point struct {
	At time.Time
	V  int64
}

// line is one series of a chart; Class names it (and its colour in the
// style sheet).
type line struct {
	Class  string
	Points []point
}

// The geometry of a chart, in SVG user units.
const (
	chartW, chartH             = 470, 118
	plotLeft, plotRight        = 44, 462
	plotTop, plotBottom        = 8, 96
	chartLabelY, chartTickEdge = 112, 4
)

// svgChart draws lines over [from, to] as an inline SVG: a y axis from 0
// to a round maximum, the time axis labelled in minutes before now, a
// polyline per line and a dot at its latest value. Only numbers and fixed
// words go into the markup.
func svgChart(title string, from, to time.Time, lines []line) template.HTML {
	var top int64
	for _, l := range lines {
		for _, p := range l.Points {
			top = max(top, p.V)
		}
	}
	top = roundUp(top)
	span := to.Sub(from).Seconds()
	x := func(t time.Time) float64 {
		return plotLeft + (plotRight-plotLeft)*min(max(t.Sub(from).Seconds()/span, 0), 1)
	}
	y := func(v int64) float64 { return plotBottom - (plotBottom-plotTop)*float64(v)/float64(top) }
	f := func(v float64) string { return strconv.FormatFloat(v, 'f', 1, 64) }
	var b strings.Builder
	b.WriteString(`<svg class="chart" viewBox="0 0 ` + strconv.Itoa(chartW) + ` ` + strconv.Itoa(chartH) + `" width="` + strconv.Itoa(chartW) + `" height="` + strconv.Itoa(chartH) +
		`" role="img" aria-label="` + title + `">`)
	// Grid and y labels: 0, half, top.
	for _, v := range []int64{0, top / 2, top} {
		b.WriteString(`<line class="grid" x1="` + f(plotLeft) + `" x2="` + f(plotRight) + `" y1="` + f(y(v)) + `" y2="` + f(y(v)) + `"/>`)
		b.WriteString(`<text class="ylabel" x="` + f(plotLeft-chartTickEdge) + `" y="` + f(y(v)+3) + `" text-anchor="end">` + strconv.FormatInt(v, 10) + `</text>`)
	}
	// Time labels: the window's start, middle and now.
	for i, lbl := range []string{"-" + ago(span), "-" + ago(span/2), "now"} {
		at := from.Add(time.Duration(float64(i) / 2 * span * float64(time.Second)))
		anchor := []string{"start", "middle", "end"}[i]
		b.WriteString(`<text class="xlabel" x="` + f(x(at)) + `" y="` + strconv.Itoa(chartLabelY) + `" text-anchor="` + anchor + `">` + lbl + `</text>`)
	}
	for _, l := range lines {
		if len(l.Points) == 0 {
			continue
		}
		pts := make([]string, len(l.Points))
		for i, p := range l.Points {
			pts[i] = f(x(p.At)) + "," + f(y(p.V))
		}
		b.WriteString(`<polyline class="s-` + l.Class + `" data-series="` + l.Class + `" points="` + strings.Join(pts, " ") + `"/>`)
		last := l.Points[len(l.Points)-1]
		b.WriteString(`<circle class="s-` + l.Class + `" cx="` + f(x(last.At)) + `" cy="` + f(y(last.V)) + `" r="2.5"><title>` + l.Class + `: ` + strconv.FormatInt(last.V, 10) + `</title></circle>`)
	}
	b.WriteString(`</svg>`)
	return template.HTML(b.String()) //nolint:gosec // numbers and the fixed words of svgChart's callers only
}

// ago writes a number of seconds on a time axis: "45s", "30m", "2h".
func ago(seconds float64) string {
	switch s := int64(seconds); {
	case s < 120:
		return strconv.FormatInt(s, 10) + "s"
	case s < 7200:
		return strconv.FormatInt(s/60, 10) + "m"
	default:
		return strconv.FormatInt(s/3600, 10) + "h"
	}
}

// roundUp rounds a chart's maximum up to 1, 2 or 5 times a power of ten,
// at least 4 so that the axis has room.
func roundUp(v int64) int64 {
	if v < 4 {
		return 4
	}
	for p := int64(1); ; p *= 10 {
		for _, m := range []int64{1, 2, 5} {
			if m*p >= v {
				return m * p
			}
		}
	}
}
