// The outbox console's only script: live counts on the overview, the
// progress of a bulk replay, and the return path of the login form. No
// inline script (Content-Security-Policy).
"use strict";
document.querySelectorAll("input.back").forEach(function (i) { i.value = location.pathname + location.search; });

function poll(url, every, apply) {
  setInterval(function () {
    fetch(url, { credentials: "same-origin" }).then(function (r) {
      if (!r.ok) { throw new Error(String(r.status)); }
      return r.json();
    }).then(apply).catch(function () {});
  }, every);
}

function leader(v) {
  if (v.ordered_relays) { return v.ordered_relays + (v.ordered_relays === 1 ? " ordered relay" : " ordered relays"); }
  var l = v.leader;
  if (!l) { return "none"; }
  var s = "pid " + l.pid;
  if (l.application_name) { s += " (" + l.application_name + ")"; }
  if (l.client_addr) { s += " from " + l.client_addr; }
  return s;
}

var overview = document.getElementById("overview");
if (overview) {
  poll("/api/counts", 2000, function (all) {
    overview.querySelectorAll("tr[data-table]").forEach(function (tr) {
      var v = all[tr.dataset.table];
      if (!v) { return; }
      tr.querySelectorAll("[data-count]").forEach(function (td) {
        var k = td.dataset.count;
        if (k === "held_keys") { td.textContent = String(v.held_keys); }
        else if (k === "leader") { td.textContent = leader(v); }
        else if (k === "rate") { td.textContent = (v.stats.published_last_minute / 60).toFixed(1); }
        else if (k === "oldest_pending_age_seconds") { td.textContent = v.stats[k].toFixed(1) + " s"; }
        else { td.textContent = String(v.stats[k]); }
      });
    });
  });
}

var progress = document.getElementById("progress");
if (progress) {
  poll("/api/replay/" + encodeURIComponent(progress.dataset.job), 1000, function (p) {
    progress.querySelectorAll("[data-progress]").forEach(function (td) {
      td.textContent = String(p[td.dataset.progress]);
    });
  });
}
