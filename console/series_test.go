package console_test

import (
	"context"
	"encoding/json"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/outboxkit/watermill-outbox/console"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
)

// seriesAnswer is the JSON of /api/series.
type seriesAnswer struct {
	IntervalSeconds float64 `json:"interval_seconds"`
	WindowSeconds   float64 `json:"window_seconds"`
	Tables          map[string][]struct {
		At                 time.Time `json:"at"`
		Pending            int64     `json:"pending"`
		Retrying           int64     `json:"retrying"`
		Dead               int64     `json:"dead"`
		PublishedPerMinute int64     `json:"published_per_minute"`
	} `json:"tables"`
}

func series(t *testing.T, base string) seriesAnswer {
	t.Helper()
	r := do(t, "GET", base+"/api/series", nil, nil)
	if r.code != 200 {
		t.Fatalf("/api/series: %d %s", r.code, r.body)
	}
	var s seriesAnswer
	if err := json.Unmarshal([]byte(r.body), &s); err != nil {
		t.Fatalf("/api/series: %v\n%s", err, r.body)
	}
	return s
}

var polyline = regexp.MustCompile(`<polyline class="s-(\w+)" data-series="\w+" points="([^"]*)"/>`)

// TestChartsFill: with ChartInterval set, the console samples every
// table's counts (runbook.Runbook.Stats) into /api/series, follows their changes,
// and draws them on the overview as inline SVG (published per minute;
// pending, retrying and dead), one point per sample; Close stops the
// sampling (the package's goleak check) and can be called twice. Without
// ChartInterval there are no samples and no charts.
func TestChartsFill(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox")
	ctx := context.Background()
	deadWith(t, pool, tbl, "org.a.v1", "permanent: bad", 2)
	h, err := console.New(pool, console.Config{Tables: []schema.Table{tbl}, ChartInterval: 100 * time.Millisecond, ChartWindow: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := h.Close(); err != nil {
			t.Error(err)
		}
		if err := h.Close(); err != nil {
			t.Errorf("second Close: %v", err)
		}
	}()
	srv := httptest.NewServer(h)
	defer srv.Close()
	name := tbl.String()

	waitSeries := func(what string, ok func(last int64, n int) bool) seriesAnswer {
		t.Helper()
		for deadline := time.Now().Add(2 * time.Minute); ; {
			s := series(t, srv.URL)
			ss := s.Tables[name]
			if len(ss) > 0 && ok(ss[len(ss)-1].Dead, len(ss)) {
				return s
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: the series never got there: %+v", what, ss)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	s := waitSeries("three samples of 2 dead rows", func(dead int64, n int) bool { return dead == 2 && n >= 3 })
	if s.IntervalSeconds != 0.1 || s.WindowSeconds != 60 {
		t.Errorf("interval %v s, window %v s; want 0.1 and 60", s.IntervalSeconds, s.WindowSeconds)
	}
	st, err := runbook.New(pool, tbl).Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	last := s.Tables[name][len(s.Tables[name])-1]
	if last.Pending != st.Pending || last.Retrying != st.Retrying || last.Dead != st.Dead || last.PublishedPerMinute != st.PublishedLastMinute {
		t.Errorf("latest sample %+v, runbook's Stats %+v", last, st)
	}
	for i := 1; i < len(s.Tables[name]); i++ {
		if !s.Tables[name][i].At.After(s.Tables[name][i-1].At) {
			t.Fatalf("samples out of order: %+v", s.Tables[name])
		}
	}
	// The counts change; the series follows.
	deadWith(t, pool, tbl, "org.a.v1", "permanent: worse", 3)
	s = waitSeries("5 dead rows", func(dead int64, _ int) bool { return dead == 5 })

	page := do(t, "GET", srv.URL+"/", nil, nil)
	if page.code != 200 || !strings.Contains(page.body, `<section class="charts" data-table="`+name+`">`) {
		t.Fatalf("overview without the charts: %d\n%s", page.code, page.body)
	}
	lines := map[string]int{}
	for _, m := range polyline.FindAllStringSubmatch(page.body, -1) {
		lines[m[1]] = len(strings.Fields(m[2]))
	}
	for _, l := range []string{"published", "pending", "retrying", "dead"} {
		if lines[l] < len(s.Tables[name]) {
			t.Errorf("the %s line has %d points, the series had %d samples before the page: %v", l, lines[l], len(s.Tables[name]), lines)
		}
	}
	if !strings.Contains(page.body, `<span class="key s-dead"></span>dead 5 `) {
		t.Errorf("the legend does not give the latest dead count (5):\n%s", page.body)
	}
	if !strings.Contains(page.body, `<svg class="chart"`) || strings.Contains(page.body, "&lt;svg") {
		t.Errorf("the chart is not inline SVG:\n%s", page.body)
	}

	// Without ChartInterval: no samples, no charts.
	plain := server(t, pool, tbl, "")
	if s := series(t, plain.URL); s.IntervalSeconds != 0 || len(s.Tables[name]) != 0 {
		t.Errorf("a console without charts answers %+v", s)
	}
	if body := do(t, "GET", plain.URL+"/", nil, nil).body; strings.Contains(body, `class="charts"`) {
		t.Error("a console without charts draws them")
	}
	if _, err := console.New(pool, console.Config{Tables: []schema.Table{tbl}, ChartInterval: time.Minute, ChartWindow: time.Second}); err == nil {
		t.Error("a window shorter than the interval was accepted")
	}
}

// TestChartsBackOffOnSlowReads: after a pass over the tables that took
// longer than a quarter of the interval, the sampler waits four times the
// pass, so it never spends more than a fifth of its time reading counts.
func TestChartsBackOffOnSlowReads(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ every, took, want time.Duration }{
		{10 * time.Second, 20 * time.Millisecond, 10 * time.Second},
		{10 * time.Second, 2500 * time.Millisecond, 10 * time.Second},
		{10 * time.Second, 4 * time.Second, 16 * time.Second},
		{time.Second, 5 * time.Second, 20 * time.Second},
	} {
		if got := console.NextSample(c.every, c.took); got != c.want {
			t.Errorf("interval %s, pass %s: wait %s, want %s", c.every, c.took, got, c.want)
		}
		if busy := float64(c.took) / float64(c.took+console.NextSample(c.every, c.took)); busy > 0.2 {
			t.Errorf("interval %s, pass %s: busy %.0f%% of the time", c.every, c.took, busy*100)
		}
	}
}
