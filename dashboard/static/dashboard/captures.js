/* The captures page (dashboard/templates/dashboard/captures.html): lists the captured
   requests (the page's `listing`, refreshed every 5 s and on demand) and shows the one
   clicked (`detail`): headers as stored (credentials read [REDACTED]) and bodies as the
   server made them readable (JSON pretty-printed, SSE as events, binary as its size). The
   address's fragment is the opened one's id: `#42` opens activity row 42's capture (the
   Activity page's capture button links there), and a click writes it.
   Everything is written with textContent, never as HTML. No dependency. */
(function () {
  "use strict";
  var root, rows, opened = null;

  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { e.setAttribute(k, attrs[k]); });
    if (text !== undefined && text !== null) e.textContent = text;
    return e;
  }
  function getJson(url) {
    return fetch(url, {credentials: "same-origin", headers: {Accept: "application/json"}})
      .then(function (r) {
        return r.json().then(function (b) { return {status: r.status, body: b}; },
                             function () { return {status: r.status, body: {}}; });
      });
  }
  function time(iso) {
    var d = new Date(iso);
    return isNaN(d) ? iso : d.toLocaleTimeString();
  }
  function size(n) {
    return n >= 1024 * 1024 ? (n / 1048576).toFixed(1) + " MiB"
         : n >= 1024 ? (n / 1024).toFixed(1) + " KiB" : n + " bytes";
  }

  function list() {
    getJson(root.dataset.listing).then(function (res) {
      if (res.status !== 200) return;
      var found = res.body.captures || [];
      rows.textContent = "";
      found.forEach(function (c) {
        var tr = el("tr", {"data-testid": "capture-row", "data-id": String(c.id),
                           "class": c.id === opened ? "open" : "", tabindex: "0"});
        tr.appendChild(el("td", {"class": "num"}, String(c.id)));
        tr.appendChild(el("td", {}, time(c.received_at)));
        tr.appendChild(el("td", {}, c.model));
        tr.appendChild(el("td", {"class": "path"}, c.method + " " + c.path + (c.stream ? " (stream)" : "")));
        tr.appendChild(el("td", {"class": "num"}, c.status_code === null ? "—" : String(c.status_code)));
        tr.appendChild(el("td", {"class": "num"}, c.duration_ms === null ? "—" : Math.round(c.duration_ms) + " ms"));
        tr.addEventListener("click", function () { open(c.id); });
        tr.addEventListener("keydown", function (e) { if (e.key === "Enter") open(c.id); });
        rows.appendChild(tr);
      });
      root.querySelector("[data-testid=captures-empty]").hidden = found.length > 0;
    });
  }

  function headers(h) {
    if (!h) return el("p", {"class": "empty"}, "not kept");
    var table = el("table", {"class": "grid compact headers", "data-testid": "headers"});
    var body = el("tbody");
    Object.keys(h).forEach(function (name) {
      var tr = el("tr", {"data-header": name.toLowerCase()});
      tr.appendChild(el("th", {}, name));
      tr.appendChild(el("td", {"data-testid": "header-value"}, h[name]));
      body.appendChild(tr);
    });
    table.appendChild(body);
    return table;
  }

  function bodyView(b) {
    var box = el("div", {"class": "body", "data-testid": "body", "data-kind": b.kind});
    if (b.kind === "none") { box.appendChild(el("p", {"class": "empty"}, b.note)); return box; }
    if (b.kind === "empty") { box.appendChild(el("p", {"class": "empty"}, "empty")); return box; }
    if (b.kind === "binary") {
      box.appendChild(el("p", {"class": "empty"}, "binary, " + size(b.size) +
                          (b.content_type ? " of " + b.content_type : "") + ": not shown"));
      return box;
    }
    if (b.kind === "sse") {
      box.appendChild(el("p", {"class": "meta"}, b.events.length + " server-sent events, " + size(b.size)));
      if (b.answer) {
        box.appendChild(el("p", {"class": "meta"}, "the streamed answer, put together:"));
        box.appendChild(el("pre", {"class": "answer", "data-testid": "sse-answer"}, b.answer));
        box.appendChild(el("p", {"class": "meta"}, "the events:"));
      }
      var ol = el("ol", {"class": "events"});
      b.events.forEach(function (ev) {
        var li = el("li", {"data-testid": "sse-event"});
        li.appendChild(el("span", {"class": "event-name"}, ev.event));
        li.appendChild(el("pre", {}, ev.data));
        ol.appendChild(li);
      });
      box.appendChild(ol);
      return box;
    }
    box.appendChild(el("p", {"class": "meta"}, (b.kind === "json" ? "JSON, " : "text, ") + size(b.size)));
    box.appendChild(el("pre", {"data-testid": "body-text"}, b.text));
    return box;
  }

  /* The capture the address names (`#<activity id>`: the Activity page's capture button). */
  function fromAddress() {
    var m = /^#(\d+)$/.exec(location.hash);
    if (m && Number(m[1]) !== opened) open(Number(m[1]));
  }

  function open(id) {
    opened = id;
    if (location.hash !== "#" + id) history.replaceState(null, "", "#" + id);
    rows.querySelectorAll("tr").forEach(function (tr) {
      tr.classList.toggle("open", tr.dataset.id === String(id));
    });
    var detail = root.querySelector("[data-testid=capture-detail]");
    getJson(root.dataset.detail.replace(/0$/, String(id))).then(function (res) {
      detail.textContent = "";
      if (res.status !== 200) {
        var error = res.body.error && res.body.error.message;
        detail.appendChild(el("p", {"class": "notice"}, error || ("the proxy answered " + res.status)));
        return;
      }
      var c = res.body;
      detail.dataset.id = String(c.id);
      detail.appendChild(el("h2", {}, "Request " + c.id + " "));
      detail.querySelector("h2").appendChild(el("code", {"data-testid": "req-path"}, c.req_path));
      [["request", "Request"], ["response", "Response"]].forEach(function (side) {
        var part = el("section", {"class": "side", "data-testid": side[0]});
        part.appendChild(el("h3", {}, side[1] + " headers"));
        part.appendChild(headers(c[side[0]].headers));
        part.appendChild(el("h3", {}, side[1] + " body"));
        part.appendChild(bodyView(c[side[0]].body));
        detail.appendChild(part);
      });
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    root = document.getElementById("captures");
    if (root.dataset.enabled !== "1") return;
    rows = root.querySelector("[data-testid=capture-rows]");
    root.querySelector("[data-testid=captures-refresh]").addEventListener("click", list);
    list();
    setInterval(list, 5000);
    window.addEventListener("hashchange", fromAddress);
    fromAddress();
  });
})();
