// The outbox console's only script. No inline script (Content-Security-Policy).
//
// - Every page whose <main> has data-refresh="<seconds>" reloads its own
//   content in place, one request at a time (the next waits for the answer),
//   unless the operator paused it (the header's toggle, remembered in this
//   browser) or is typing, ticking, selecting or reading an opened detail.
// - The bulk replay page follows its progress the same way (the toggle holds
//   it too) and stops when the replay is done, or says that the console has
//   no record of it.
// - A banner says when the server stops answering, and when it is back.
// - Times (<time data-rel>) show how long ago they were, kept current; the
//   exact time is their title.
"use strict";
// fillBack tells the forms (login, ticked rows) which page they came from.
function fillBack(root) {
  root.querySelectorAll("input.back").forEach(function (i) { i.value = location.pathname + location.search; });
}
fillBack(document);

var PAUSE_KEY = "outbox-console-paused";

function paused() {
  try { return localStorage.getItem(PAUSE_KEY) === "1"; } catch (e) { return false; }
}

// clock writes the time of day of d, UTC: "16:03:12 UTC".
function clock(d) { return d.toISOString().slice(11, 19) + " UTC"; }

var banner = document.getElementById("offline");
var failingSince = null;

function answered() {
  failingSince = null;
  if (banner) { banner.hidden = true; }
}

function unanswered(why) {
  if (!failingSince) { failingSince = new Date(); }
  if (banner) {
    banner.textContent = "The console server is not answering (" + why + ") since " + clock(failingSince) +
      ": what this page shows may be out of date. Retrying…";
    banner.hidden = false;
  }
}

// loop calls step, then waits every ms after its answer (never two calls at
// once); it stops when step's promise resolves to false.
function loop(every, step) {
  function next() {
    setTimeout(function () {
      step().then(function (again) {
        if (again !== false) { next(); }
      }, function () { next(); });
    }, every);
  }
  next();
}

// span writes s seconds in their two largest units, as the server does:
// "45s", "3m 12s", "2h 5m", "4d 1h" (a zero second unit left out).
function span(s) {
  var units = [[86400, "d"], [3600, "h"], [60, "m"], [1, "s"]];
  for (var i = 0; i < units.length; i++) {
    var n = units[i][0];
    if (s < n && n > 1) { continue; }
    var out = Math.floor(s / n) + units[i][1];
    if (i + 1 < units.length) {
      var rest = Math.floor((s % n) / units[i + 1][0]);
      if (rest > 0) { out += " " + rest + units[i + 1][1]; }
    }
    return out;
  }
  return "0s";
}

// ago writes how long ago t was: "3m 12s ago", "in 40s".
function ago(t) {
  var s = Math.round((Date.now() - t.getTime()) / 1000);
  return s < 0 ? "in " + span(-s) : span(s) + " ago";
}

// relativeTimes keeps every <time data-rel> saying how long ago it was;
// its title keeps the exact time.
function relativeTimes(root) {
  root.querySelectorAll("time[data-rel]").forEach(function (el) {
    var t = new Date(el.getAttribute("datetime"));
    if (!isNaN(t.getTime())) { el.textContent = ago(t); }
  });
}
relativeTimes(document);
setInterval(function () { relativeTimes(document); }, 5000);

// busy tells whether the operator is using the page: typing, a checked
// box, an opened detail, a selection.
function busy(main) {
  var a = document.activeElement;
  if (a && main.contains(a) && /^(INPUT|TEXTAREA|SELECT|BUTTON)$/.test(a.tagName)) { return true; }
  var inputs = main.querySelectorAll("input, textarea, select");
  for (var i = 0; i < inputs.length; i++) {
    var el = inputs[i];
    if ((el.type === "checkbox" || el.type === "radio") ? el.checked !== el.defaultChecked : (el.type !== "hidden" && el.value !== el.defaultValue)) { return true; }
  }
  if (main.querySelector("details[open]")) { return true; }
  var sel = window.getSelection && window.getSelection();
  return !!(sel && !sel.isCollapsed && main.contains(sel.anchorNode));
}

var main = document.querySelector("main[data-refresh]");
var toggle = document.getElementById("refresh-toggle");
var refreshState = document.getElementById("refresh-state");

function showToggle() {
  if (!toggle) { return; }
  toggle.hidden = false;
  toggle.textContent = paused() ? "Resume auto-refresh" : "Pause auto-refresh";
  toggle.setAttribute("aria-pressed", paused() ? "true" : "false");
  if (refreshState && paused()) { refreshState.textContent = "auto-refresh paused"; }
}

if (toggle) {
  showToggle();
  toggle.addEventListener("click", function () {
    try { localStorage.setItem(PAUSE_KEY, paused() ? "0" : "1"); } catch (e) { /* private mode: no memory */ }
    showToggle();
    if (refreshState && !paused()) { refreshState.textContent = "auto-refresh resumed"; }
  });
}

if (main) {
  var every = Math.max(1, parseInt(main.dataset.refresh, 10) || 5) * 1000;
  loop(every, function () {
    if (paused() || busy(main) || document.hidden) { return Promise.resolve(true); }
    return fetch(location.href, { credentials: "same-origin", headers: { "Accept": "text/html" } }).then(function (r) {
      if (r.status >= 500 || r.status === 401) { throw new Error("HTTP " + r.status); }
      return r.text();
    }).then(function (html) {
      answered();
      var next = new DOMParser().parseFromString(html, "text/html").querySelector("main");
      if (next && !paused() && !busy(main)) {
        main.innerHTML = next.innerHTML;
        relativeTimes(main);
        fillBack(main);
        if (refreshState) { refreshState.textContent = "refreshed at " + clock(new Date()); }
      }
      return true;
    }).catch(function (e) { unanswered(e && e.message && e.message.indexOf("HTTP") === 0 ? e.message : "no answer"); return true; });
  });
}

// The lists with tick boxes (form.ticked: held keys, dead rows, rows):
// "tick every row shown" and the count of ticked rows.
document.addEventListener("change", function (e) {
  var t = e.target;
  if (!t || !t.closest) { return; }
  var form = t.closest("form.ticked");
  if (!form) { return; }
  if (t.classList.contains("select-all")) {
    form.querySelectorAll("input.pick").forEach(function (c) { c.checked = t.checked; });
  }
  var n = form.querySelectorAll("input.pick:checked").length;
  var out = form.querySelector(".ticked-count");
  if (out) { out.textContent = n ? n + " ticked" : ""; }
});

var progress = document.getElementById("progress");
if (progress) {
  var done = document.getElementById("job-done");
  var gone = document.getElementById("job-gone");
  var following = document.getElementById("job-following");
  var finish = function (el) {
    if (following) { following.hidden = true; }
    if (el) { el.hidden = false; }
    // Nothing left to follow: the toggle would hold nothing.
    if (toggle) { toggle.hidden = true; }
    if (refreshState) { refreshState.textContent = ""; }
  };
  var apply = function (p) {
    progress.querySelectorAll("[data-progress]").forEach(function (td) {
      td.textContent = String(p[td.dataset.progress]);
    });
    if (p.done) {
      if (done) {
        done.querySelectorAll("[data-final]").forEach(function (s) { s.textContent = String(p[s.dataset.final]); });
      }
      finish(done);
      return false;
    }
    return true;
  };
  if (progress.dataset.done === "true") { finish(done); }
  else {
    progress.dataset.polls = "0";
    loop(1000, function () {
      if (paused() || document.hidden) { return Promise.resolve(true); }
      progress.dataset.polls = String(parseInt(progress.dataset.polls, 10) + 1);
      return fetch("/api/replay/" + encodeURIComponent(progress.dataset.job), { credentials: "same-origin" }).then(function (r) {
        if (r.status === 404) { answered(); finish(gone); return false; }
        if (r.status === 401) { answered(); finish(document.getElementById("job-logged-out")); return false; }
        if (!r.ok) { throw new Error("HTTP " + r.status); }
        return r.json().then(function (p) { answered(); return apply(p); });
      }).catch(function (e) { unanswered(e && e.message && e.message.indexOf("HTTP") === 0 ? e.message : "no answer"); return true; });
    });
  }
}
