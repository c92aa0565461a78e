// The outbox console's only script: live counts on the overview and the
// return path of the login form. No inline script (Content-Security-Policy).
"use strict";
document.querySelectorAll("input.back").forEach(function (i) { i.value = location.pathname + location.search; });
var overview = document.getElementById("overview");
if (overview) {
  setInterval(function () {
    fetch("/api/counts", { credentials: "same-origin" }).then(function (r) { return r.json(); }).then(function (all) {
      overview.querySelectorAll("tr[data-table]").forEach(function (tr) {
        var st = all[tr.dataset.table];
        if (!st) { return; }
        tr.querySelectorAll("[data-count]").forEach(function (td) {
          var v = st[td.dataset.count];
          td.textContent = td.dataset.count === "oldest_pending_age_seconds" ? v.toFixed(1) + " s" : String(v);
        });
      });
    }).catch(function () {});
  }, 2000);
}
