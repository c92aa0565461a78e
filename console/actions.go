package console

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
)

// held lists the held keys of a keyed table (ordered mode or the WAL
// relay), each with its hold's state and the buttons its state allows
// (runbook.HeldKey.CanSkip, CanReplay: the runbook's own rules) and, when
// it can be skipped, a box for the bulk skip; filtered by a text the key,
// topic or last error contains (?q=) and, with ?dead=1, to the dead holds.
func (h *handler) held(w http.ResponseWriter, r *http.Request) {
	t, ok := h.table(w, r)
	if !ok {
		return
	}
	rb := runbook.New(h.pool, t)
	keys, err := rb.HeldKeys(r.Context(), maxHeldShown)
	if err != nil {
		h.logger.Error("Console could not list held keys", err, watermill.LogFields{"table": t.String()})
		h.fail(w, r, http.StatusInternalServerError, "Cannot list the held keys (see the console's log).", "", "")
		return
	}
	mode, err := rb.Mode(r.Context())
	if err != nil {
		h.logger.Error("Console could not read a table's relay mode", err, watermill.LogFields{"table": t.String()})
		h.fail(w, r, http.StatusInternalServerError, "Cannot list the held keys (see the console's log).", "", "")
		return
	}
	q := strings.TrimSpace(r.URL.Query().Get("q"))
	deadOnly := r.URL.Query().Get("dead") == "1"
	shown := heldMatching(keys, q, deadOnly)
	h.render(w, r, "held.html", "Held keys of "+t.String(), struct {
		Table    string
		Mode     schema.Mode
		Keys     []runbook.HeldKey
		All      int
		Q        string
		DeadOnly bool
		Capped   bool
		Flash    string
	}{t.String(), mode, shown, len(keys), q, deadOnly, len(keys) == maxHeldShown, flash(r)})
}

// heldMatching keeps the held keys whose key, topic or last error
// contains q (ignoring case), and only the dead ones with deadOnly.
func heldMatching(keys []runbook.HeldKey, q string, deadOnly bool) []runbook.HeldKey {
	lq := strings.ToLower(q)
	var out []runbook.HeldKey
	for _, k := range keys {
		if deadOnly && k.State != runbook.HoldDead {
			continue
		}
		if lq != "" {
			text := k.Key + "\n" + k.Topic + "\n" + k.EventID
			if k.LastError != nil {
				text += "\n" + *k.LastError
			}
			if !strings.Contains(strings.ToLower(text), lq) {
				continue
			}
		}
		out = append(out, k)
	}
	return out
}

// tickedResult is one row of the report of a bulk action on ticked rows.
type tickedResult struct {
	EventID string
	Key     string
	// Refused says why nothing was done to the row, "" when it was done.
	Refused string
}

// tickedOp is a bulk action on ticked rows: a skip (runbook.Runbook.SkipEvent) or
// a replay (runbook.Runbook.ReplayEvent) of each.
type tickedOp struct {
	// Name is "skip" or "replay", in the log and on the report.
	Name string
	// DefaultBack is the page to go back to when the form names none.
	DefaultBack, DefaultBackLabel string
	// Do acts on one row and returns its ordering key ("" for none).
	Do func(ctx context.Context, h *handler, t schema.Table, id uuid.UUID) (string, error)
}

var (
	tickedSkip = tickedOp{Name: "skip", DefaultBack: "held", DefaultBackLabel: "the held keys",
		Do: func(ctx context.Context, h *handler, t schema.Table, id uuid.UUID) (string, error) {
			res, err := runbook.New(h.pool, t).SkipEvent(ctx, id, false)
			return res.Key, err
		}}
	tickedReplay = tickedOp{Name: "replay", DefaultBack: "dead", DefaultBackLabel: "the dead rows",
		Do: func(ctx context.Context, h *handler, t schema.Table, id uuid.UUID) (string, error) {
			res, err := runbook.New(h.pool, t).ReplayEvent(ctx, id, runbook.ReplayOptions{})
			if res.Row.OrderingKey != nil {
				return *res.Row.OrderingKey, err
			}
			return "", err
		}}
)

// bulkSkip asks the relays to skip the ticked held rows.
func (h *handler) bulkSkip(w http.ResponseWriter, r *http.Request) { h.bulkTicked(w, r, tickedSkip) }

// bulkReplayTicked replays the ticked rows, one by one.
func (h *handler) bulkReplayTicked(w http.ResponseWriter, r *http.Request) {
	h.bulkTicked(w, r, tickedReplay)
}

// bulkTicked runs op on the rows ticked on a list (the held keys, the dead
// rows, the rows of a state), only when the operator typed how many were
// ticked; each row goes through the runbook's own call, which refuses what
// its rules refuse (a hold's state, a row that is not dead or failed), and
// the page reports each outcome, with a link back to the list (the form's
// back, a path of this console).
func (h *handler) bulkTicked(w http.ResponseWriter, r *http.Request, op tickedOp) {
	t, ok := h.table(w, r)
	if !ok || !h.allow(w, r) {
		return
	}
	back, backLabel := tablePath(t, op.DefaultBack), op.DefaultBackLabel
	if b := r.PostFormValue("back"); b != "" {
		back, backLabel = localPath(b), "the list"
	}
	var ids []uuid.UUID
	seen := map[uuid.UUID]bool{}
	for _, s := range r.PostForm["event"] {
		id, err := uuid.Parse(s)
		if err != nil {
			h.fail(w, r, http.StatusBadRequest, "The ticked rows must be event ids (UUIDs); nothing changed.", back, backLabel)
			return
		}
		if !seen[id] {
			seen[id] = true
			ids = append(ids, id)
		}
	}
	if len(ids) == 0 {
		h.fail(w, r, http.StatusBadRequest, "Tick the rows to "+op.Name+" first; nothing changed.", back, backLabel)
		return
	}
	if len(ids) > maxHeldShown {
		h.fail(w, r, http.StatusBadRequest, "At most "+strconv.Itoa(maxHeldShown)+" rows at once; nothing changed.", back, backLabel)
		return
	}
	if confirm := strings.TrimSpace(r.PostFormValue("confirm")); confirm != strconv.Itoa(len(ids)) {
		h.fail(w, r, http.StatusBadRequest, "Type the number of ticked rows ("+strconv.Itoa(len(ids))+") to confirm; nothing changed.", back, backLabel)
		return
	}
	fields := actionFields(r, "bulk "+op.Name, t.String())
	fields["rows"] = len(ids)
	var (
		out  []tickedResult
		done int
	)
	for _, id := range ids {
		key, err := op.Do(r.Context(), h, t, id)
		res := tickedResult{EventID: id.String(), Key: key}
		if err != nil {
			res.Refused = err.Error()
		} else {
			done++
		}
		out = append(out, res)
	}
	fields["done"] = done
	h.logger.Info("Console bulk "+op.Name, fields)
	status := http.StatusOK
	if done < len(ids) {
		status = http.StatusConflict
	}
	title := "Bulk skip on " + t.String()
	if op.Name == "replay" {
		title = "Replay of the ticked rows of " + t.String()
	}
	h.renderStatus(w, r, status, "ticked.html", title, struct {
		Table           string
		Op              string
		Results         []tickedResult
		Done, Refused   int
		Back, BackLabel string
	}{t.String(), op.Name, out, done, len(ids) - done, back, backLabel})
}

// topics shows the backlog by topic, the paused topics, and (logged in)
// the Pause and Resume buttons (runbook.Runbook.PauseTopic, ResumeTopic).
func (h *handler) topics(w http.ResponseWriter, r *http.Request) {
	t, ok := h.table(w, r)
	if !ok {
		return
	}
	rb := runbook.New(h.pool, t)
	list, err := rb.Topics(r.Context(), maxTopicsShown)
	var paused []runbook.PausedTopic
	if err == nil {
		paused, err = rb.PausedTopics(r.Context())
	}
	var mode schema.Mode
	if err == nil {
		mode, err = rb.Mode(r.Context())
	}
	if err != nil {
		h.logger.Error("Console could not count the backlog by topic", err, watermill.LogFields{"table": t.String()})
		h.fail(w, r, http.StatusInternalServerError, "Cannot count the backlog by topic (see the console's log).", "", "")
		return
	}
	h.render(w, r, "topics.html", "Backlog by topic of "+t.String(), struct {
		Table     string
		Topics    []runbook.TopicBacklog
		Paused    []runbook.PausedTopic
		WAL       bool
		MaxReason int
		Flash     string
	}{t.String(), list, paused, mode == schema.ModeWAL, schema.PauseReasonMaxBytes, flash(r)})
}

// pauseTopic pauses or resumes (resume) the relaying of the form's topic
// (runbook.Runbook.PauseTopic, ResumeTopic): token and CSRF as every action.
func (h *handler) pauseTopic(w http.ResponseWriter, r *http.Request, resume bool) {
	action := "pause topic"
	if resume {
		action = "resume topic"
	}
	t, ok := h.table(w, r)
	if !ok || !h.allow(w, r) {
		return
	}
	topic := r.PostFormValue("topic")
	fields := actionFields(r, action, t.String())
	fields["topic"] = truncate(topic, 128)
	rb := runbook.New(h.pool, t)
	var err error
	if resume {
		_, err = rb.ResumeTopic(r.Context(), topic, false)
	} else {
		_, err = rb.PauseTopic(r.Context(), topic, r.PostFormValue("reason"), false)
	}
	if err != nil {
		h.logger.Info("Console "+action+" refused", fields)
		status := http.StatusConflict
		if errors.Is(err, runbook.ErrBadTopic) {
			status = http.StatusBadRequest
		}
		h.fail(w, r, status, "not done: "+err.Error(), tablePath(t, "topics"), "the topics")
		return
	}
	h.logger.Info("Console "+action, fields)
	done := "paused"
	if resume {
		done = "resumed"
	}
	http.Redirect(w, r, tablePath(t, "topics")+"?done="+done, http.StatusSeeOther)
}

// maxTopicsShown bounds the topics of the backlog page.
const maxTopicsShown = 500

// actionWho is who makes a state-changing request: the console knows no
// names, only that the request carried the console's token.
const actionWho = "token holder"

// actionFields are the log fields of a state-changing request.
func actionFields(r *http.Request, action, table string) watermill.LogFields {
	return watermill.LogFields{"who": actionWho, "remote": r.RemoteAddr, "action": action, "table": table}
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
		h.fail(w, r, http.StatusBadRequest, "The event id must be a UUID.", tablePath(t, "held"), "the held keys")
		return t, uuid.Nil, nil, false
	}
	fields := actionFields(r, action, t.String())
	fields["event_id"] = id.String()
	return t, id, fields, true
}

// skipReasonMaxBytes bounds the reason of a skip kept in the audit line.
const skipReasonMaxBytes = 200

// skip sets the row aside (runbook.Runbook.SkipEvent), in every mode: a
// row that holds no key at once (back to its event page), the row a held
// key waits for through its hold (back to the held keys). The audit line
// (the log's "Console skip") carries who and the form's reason.
func (h *handler) skip(w http.ResponseWriter, r *http.Request) {
	t, id, fields, ok := h.eventAction(w, r, "skip")
	if !ok {
		return
	}
	reason := strings.Join(strings.Fields(r.PostFormValue("reason")), " ")
	if len(reason) > skipReasonMaxBytes {
		reason = strings.ToValidUTF8(reason[:skipReasonMaxBytes], "")
	}
	fields["reason"] = reason
	res, err := runbook.New(h.pool, t).SkipEvent(r.Context(), id, false)
	if err != nil {
		h.logger.Info("Console skip refused", fields)
		back, label := tablePath(t, "held"), "the held keys"
		if !errors.Is(err, runbook.ErrNotHeld) && !errors.Is(err, runbook.ErrHoldRefused) {
			back, label = tablePath(t, "event/"+id.String()), "the event"
		}
		h.fail(w, r, http.StatusConflict, "not skipped: "+err.Error(), back, label)
		return
	}
	fields["ordering_key"] = res.Key
	fields["applied"] = res.Applied
	h.logger.Info("Console skip", fields)
	if res.Applied {
		http.Redirect(w, r, "/t/"+url.PathEscape(t.String())+"/event/"+id.String()+"?done=skipped", http.StatusSeeOther) //nolint:gosec // a configured table and a parsed UUID
		return
	}
	http.Redirect(w, r, "/t/"+url.PathEscape(t.String())+"/held?done=skip-requested", http.StatusSeeOther)
}

// bulkFilter reads the filter of a bulk replay from a form or a query.
func bulkFilter(v url.Values) runbook.DeadFilter {
	return runbook.DeadFilter{Topic: v.Get("topic"), ErrorContains: v.Get("error"), Cause: v.Get("cause"), AllTopics: v.Get("topic") == ""}
}

// preview shows how many dead rows a bulk replay of the filter would
// change now, and the form that confirms that exact count.
func (h *handler) preview(w http.ResponseWriter, r *http.Request) {
	t, ok := h.table(w, r)
	if !ok {
		return
	}
	f := bulkFilter(r.URL.Query())
	p, err := h.replayDead(r.Context(), t, f, true)
	if errors.Is(err, errCauseTimeout) {
		h.fail(w, r, http.StatusServiceUnavailable, causeTimeoutText(h.causesTimeout), tablePath(t, "dead"), "the dead rows")
		return
	}
	if err != nil {
		h.logger.Error("Console could not preview a bulk replay", err, watermill.LogFields{"table": t.String()})
		h.fail(w, r, http.StatusInternalServerError, "Cannot preview the replay (see the console's log).", tablePath(t, "dead"), "the dead rows")
		return
	}
	h.render(w, r, "preview.html", "Replay dead rows of "+t.String(), struct {
		Table               string
		Topic, Error, Cause string
		Snapshot            runbook.ReplaySnapshot
		LeftAlone           int64
	}{t.String(), f.Topic, f.ErrorContains, f.Cause, p.Snapshot, p.LeftAlone})
}

// job is one bulk replay whose progress the console follows: recorded in
// the table's <table>_replay_jobs (runbook.Runbook.SaveReplayJob), or, when that
// table is missing or cannot be written, in the console's memory only.
type job struct {
	Table    string
	Topic    string
	Error    string
	Cause    string
	Rows     int64
	At       time.Time
	EventIDs []uuid.UUID
	// By and From say who asked and from where.
	By, From string
	// Memory says the job is kept in this console's memory only; Why says
	// why it is not in the table of replay jobs.
	Memory bool
	Why    string
}

// jobOf is the console's view of a recorded replay job of t.
func jobOf(t schema.Table, j runbook.ReplayJob) *job {
	return &job{Table: t.String(), Topic: j.Topic, Error: j.ErrorContains, Cause: j.Cause, Rows: j.Rows, At: j.CreatedAt,
		EventIDs: j.EventIDs, By: j.RequestedBy, From: j.Remote}
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
		h.fail(w, r, http.StatusBadRequest, "The replay form is incomplete: preview again; nothing changed.", previewPath(t, f), "the preview")
		return
	}
	if confirm != snap.Rows {
		h.fail(w, r, http.StatusBadRequest, "Type the number of rows the preview counted ("+strconv.FormatInt(snap.Rows, 10)+") to confirm; nothing changed.", previewPath(t, f), "the preview")
		return
	}
	f.Expect = &snap
	fields := actionFields(r, "bulk replay", t.String())
	fields["topic"], fields["error_contains"], fields["cause"], fields["expected_rows"] = f.Topic, f.ErrorContains, f.Cause, snap.Rows
	res, err := h.replayDead(r.Context(), t, f, false)
	if errors.Is(err, errCauseTimeout) {
		h.fail(w, r, http.StatusServiceUnavailable, causeTimeoutText(h.causesTimeout), tablePath(t, "dead"), "the dead rows")
		return
	}
	if errors.Is(err, runbook.ErrReplaySetChanged) {
		h.logger.Info("Console bulk replay refused: the rows changed since the preview", fields)
		h.fail(w, r, http.StatusConflict, "not replayed: "+err.Error(), previewPath(t, f), "a new preview")
		return
	}
	if err != nil {
		h.logger.Error("Console bulk replay failed", err, fields)
		h.fail(w, r, http.StatusInternalServerError, "Not replayed (see the console's log).", previewPath(t, f), "the preview")
		return
	}
	fields["changed"] = res.Rows
	h.logger.Info("Console bulk replay", fields)
	rec := runbook.ReplayJob{Topic: f.Topic, ErrorContains: f.ErrorContains, Cause: f.Cause, Rows: res.Rows, EventIDs: res.EventIDs,
		RequestedBy: actionWho, Remote: h.clientIP(r)}
	id, err := h.saveJob(r.Context(), t, rec)
	if err != nil {
		// The rows are replayed: follow them from memory rather than fail.
		h.logger.Error("Console could not record a bulk replay; its progress is kept in memory only", err, fields)
		why := "the console could not write it to " + t.String() + "_replay_jobs (see the console's log)"
		if errors.Is(err, runbook.ErrNoReplayJobs) {
			why = t.String() + "_replay_jobs does not exist: run `outbox migrate --table=" + t.String() + "` (migration 000008) to keep the next ones across restarts"
		}
		id = h.addJob(&job{Table: t.String(), Topic: f.Topic, Error: f.ErrorContains, Cause: f.Cause, Rows: res.Rows, At: time.Now(),
			EventIDs: res.EventIDs, By: rec.RequestedBy, From: rec.Remote, Memory: true, Why: why})
	}
	http.Redirect(w, r, "/t/"+url.PathEscape(t.String())+"/replay/"+id, http.StatusSeeOther)
}

// saveJob records a bulk replay in the table of replay jobs of t, keeping
// the newest maxJobs, and returns its id.
func (h *handler) saveJob(ctx context.Context, t schema.Table, rec runbook.ReplayJob) (string, error) {
	saved, err := runbook.New(h.pool, t).SaveReplayJob(ctx, rec, maxJobs)
	if err != nil {
		return "", fmt.Errorf("record a bulk replay of %s: %w", t, err)
	}
	return saved.ID, nil
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

// jobGone says why a bulk replay's progress cannot be shown.
func jobGone() string {
	return "This console has no record of that bulk replay. It keeps the last " + strconv.Itoa(maxJobs) +
		" bulk replays of each table in the table's <table>_replay_jobs, and this one is not among them: an older one, deleted as newer ones came, " +
		"or one made while that table did not exist (before `outbox migrate`), which only the memory of the console that ran it kept until it restarted. " +
		"The rows were replayed all the same: the dead rows page and the event pages show where each one is now."
}

// findJob finds the bulk replay id: in memory, then in the table of
// replay jobs of only (when not zero) or of every table of the console.
func (h *handler) findJob(ctx context.Context, id string, only schema.Table) (*job, error) {
	h.jobsMu.Lock()
	j := h.jobs[id]
	h.jobsMu.Unlock()
	if j != nil && (only.IsZero() || j.Table == only.String()) {
		return j, nil
	}
	if id == "" || len(id) > schema.ReplayJobIDMaxBytes {
		return nil, errJobGone
	}
	tables := []schema.Table{only}
	if only.IsZero() {
		tables = tables[:0]
		for _, name := range h.names {
			tables = append(tables, h.tables[name])
		}
	}
	for _, t := range tables {
		rec, err := runbook.New(h.pool, t).GetReplayJob(ctx, id)
		switch {
		case errors.Is(err, runbook.ErrNoReplayJob), errors.Is(err, runbook.ErrNoReplayJobs):
			continue
		case err != nil:
			return nil, err
		}
		return jobOf(t, rec), nil
	}
	return nil, errJobGone
}

// job finds the bulk replay of the request (of only, when not zero) and
// counts its progress.
func (h *handler) job(r *http.Request, only schema.Table) (*job, runbook.Progress, error) {
	j, err := h.findJob(r.Context(), r.PathValue("job"), only)
	if errors.Is(err, errJobGone) {
		return nil, runbook.Progress{}, err
	}
	if err != nil {
		h.logger.Error("Console could not read a replay job", err, watermill.LogFields{"job": truncate(r.PathValue("job"), 64)})
		return nil, runbook.Progress{}, err
	}
	p, err := runbook.New(h.pool, h.tables[j.Table]).ReplayProgress(r.Context(), j.EventIDs)
	if err != nil {
		h.logger.Error("Console could not read a replay's progress", err, watermill.LogFields{"table": j.Table})
		return nil, runbook.Progress{}, err
	}
	return j, p, nil
}

// errJobGone: the console has no record of the bulk replay.
var errJobGone = errors.New("no such bulk replay")

// jobState is a bulk replay's progress as the page and /api/replay show
// it.
type jobState struct {
	runbook.Progress
	// Done is true when no replayed row is pending any more: every one is
	// delivered, dead again or gone from the table.
	Done bool `json:"done"`
}

// jobPage shows a bulk replay's progress; the script follows it until it
// is done.
func (h *handler) jobPage(w http.ResponseWriter, r *http.Request) {
	t, ok := h.table(w, r)
	if !ok {
		return
	}
	j, p, err := h.job(r, t)
	if errors.Is(err, errJobGone) {
		h.fail(w, r, http.StatusNotFound, jobGone(), "/t/"+url.PathEscape(t.String())+"/dead", "the dead rows")
		return
	}
	if err != nil {
		h.fail(w, r, http.StatusServiceUnavailable, "Cannot read the replay's progress now (see the console's log); reload the page to try again.", "", "")
		return
	}
	h.render(w, r, "job.html", "Bulk replay of "+j.Table, struct {
		ID       string
		Job      *job
		Progress jobState
		Gone     string
		Kept     int
		Where    string
	}{r.PathValue("job"), j, jobState{p, p.Pending == 0}, jobGone(), maxJobs, t.String() + "_replay_jobs"})
}

// jobProgress is the progress of a bulk replay as JSON; 404 with
// {"gone": true, "error": ...} when the console has no record of it.
func (h *handler) jobProgress(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	_, p, err := h.job(r, schema.Table{})
	switch {
	case errors.Is(err, errJobGone):
		w.WriteHeader(http.StatusNotFound)
		_ = json.NewEncoder(w).Encode(map[string]any{"gone": true, "error": jobGone()})
	case err != nil:
		w.WriteHeader(http.StatusServiceUnavailable)
		_ = json.NewEncoder(w).Encode(map[string]any{"error": "cannot read the replay's progress now (see the console's log)"})
	default:
		_ = json.NewEncoder(w).Encode(jobState{p, p.Pending == 0})
	}
}

// tablePath is the path of one of t's pages ("dead", "held", "event/<id>").
func tablePath(t schema.Table, page string) string {
	return "/t/" + url.PathEscape(t.String()) + "/" + page
}

// previewPath is the path of the preview of a bulk replay of f.
func previewPath(t schema.Table, f runbook.DeadFilter) string {
	return tablePath(t, "replay") + "?" + url.Values{"topic": {f.Topic}, "error": {f.ErrorContains}, "cause": {f.Cause}}.Encode()
}

// relays lists the relays alive on a table: their processes' sessions with
// the leader, the ordered relays' partitions, the WAL slot's reader.
func (h *handler) relays(w http.ResponseWriter, r *http.Request) {
	t, ok := h.table(w, r)
	if !ok {
		return
	}
	list, err := runbook.New(h.pool, t).Relays(r.Context())
	if err != nil {
		h.logger.Error("Console could not list the relays", err, watermill.LogFields{"table": t.String()})
		h.fail(w, r, http.StatusInternalServerError, "Cannot list the relays (see the console's log).", "", "")
		return
	}
	h.render(w, r, "relays.html", "Relays of "+t.String(), struct {
		Table  string
		List   runbook.RelayList
		Prefix string
		Slot   string
	}{t.String(), list, sqlq.RelayApplicationPrefix, schema.WALSlotName(t)})
}
