// The run page, live: the dashboard's one script (served from /static, no inline script; the page
// is the one page whose CSP allows it). It follows /runs/<id>/live (server-sent events) and updates
// the page in place: the progress report, each stream's items, and — when the run's state, its
// stored steps or its attempts change — the page's main part, fetched again (no reload). Without
// JavaScript the page refreshes itself instead (<noscript>).
(function () {
  "use strict";
  var main = document.querySelector("main[data-live]");
  if (!main || !window.EventSource || !window.fetch) { return; }
  var TAIL = 200;
  var source = new EventSource(main.getAttribute("data-live"));
  var run = null;

  function $(selector) { return main.querySelector(selector); }

  function text(tag, value, cls) {
    var el = document.createElement(tag);
    if (cls) { el.className = cls; }
    el.textContent = value;
    return el;
  }

  function refresh() {
    return fetch(window.location.href, { credentials: "same-origin", headers: { "Accept": "text/html" } })
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) {
        if (!html) { return; }
        var fresh = new DOMParser().parseFromString(html, "text/html").querySelector("main");
        if (fresh) { main.innerHTML = fresh.innerHTML; }
      })
      .catch(function () { /* the next event tries again */ });
  }

  source.addEventListener("run", function (e) {
    var d = JSON.parse(e.data);
    var key = d.state + "/" + d.steps + "/" + d.attempts;
    if (run !== null && key !== run) { refresh(); }
    run = key;
  });

  source.addEventListener("progress", function (e) {
    var d = JSON.parse(e.data);
    var card = $('[data-testid="progress"]');
    if (!card) { refresh(); return; }
    card.querySelector('[data-testid="progress-state"]').textContent = d.state;
    card.querySelector('[data-testid="progress-meta"]').textContent = JSON.stringify(d.meta);
    card.querySelector('[data-testid="progress-when"]').textContent =
      "attempt " + d.attempt + ", just now" + (d.current ? "" : " · not the running attempt's");
  });

  source.addEventListener("item", function (e) {
    var d = JSON.parse(e.data);
    var section = $('[data-testid="streams"]');
    if (!section) { return; }
    section.hidden = false;
    var box = null;
    section.querySelectorAll("[data-stream]").forEach(function (el) {
      if (el.getAttribute("data-stream") === d.stream) { box = el; }
    });
    if (!box) {
      box = document.createElement("div");
      box.className = "stream";
      box.setAttribute("data-stream", d.stream);
      var head = text("h3", d.stream + " ", "mono");
      var count = text("span", "", "muted");
      count.setAttribute("data-count", "");
      head.appendChild(count);
      box.appendChild(head);
      box.appendChild(text("ol", "", "stream-items"));
      section.appendChild(box);
    }
    var list = box.querySelector("ol");
    var last = list.lastElementChild;
    if (last && Number(last.getAttribute("data-position")) >= d.position) { return; } // shown already
    var li = document.createElement("li");
    li.setAttribute("data-position", String(d.position));
    li.appendChild(text("code", JSON.stringify(d.value)));
    list.appendChild(li);
    while (list.children.length > TAIL) { list.removeChild(list.firstElementChild); }
    var count = box.querySelector("[data-count]");
    if (count) { count.textContent = "live"; }
  });

  source.addEventListener("end", function () {
    source.close();
    refresh();
  });
})();
