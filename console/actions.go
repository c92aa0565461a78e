package console

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"

	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
)

// held lists the held keys of an ordered table, each with a skip button.
func (h *handler) held(w http.ResponseWriter, r *http.Request) {
	t, ok := h.table(w, r)
	if !ok {
		return
	}
	keys, err := runbook.HeldKeys(r.Context(), h.pool, t, maxHeldShown)
	if err != nil {
		h.logger.Error("Console could not list held keys", err, watermill.LogFields{"table": t.String()})
		http.Error(w, "cannot list the held keys (see the console's log)", http.StatusInternalServerError)
		return
	}
	h.render(w, r, "held.html", "Held keys of "+t.String(), struct {
		Table  string
		Keys   []runbook.HeldKey
		Capped bool
		Flash  string
	}{t.String(), keys, len(keys) == maxHeldShown, flash(r)})
}

// topics shows the backlog by topic.
func (h *handler) topics(w http.ResponseWriter, r *http.Request) {
	t, ok := h.table(w, r)
	if !ok {
		return
	}
	list, err := runbook.Topics(r.Context(), h.pool, t, maxTopicsShown)
	if err != nil {
		h.logger.Error("Console could not count the backlog by topic", err, watermill.LogFields{"table": t.String()})
		http.Error(w, "cannot count the backlog by topic (see the console's log)", http.StatusInternalServerError)
		return
	}
	h.render(w, r, "topics.html", "Backlog by topic of "+t.String(), struct {
		Table  string
		Topics []runbook.TopicBacklog
	}{t.String(), list})
}

// maxTopicsShown bounds the topics of the backlog page.
const maxTopicsShown = 500

// actionFields are the log fields of a state-changing request.
func actionFields(r *http.Request, action, table string) watermill.LogFields {
	return watermill.LogFields{"who": "token holder", "remote": r.RemoteAddr, "action": action, "table": table}
}

// eventAction checks a state-changing request on one event (the table, the
// token, CSRF and origin, the event id) and returns its log fields; it
// writes the refusal and returns false when the request may not go on.
func (h *handler) eventAction(w http.ResponseWriter, r *http.Request, action string) (schema.Table, uuid.UUID, watermill.LogFields, bool) {
	t, ok := h.table(w, r)
	if !ok || !h.allow(w, r) {
		return t, uuid.Nil, nil, false
	}
	id, err := uuid.Parse(r.PathValue("id"))
	if err != nil {
		http.Error(w, "the event id must be a UUID", http.StatusBadRequest)
		return t, uuid.Nil, nil, false
	}
	fields := actionFields(r, action, t.String())
	fields["event_id"] = id.String()
	return t, id, fields, true
}

// skip asks the relays to skip the row that holds its ordering key
// (runbook.SkipEvent).
func (h *handler) skip(w http.ResponseWriter, r *http.Request) {
	t, id, fields, ok := h.eventAction(w, r, "skip")
	if !ok {
		return
	}
	res, err := runbook.SkipEvent(r.Context(), h.pool, t, id, false)
	if err != nil {
		h.logger.Info("Console skip refused", fields)
		http.Error(w, "not skipped: "+err.Error(), http.StatusConflict)
		return
	}
	fields["ordering_key"] = res.Key
	h.logger.Info("Console skip", fields)
	http.Redirect(w, r, "/t/"+url.PathEscape(t.String())+"/held?done=skip-requested", http.StatusSeeOther)
}

// bulkFilter reads the filter of a bulk replay from a form or a query.
func bulkFilter(v url.Values) runbook.DeadFilter {
	return runbook.DeadFilter{Topic: v.Get("topic"), ErrorContains: v.Get("error"), AllTopics: v.Get("topic") == ""}
}

// preview shows how many dead rows a bulk replay of the filter would
// change now, and the form that confirms that exact count.
func (h *handler) preview(w http.ResponseWriter, r *http.Request) {
	t, ok := h.table(w, r)
	if !ok {
		return
	}
	f := bulkFilter(r.URL.Query())
	p, err := runbook.ReplayDead(r.Context(), h.pool, t, f, true)
	if err != nil {
		h.logger.Error("Console could not preview a bulk replay", err, watermill.LogFields{"table": t.String()})
		http.Error(w, "cannot preview the replay (see the console's log)", http.StatusInternalServerError)
		return
	}
	h.render(w, r, "preview.html", "Replay dead rows of "+t.String(), struct {
		Table        string
		Topic, Error string
		Snapshot     runbook.ReplaySnapshot
	}{t.String(), f.Topic, f.ErrorContains, p.Snapshot})
}

// job is one bulk replay whose progress the console follows.
type job struct {
	Table    string
	Topic    string
	Error    string
	Rows     int64
	At       time.Time
	EventIDs []uuid.UUID
}

// bulkReplay replays the dead rows of a preview: exactly the previewed
// rows, and only when the operator typed their count.
func (h *handler) bulkReplay(w http.ResponseWriter, r *http.Request) {
	t, ok := h.table(w, r)
	if !ok || !h.allow(w, r) {
		return
	}
	f := bulkFilter(r.PostForm)
	var (
		snap runbook.ReplaySnapshot
		errs []error
	)
	snap.Rows, errs = parseInt(r.PostFormValue("rows"), errs)
	snap.MaxSequence, errs = parseInt(r.PostFormValue("max_sequence"), errs)
	snap.Digest = r.PostFormValue("digest")
	confirm, errs := parseInt(r.PostFormValue("confirm"), errs)
	if len(errs) > 0 {
		http.Error(w, "the replay form is incomplete: preview again", http.StatusBadRequest)
		return
	}
	if confirm != snap.Rows {
		http.Error(w, "type the number of rows the preview counted ("+strconv.FormatInt(snap.Rows, 10)+") to confirm; nothing changed", http.StatusBadRequest)
		return
	}
	f.Expect = &snap
	fields := actionFields(r, "bulk replay", t.String())
	fields["topic"], fields["error_contains"], fields["expected_rows"] = f.Topic, f.ErrorContains, snap.Rows
	res, err := runbook.ReplayDead(r.Context(), h.pool, t, f, false)
	if errors.Is(err, runbook.ErrReplaySetChanged) {
		h.logger.Info("Console bulk replay refused: the rows changed since the preview", fields)
		http.Error(w, "not replayed: "+err.Error(), http.StatusConflict)
		return
	}
	if err != nil {
		h.logger.Error("Console bulk replay failed", err, fields)
		http.Error(w, "not replayed (see the console's log)", http.StatusInternalServerError)
		return
	}
	fields["changed"] = res.Rows
	h.logger.Info("Console bulk replay", fields)
	id := h.addJob(&job{Table: t.String(), Topic: f.Topic, Error: f.ErrorContains, Rows: res.Rows, At: time.Now(), EventIDs: res.EventIDs})
	http.Redirect(w, r, "/t/"+url.PathEscape(t.String())+"/replay/"+id, http.StatusSeeOther)
}

func parseInt(s string, errs []error) (int64, []error) {
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		errs = append(errs, err)
	}
	return n, errs
}

func (h *handler) addJob(j *job) string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	id := hex.EncodeToString(b[:])
	h.jobsMu.Lock()
	defer h.jobsMu.Unlock()
	h.jobs[id] = j
	h.order = append(h.order, id)
	if len(h.order) > maxJobs {
		delete(h.jobs, h.order[0])
		h.order = h.order[1:]
	}
	return id
}

func (h *handler) job(w http.ResponseWriter, r *http.Request) (*job, runbook.Progress, bool) {
	h.jobsMu.Lock()
	j := h.jobs[r.PathValue("job")]
	h.jobsMu.Unlock()
	if j == nil {
		http.Error(w, "no such replay: the console remembers its last "+strconv.Itoa(maxJobs)+" bulk replays since it started", http.StatusNotFound)
		return nil, runbook.Progress{}, false
	}
	p, err := runbook.ReplayProgress(r.Context(), h.pool, h.tables[j.Table], j.EventIDs)
	if err != nil {
		h.logger.Error("Console could not read a replay's progress", err, watermill.LogFields{"table": j.Table})
		http.Error(w, "cannot read the replay's progress (see the console's log)", http.StatusInternalServerError)
		return nil, runbook.Progress{}, false
	}
	return j, p, true
}

// jobPage shows a bulk replay's progress; the script refreshes it.
func (h *handler) jobPage(w http.ResponseWriter, r *http.Request) {
	if _, ok := h.table(w, r); !ok {
		return
	}
	j, p, ok := h.job(w, r)
	if !ok {
		return
	}
	h.render(w, r, "job.html", "Bulk replay of "+j.Table, struct {
		ID       string
		Job      *job
		Progress runbook.Progress
	}{r.PathValue("job"), j, p})
}

// jobProgress is the progress of a bulk replay as JSON.
func (h *handler) jobProgress(w http.ResponseWriter, r *http.Request) {
	_, p, ok := h.job(w, r)
	if !ok {
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(p)
}
