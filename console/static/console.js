// The outbox console's only script. No inline script (Content-Security-Policy).
//
// - Every page whose <main> has data-refresh="<seconds>" reloads its own
//   content in place, one request at a time (the next waits for the answer),
//   unless the operator paused it (the header's toggle, remembered in this
//   browser) or is typing, selecting or reading an opened detail.
// - The bulk replay page follows its progress the same way and stops when
//   the replay is done, or says that the console has no record of it.
// - A banner says when the server stops answering, and when it is back.
// - Times (<time data-rel>) show how long ago they were, kept current.
"use strict";
document.querySelectorAll("input.back").forEach(function (i) { i.value = location.pathname + location.search; });

var PAUSE_KEY = "outbox-console-paused";

function paused() {
  try { return localStorage.getItem(PAUSE_KEY) === "1"; } catch (e) { return false; }
}

var banner = document.getElementById("offline");
var failingSince = null;

function answered() {
  failingSince = null;
  if (banner) { banner.hidden = true; }
}

function unanswered(why) {
  if (!failingSince) { failingSince = new Date(); }
  if (banner) {
    banner.textContent = "The console server is not answering (" + why + ") since " + failingSince.toISOString().replace(/\.\d+Z$/, "Z") +
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

// ago writes how long ago t was: "3m ago", "in 20s".
function ago(t) {
  var s = Math.round((Date.now() - t.getTime()) / 1000);
  var future = s < 0;
  s = Math.abs(s);
  var out;
  if (s < 60) { out = s + "s"; }
  else if (s < 3600) { out = Math.floor(s / 60) + "m"; }
  else if (s < 86400) { out = Math.floor(s / 3600) + "h" + (Math.floor(s / 60) % 60 ? " " + (Math.floor(s / 60) % 60) + "m" : ""); }
  else { out = Math.floor(s / 86400) + "d" + (Math.floor(s / 3600) % 24 ? " " + (Math.floor(s / 3600) % 24) + "h" : ""); }
  return future ? "in " + out : out + " ago";
}

function relativeTimes(root) {
  root.querySelectorAll("time[data-rel]").forEach(function (el) {
    var t = new Date(el.getAttribute("datetime"));
    var rel = el.parentNode && el.nextElementSibling && el.nextElementSibling.classList.contains("rel") ? el.nextElementSibling : null;
    if (!isNaN(t.getTime()) && rel) { rel.textContent = "(" + ago(t) + ")"; }
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
}

if (main && toggle) {
  showToggle();
  toggle.addEventListener("click", function () {
    try { localStorage.setItem(PAUSE_KEY, paused() ? "0" : "1"); } catch (e) { /* private mode: no memory */ }
    showToggle();
  });
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
        if (refreshState) { refreshState.textContent = "refreshed " + new Date().toISOString().replace(/\.\d+Z$/, "Z"); }
      }
      return true;
    }).catch(function (e) { unanswered(e && e.message && e.message.indexOf("HTTP") === 0 ? e.message : "no answer"); return true; });
  });
}

// The held keys page: "tick every row shown" and the count of ticked rows.
document.addEventListener("change", function (e) {
  var t = e.target;
  if (!t || !t.closest) { return; }
  var form = t.closest("#bulk-skip");
  if (!form) { return; }
  if (t.id === "select-all") {
    form.querySelectorAll("input.pick").forEach(function (c) { c.checked = t.checked; });
  }
  var n = form.querySelectorAll("input.pick:checked").length;
  var out = document.getElementById("ticked");
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
