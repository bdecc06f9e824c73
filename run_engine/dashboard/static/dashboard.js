// Live parts of a page: an element with data-live (a Server-Sent Events URL) and data-refresh
// (the URL of its own fragment) is fetched again whenever the stream says something changed.
(function () {
  "use strict";
  var streams = [];

  function closeAll() {
    streams.forEach(function (s) { s.close(); });
    streams = [];
  }

  function connect(root) {
    var scope = root && root.querySelectorAll ? root : document;
    var found = scope.querySelectorAll("[data-live]");
    if (root && root.matches && root.matches("[data-live]")) { found = [root]; }
    Array.prototype.forEach.call(found, function (el) {
      if (el.dataset.connected) { return; }
      el.dataset.connected = "1";
      var source = new EventSource(el.dataset.live);
      streams.push(source);
      var pending = false;
      source.addEventListener("changed", function () {
        if (pending) { return; }
        pending = true;
        var target = document.getElementById(el.id);
        if (!target) { source.close(); return; }
        htmx.ajax("GET", el.dataset.refresh, { target: "#" + el.id, swap: "outerHTML" }).then(function () {
          pending = false;
        });
      });
      source.onerror = function () {
        // the server closes a finished run's stream: stop rather than reconnect for ever
        if (source.readyState === EventSource.CLOSED) { return; }
      };
    });
  }

  document.addEventListener("DOMContentLoaded", function () { connect(document); });
  // a refreshed fragment brings a new element: reconnect only if the old stream ended
  document.addEventListener("htmx:load", function (evt) {
    var el = evt.detail.elt;
    if (el && el.matches && el.matches("[data-live]")) {
      var same = streams.some(function (s) { return s.url.endsWith(el.dataset.live); });
      if (same) { el.dataset.connected = "1"; return; }
    }
    connect(el);
  });
  // a boosted navigation replaces the page: its streams go with it
  document.addEventListener("htmx:beforeHistorySave", closeAll);
  window.addEventListener("pagehide", closeAll);
})();
