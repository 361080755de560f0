/* The Activity page (dashboard/templates/dashboard/activity.html): the request log with
 * paging, sorting, filters and a column chooser; the window's cards and charts; one request's
 * timeline. Everything is read from /dashboard/activity/data/{rows,stats}, the same queries as
 * /api/activity and /api/activity/stats: sorting and paging happen in the database.
 *
 * The page's state (window, filters, sort, page) is kept in the address (a reload or a shared
 * link shows the same rows); the visible columns in localStorage. Everything the server sends
 * is written as text, never as HTML. No framework, no chart library: the charts are SVG drawn
 * here, coloured by dashboard.css's variables so that the dark theme applies. */
(function () {
  "use strict";

  var SVG_NS = "http://www.w3.org/2000/svg";
  var BANDS = ["interactive", "normal", "batch"];
  var WINDOW_HOURS = { "1h": 1, "24h": 24, "7d": 168 };
  var COLUMNS_KEY = "gpuproxy.activity.columns";
  var LIVE_MS = 5000;
  var PAGE_SIZES = [25, 50, 100, 250];

  /* key: the row's column (and the API's sort name when sortable); num: a number,
   * right-aligned; num and desc: sorted descending on the first click; shown: visible until
   * the chooser says otherwise. */
  var COLUMNS = [
    { key: "received_at", label: "time", sortable: true, desc: true, shown: true, fmt: clock },
    { key: "model", label: "model", sortable: true, shown: true },
    { key: "band", label: "band", sortable: true, shown: true, fmt: null, badge: "band" },
    { key: "outcome", label: "outcome", sortable: true, shown: true, badge: "outcome" },
    { key: "status_code", label: "status", sortable: true, num: true, shown: true },
    { key: "priority", label: "priority", sortable: true, num: true, shown: false },
    { key: "queue_wait_ms", label: "queue wait", sortable: true, num: true, shown: true,
      fmt: formatMs },
    { key: "swap_ms", label: "swap", sortable: true, num: true, shown: false, fmt: formatMs },
    { key: "ttft_ms", label: "ttft", sortable: true, num: true, shown: true, fmt: formatMs },
    { key: "duration_ms", label: "duration", sortable: true, num: true, shown: true,
      fmt: formatMs },
    { key: "input_tokens", label: "input", sortable: true, num: true, shown: true },
    { key: "cached_tokens", label: "cached", sortable: true, num: true, shown: true },
    { key: "output_tokens", label: "output", sortable: true, num: true, shown: true },
    { key: "prompt_tps", label: "prefill tok/s", sortable: true, num: true, shown: true,
      fmt: formatRate },
    { key: "generation_tps", label: "decode tok/s", sortable: true, num: true, shown: true,
      fmt: formatRate },
    { key: "path", label: "path", shown: false, mono: true },
    { key: "stream", label: "stream", shown: false, fmt: function (v) { return v ? "yes" : "no"; } },
    { key: "client", label: "client", shown: false },
    { key: "end_user", label: "end user", shown: false },
    { key: "endpoint", label: "endpoint", shown: false },
    { key: "upstream_retries", label: "retries", num: true, shown: false },
    { key: "error", label: "error", shown: false }
  ];

  var body = document.body;
  var DEFAULTS = {
    window: "1h", model: "", band: "", outcome: "", sort: "-received_at", limit: 50,
    offset: 0
  };
  var state = Object.assign({}, DEFAULTS);
  var shown = {};
  var rows = [];
  var selected = null;
  var serial = 0; // answers to an older query are dropped

  // ---- helpers --------------------------------------------------------------------------

  function $(selector) {
    return document.querySelector(selector);
  }

  function el(tag, attrs, children) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) {
      node.setAttribute(k, attrs[k]);
    });
    [].concat(children === undefined ? [] : children).forEach(function (c) {
      node.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
    });
    return node;
  }

  function svg(tag, attrs, text) {
    var node = document.createElementNS(SVG_NS, tag);
    Object.keys(attrs || {}).forEach(function (k) {
      node.setAttribute(k, attrs[k]);
    });
    if (text !== undefined) {
      node.textContent = text;
    }
    return node;
  }

  function tip(node, text) {
    node.appendChild(svg("title", {}, text));
    return node;
  }

  function formatMs(ms) {
    if (ms === null || ms === undefined) {
      return "";
    }
    if (ms < 10) {
      return ms.toFixed(1) + " ms";
    }
    if (ms < 1000) {
      return Math.round(ms) + " ms";
    }
    if (ms < 60000) {
      return (ms / 1000).toFixed(ms < 10000 ? 2 : 1) + " s";
    }
    return (ms / 60000).toFixed(1) + " min";
  }

  function formatRate(v) {
    return v === null || v === undefined ? "" : v.toFixed(1);
  }

  function pad(n) {
    return (n < 10 ? "0" : "") + n;
  }

  function clock(iso) {
    if (!iso) {
      return "";
    }
    var d = new Date(iso);
    return d.getFullYear() + "-" + pad(d.getMonth() + 1) + "-" + pad(d.getDate()) + " " +
      pad(d.getHours()) + ":" + pad(d.getMinutes()) + ":" + pad(d.getSeconds());
  }

  function outcomeKind(outcome) {
    if (outcome === "ok") {
      return "ok";
    }
    if (/^cancelled|^rejected|^queue_timeout|^shutting/.test(outcome)) {
      return "warn";
    }
    return "bad";
  }

  function cell(column, row) {
    var value = row[column.key];
    var text = value === null || value === undefined ? "" :
      (column.fmt ? column.fmt(value) : String(value));
    var td = el("td", { "data-col": column.key });
    if (column.num) {
      td.className = "num";
    }
    if (column.mono) {
      td.className = "path";
    }
    if (column.badge && text) {
      var kind = column.badge === "band" ? "band-" + value : "outcome-" + outcomeKind(value);
      td.appendChild(el("span", { "class": "badge badge-" + kind }, text));
    } else {
      td.textContent = text;
      if (column.key === "model" || column.key === "error") {
        td.title = text; // cut short by the style
      }
    }
    return td;
  }

  // ---- state: the address and localStorage ------------------------------------------------

  function readAddress() {
    var q = new URLSearchParams(location.search);
    if (WINDOW_HOURS[q.get("window")]) {
      state.window = q.get("window");
    }
    ["model", "band", "outcome"].forEach(function (k) {
      state[k] = q.get(k) || "";
    });
    var sortable = COLUMNS.filter(function (c) { return c.sortable; })
      .map(function (c) { return c.key; });
    var sort = q.get("sort") || "";
    if (sortable.indexOf(sort.replace(/^-/, "")) >= 0) {
      state.sort = sort;
    }
    var limit = parseInt(q.get("limit"), 10);
    if (PAGE_SIZES.indexOf(limit) >= 0) {
      state.limit = limit;
    }
    var offset = parseInt(q.get("offset"), 10);
    state.offset = offset > 0 ? offset : 0;
  }

  /** Only what differs from the defaults: the plain page's address stays plain. */
  function writeAddress() {
    var q = new URLSearchParams();
    Object.keys(state).forEach(function (k) {
      if (state[k] !== DEFAULTS[k]) {
        q.set(k, state[k]);
      }
    });
    var query = q.toString();
    history.replaceState(null, "", location.pathname + (query ? "?" + query : ""));
  }

  function readColumns() {
    var saved = null;
    try {
      saved = JSON.parse(localStorage.getItem(COLUMNS_KEY) || "null");
    } catch (e) {
      saved = null; // a value another version wrote: the defaults
    }
    COLUMNS.forEach(function (c) {
      shown[c.key] = Array.isArray(saved) ? saved.indexOf(c.key) >= 0 : c.shown;
    });
  }

  function saveColumns() {
    localStorage.setItem(COLUMNS_KEY, JSON.stringify(COLUMNS.filter(function (c) {
      return shown[c.key];
    }).map(function (c) { return c.key; })));
  }

  // ---- reading --------------------------------------------------------------------------

  function say(text, bad) {
    var status = $("#status");
    status.textContent = text;
    status.className = "act-status" + (bad ? " bad" : "");
  }

  /** GET a JSON answer; a refusal is thrown as its error message (the API's envelope), a
   * login page (the session ended) as a sentence saying so. */
  function getJson(url) {
    return fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } })
      .then(function (r) {
        var type = r.headers.get("Content-Type") || "";
        if (type.indexOf("application/json") < 0) {
          throw new Error("the session has ended: reload the page to log in again");
        }
        return r.json().then(function (j) {
          if (!r.ok) {
            throw new Error((j.error && j.error.message) || ("HTTP " + r.status));
          }
          return j;
        });
      });
  }

  function query(extra) {
    var q = new URLSearchParams({ since: state.window });
    if (state.model) {
      q.set("model", state.model);
    }
    Object.keys(extra).forEach(function (k) {
      if (extra[k] !== "") {
        q.set(k, extra[k]);
      }
    });
    return q.toString();
  }

  function loadRows() {
    var mine = ++serial;
    writeAddress();
    say("loading…");
    var url = body.dataset.rows + "?" + query({
      band: state.band, outcome: state.outcome, sort: state.sort, limit: state.limit,
      offset: state.offset
    });
    return getJson(url).then(function (page) {
      if (mine !== serial) {
        return;
      }
      rows = page.data;
      renderRows(page);
      say("");
    }).catch(function (e) {
      if (mine === serial) {
        say(e.message, true);
      }
    });
  }

  function loadStats() {
    return getJson(body.dataset.stats + "?" + query({})).then(renderStats)
      .catch(function (e) { say(e.message, true); });
  }

  function reload(fromStart) {
    if (fromStart) {
      state.offset = 0;
    }
    loadRows();
    loadStats();
  }

  // ---- the table ------------------------------------------------------------------------

  function renderHead() {
    var head = $("#log-head");
    head.replaceChildren();
    COLUMNS.forEach(function (c) {
      if (!shown[c.key]) {
        return;
      }
      var th = el("th", { "data-col": c.key, scope: "col" });
      if (c.num) {
        th.className = "num";
      }
      if (c.sortable) {
        var dir = state.sort === c.key ? "ascending" :
          state.sort === "-" + c.key ? "descending" : "none";
        th.setAttribute("aria-sort", dir);
        var button = el("button", { type: "button", "class": "sort",
                                    "data-testid": "sort-" + c.key,
                                    title: "sort by " + c.label },
                        c.label + (dir === "ascending" ? " ▲" : dir === "descending" ? " ▼" : ""));
        button.addEventListener("click", function () {
          if (state.sort === "-" + c.key) {
            state.sort = c.key;
          } else if (state.sort === c.key) {
            state.sort = "-" + c.key;
          } else {
            state.sort = (c.num || c.desc ? "-" : "") + c.key;
          }
          renderHead();
          reload(true);
        });
        th.appendChild(button);
      } else {
        th.textContent = c.label;
      }
      head.appendChild(th);
    });
    head.appendChild(el("th", {}, ""));
  }

  function renderRows(page) {
    var tbody = $("#log-body");
    tbody.replaceChildren.apply(tbody, rows.map(function (row) {
      var tr = el("tr", { "data-testid": "log-row", "data-id": String(row.id),
                          "data-model": row.model, tabindex: "0" });
      COLUMNS.forEach(function (c) {
        if (shown[c.key]) {
          tr.appendChild(cell(c, row));
        }
      });
      var link = el("a", { href: adminUrl(row), "data-testid": "admin-link",
                           title: "this request in the admin" }, "admin");
      link.addEventListener("click", function (e) { e.stopPropagation(); });
      var actions = el("td", { "class": "actions" }, link);
      if (row.has_capture) {
        var capture = el("a", { href: captureUrl(row), "data-testid": "capture-link",
                                title: "what was sent and answered (the capture)" }, "capture");
        capture.addEventListener("click", function (e) { e.stopPropagation(); });
        actions.appendChild(capture);
      }
      tr.appendChild(actions);
      if (selected && selected.id === row.id) {
        tr.classList.add("selected");
      }
      tr.addEventListener("click", function () { showDetail(row); });
      tr.addEventListener("keydown", function (e) {
        if (e.key === "Enter") {
          showDetail(row);
        }
      });
      return tr;
    }));
    $("#log-empty").hidden = rows.length > 0;
    var first = page.offset + 1;
    $("#range").textContent = rows.length ? "rows " + first + "–" + (page.offset + rows.length)
      : (page.offset ? "no rows past " + page.offset : "");
    $("#prev").disabled = page.offset === 0;
    $("#next").disabled = !page.has_more;
  }

  function adminUrl(row) {
    return body.dataset.admin + encodeURIComponent(row.id) + "/change/";
  }

  /** The Captures page opens the capture its address's fragment names. */
  function captureUrl(row) {
    return body.dataset.captures + "#" + encodeURIComponent(row.id);
  }

  function renderChooser() {
    var box = $("#column-choices");
    box.replaceChildren.apply(box, COLUMNS.map(function (c) {
      var input = el("input", { type: "checkbox", "data-testid": "column-" + c.key });
      input.checked = shown[c.key];
      input.addEventListener("change", function () {
        shown[c.key] = input.checked;
        saveColumns();
        renderHead();
        renderRows({ offset: state.offset, has_more: !$("#next").disabled });
      });
      return el("label", {}, [input, " " + c.label]);
    }));
  }

  /** The rows on the page, in the columns shown, as the table writes them. */
  function markdown() {
    var cols = COLUMNS.filter(function (c) { return shown[c.key]; });
    function esc(text) {
      return text.replace(/\\/g, "\\\\").replace(/\|/g, "\\|").replace(/\n/g, " ");
    }
    var lines = ["| id | " + cols.map(function (c) { return c.label; }).join(" | ") + " |",
                 "|---:|" + cols.map(function (c) { return c.num ? "---:" : "---"; }).join("|") +
                 "|"];
    rows.forEach(function (row) {
      lines.push("| " + row.id + " | " + cols.map(function (c) {
        return esc(cell(c, row).textContent);
      }).join(" | ") + " |");
    });
    return lines.join("\n") + "\n";
  }

  function exportMarkdown() {
    var url = URL.createObjectURL(new Blob([markdown()], { type: "text/markdown" }));
    var link = el("a", { href: url, download: "activity-" + clock(new Date().toISOString())
      .replace(/[ :]/g, "-") + ".md" });
    document.body.appendChild(link);
    link.click();
    link.remove();
    setTimeout(function () { URL.revokeObjectURL(url); }, 1000);
  }

  // ---- one request ----------------------------------------------------------------------

  function showDetail(row) {
    selected = row;
    Array.prototype.forEach.call($("#log-body").children, function (tr) {
      tr.classList.toggle("selected", tr.dataset.id === String(row.id));
    });
    $("#detail").hidden = false;
    $("#detail-title").textContent = "#" + row.id + " · " + (row.model || row.model_requested) +
      " · " + row.outcome;
    $("#detail-admin").href = adminUrl(row);
    $("#detail-capture").hidden = !row.has_capture;
    $("#detail-capture").href = row.has_capture ? captureUrl(row) : "#";
    drawTimeline(row);
    var dl = $("#detail-fields");
    dl.replaceChildren();
    Object.keys(row).forEach(function (k) {
      var v = row[k];
      var text = v === null || v === undefined || v === "" ? "—" :
        typeof v === "object" ? JSON.stringify(v) : String(v);
      dl.appendChild(el("div", { "data-field": k }, [el("dt", {}, k), el("dd", {}, text)]));
    });
    $("#detail").scrollIntoView({ block: "nearest" });
  }

  /** received → dispatched → first byte → finished, as one bar: the queue (the load waited
   * for, swap_ms, is its last part), the time to first token, the streaming. */
  function phases(row) {
    var t0 = Date.parse(row.received_at);
    var at = function (iso) { return iso ? Date.parse(iso) - t0 : null; };
    var end = at(row.finished_at);
    if (end === null) {
      end = row.duration_ms || 0;
    }
    var dispatched = at(row.dispatched_at);
    var first = at(row.first_byte_at);
    var out = [];
    if (dispatched === null) {
      out.push({ name: "queue", from: 0, to: end, note: "never dispatched" });
      return { total: end, parts: out };
    }
    var swap = Math.min(row.swap_ms || 0, dispatched);
    out.push({ name: "queue", from: 0, to: dispatched - swap });
    if (swap > 0) {
      out.push({ name: "swap", from: dispatched - swap, to: dispatched });
    }
    if (first === null) {
      out.push({ name: "ttft", from: dispatched, to: end, note: "no byte came" });
    } else {
      out.push({ name: "ttft", from: dispatched, to: first });
      out.push({ name: "streaming", from: first, to: end });
    }
    return { total: end, parts: out };
  }

  var PHASE_LABELS = { queue: "queue wait", swap: "swap (model load)",
                       ttft: "time to first token", streaming: "streaming" };

  function drawTimeline(row) {
    var p = phases(row);
    var W = 900, H = 64, L = 4, R = 4;
    var scale = p.total > 0 ? (W - L - R) / p.total : 0;
    var root = svg("svg", { viewBox: "0 0 " + W + " " + H, role: "img" });
    root.appendChild(svg("title", {}, "request timeline: received → dispatched → first byte → finished"));
    p.parts.forEach(function (part) {
      var width = Math.max((part.to - part.from) * scale, part.to > part.from ? 1 : 0);
      var rect = svg("rect", { x: L + part.from * scale, y: 8, width: width, height: 26,
                               "class": "phase phase-" + part.name,
                               "data-testid": "phase-" + part.name });
      tip(rect, PHASE_LABELS[part.name] + ": " + formatMs(part.to - part.from) +
          (part.note ? " (" + part.note + ")" : ""));
      root.appendChild(rect);
    });
    [["received", 0, "start"], ["finished " + formatMs(p.total), p.total, "end"]]
      .forEach(function (m) {
        root.appendChild(svg("text", { x: L + m[1] * scale, y: 52, "class": "tick",
                                       "text-anchor": m[2] }, m[0]));
      });
    var legend = el("ul", { "class": "legend" }, p.parts.map(function (part) {
      return el("li", { "data-testid": "legend-" + part.name }, [
        el("span", { "class": "swatch phase-" + part.name }),
        PHASE_LABELS[part.name] + " " + formatMs(part.to - part.from) +
          (part.note ? " (" + part.note + ")" : "")]);
    }));
    $("#timeline").replaceChildren(root, legend);
  }

  // ---- cards ----------------------------------------------------------------------------

  function renderStats(s) {
    var since = new Date(s.window.since), until = new Date(s.window.until);
    $("#window-label").textContent = clock(since.toISOString()) + " → " +
      clock(until.toISOString()) + (s.model ? " · " + s.model : "");
    $("[data-testid=card-requests]").textContent = String(s.total);
    var parts = Object.keys(s.outcomes).filter(function (o) { return s.outcomes[o]; })
      .map(function (o) { return s.outcomes[o] + " " + o; });
    $("[data-testid=card-outcomes]").textContent = parts.join(", ");
    $("[data-testid=card-error-rate]").textContent = s.error_rate === null ? "—" :
      (100 * s.error_rate).toFixed(s.error_rate < 0.1 ? 1 : 0) + " %";
    ["queue_wait_ms", "ttft_ms", "duration_ms"].forEach(function (k) {
      var card = $("[data-testid=card-" + k + "]");
      var v = s.latency_ms[k];
      var h3 = card.querySelector("h3");
      card.replaceChildren(h3,
        el("p", { "class": "big", "data-testid": "p50" }, v.p50 === null ? "—" : formatMs(v.p50)),
        el("p", { "class": "sub" }, [
          "p50 · p95 ", el("b", { "data-testid": "p95" }, formatMs(v.p95) || "—"),
          " · p99 ", el("b", { "data-testid": "p99" }, formatMs(v.p99) || "—")]));
    });
    var list = $("#model-list");
    list.replaceChildren.apply(list, Object.keys(s.models).map(function (m) {
      return el("option", { value: m });
    }));
    drawHistogram(s.queue_wait_histogram);
    drawSwaps(s.swaps_per_hour, since, until);
    drawSpeeds(s.models);
  }

  // ---- charts ---------------------------------------------------------------------------

  var CHART = { width: 460, height: 190, left: 40, right: 8, top: 10, bottom: 34 };

  function niceTop(max) {
    if (max <= 5) {
      return Math.max(1, Math.ceil(max));
    }
    var power = Math.pow(10, Math.floor(Math.log10(max)));
    var steps = [1, 2, 2.5, 5, 10];
    for (var i = 0; i < steps.length; i++) {
      if (steps[i] * power >= max) {
        return steps[i] * power;
      }
    }
    return 10 * power;
  }

  /** A chart's frame with a count axis from 0 to a round top; returns y(). */
  function countFrame(root, max) {
    var c = CHART;
    var top = niceTop(max);
    var plotH = c.height - c.top - c.bottom;
    function y(v) {
      return c.top + plotH - (v / top) * plotH;
    }
    // counts: no grid line between two whole numbers
    [0, top / 2, top].filter(function (v) { return v === Math.round(v); }).forEach(function (v) {
      root.appendChild(svg("line", { x1: c.left, x2: c.width - c.right, y1: y(v), y2: y(v),
                                     "class": v === 0 ? "axis" : "grid" }));
      root.appendChild(svg("text", { x: c.left - 5, y: y(v) + 4, "class": "tick",
                                     "text-anchor": "end" }, String(Number(v.toFixed(2)))));
    });
    return y;
  }

  function newChart(title, height) {
    var root = svg("svg", { viewBox: "0 0 " + CHART.width + " " + (height || CHART.height),
                            role: "img" });
    root.appendChild(svg("title", {}, title));
    return root;
  }

  function put(id, chart, extra) {
    var fig = $(id);
    fig.replaceChildren.apply(fig, [fig.querySelector("figcaption"), chart].concat(extra || []));
  }

  function edgeLabel(ms) {
    return ms >= 1000 ? (ms / 1000) + "s" : ms + "ms";
  }

  function drawHistogram(h) {
    var edges = h.edges_ms;
    var n = edges.length + 1;
    var names = [];
    for (var i = 0; i < n; i++) {
      names.push(i === 0 ? "<" + edgeLabel(edges[0]) : i === n - 1 ?
        "≥" + edgeLabel(edges[n - 2]) : edgeLabel(edges[i - 1]) + "–" + edgeLabel(edges[i]));
    }
    var bands = BANDS.filter(function (b) { return h.bands[b]; })
      .concat(Object.keys(h.bands).filter(function (b) { return BANDS.indexOf(b) < 0; }));
    var max = 0;
    bands.forEach(function (b) {
      h.bands[b].forEach(function (v) { max = Math.max(max, v); });
    });
    var root = newChart("Queue wait per band, requests per log-scale bucket");
    var y = countFrame(root, max);
    var c = CHART;
    var slot = (c.width - c.left - c.right) / n;
    var barW = Math.max(1, (slot - 3) / Math.max(bands.length, 1));
    for (var k = 0; k < n; k++) {
      bands.forEach(function (b, j) {
        var v = h.bands[b][k];
        if (!v) {
          return;
        }
        root.appendChild(tip(svg("rect", {
          x: c.left + k * slot + 1.5 + j * barW, y: y(v), width: barW, height: y(0) - y(v),
          "class": "hbar band-" + b, "data-testid": "hist-bar", "data-band": b,
          "data-bucket": String(k), "data-count": String(v)
        }), b + ", " + names[k] + ": " + v + " request" + (v === 1 ? "" : "s")));
      });
    }
    // the boundaries' values below the axis, every other one (1 ms, 10 ms … 100 s)
    edges.forEach(function (edge, i) {
      if (i % 2 === 0) {
        var x = c.left + (i + 1) * slot;
        root.appendChild(svg("line", { x1: x, x2: x, y1: y(0), y2: y(0) + 4, "class": "axis" }));
        root.appendChild(svg("text", { x: x, y: c.height - 20, "class": "tick",
                                       "text-anchor": "middle" }, edgeLabel(edge)));
      }
    });
    var legend = el("ul", { "class": "legend" }, bands.map(function (b) {
      return el("li", {}, [el("span", { "class": "swatch band-" + b }), b]);
    }));
    put("#chart-histogram", root, max ? [legend] :
      [el("p", { "class": "chart-note" }, "no request waited in this window")]);
  }

  function drawSwaps(list, since, until) {
    var H = 3600 * 1000;
    var start = Math.floor(since.getTime() / H) * H;
    var n = Math.max(1, Math.floor((until.getTime() - start) / H) + 1);
    var counts = [];
    for (var i = 0; i < n; i++) {
      counts.push(0);
    }
    list.forEach(function (s) {
      var k = Math.floor((Date.parse(s.hour) - start) / H);
      if (k >= 0 && k < n) {
        counts[k] += s.count;
      }
    });
    var max = Math.max.apply(null, counts.concat([0]));
    var root = newChart("Swaps (model loads) per hour");
    var y = countFrame(root, max);
    var c = CHART;
    var slot = (c.width - c.left - c.right) / n;
    counts.forEach(function (v, k) {
      if (!v) {
        return;
      }
      var hour = new Date(start + k * H);
      var width = Math.min(36, Math.max(1, slot - (slot > 4 ? 2 : 0)));
      root.appendChild(tip(svg("rect", {
        x: c.left + (k + 0.5) * slot - width / 2, y: y(v),
        width: width, height: y(0) - y(v), "class": "bar",
        "data-testid": "swap-bar", "data-count": String(v)
      }), clock(hour.toISOString()).slice(0, 13) + ":00: " + v + " load" + (v === 1 ? "" : "s")));
    });
    [[0, "start"], [n - 1, "end"]].forEach(function (m) {
      var hour = new Date(start + m[0] * H);
      root.appendChild(svg("text", { x: m[1] === "start" ? c.left : c.width - c.right,
                                     y: c.height - 20, "class": "tick", "text-anchor": m[1] },
                           clock(hour.toISOString()).slice(5, 13) + ":00"));
    });
    var total = counts.reduce(function (a, b) { return a + b; }, 0);
    put("#chart-swaps", root, [el("p", { "class": "chart-note", "data-testid": "swaps-total" },
      total + " load" + (total === 1 ? "" : "s") + " in the window")]);
  }

  function drawSpeeds(models) {
    var items = Object.keys(models).filter(function (m) {
      return models[m].generation_tps.p50 !== null;
    }).map(function (m) {
      return { model: m, tps: models[m].generation_tps.p50, n: models[m].count };
    }).sort(function (a, b) { return b.tps - a.tps; });
    var row = 22;
    var height = Math.max(CHART.height, 16 + items.length * row);
    var root = newChart("Decode tokens per second per model, median", height);
    var labelW = 130, W = CHART.width, right = 56;
    var max = Math.max.apply(null, items.map(function (i) { return i.tps; }).concat([1]));
    items.forEach(function (item, k) {
      var yy = 8 + k * row;
      var w = ((W - labelW - right) * item.tps) / max;
      root.appendChild(svg("text", { x: labelW - 6, y: yy + 14, "class": "tick",
                                     "text-anchor": "end" },
                           item.model.length > 20 ? item.model.slice(0, 19) + "…" : item.model));
      root.appendChild(tip(svg("rect", { x: labelW, y: yy + 2, width: Math.max(1, w),
                                         height: row - 6, "class": "bar",
                                         "data-testid": "tps-bar", "data-model": item.model }),
                           item.model + ": " + item.tps.toFixed(1) + " tok/s median over " +
                           item.n + " request" + (item.n === 1 ? "" : "s")));
      root.appendChild(svg("text", { x: labelW + w + 4, y: yy + 14, "class": "tick" },
                           item.tps.toFixed(1)));
    });
    put("#chart-tps", root, items.length ? [] :
      [el("p", { "class": "chart-note" }, "no request reported a decode speed")]);
  }

  // ---- start ----------------------------------------------------------------------------

  function bindFilters() {
    var form = $("#filters");
    form.window.value = state.window;
    form.model.value = state.model;
    form.band.value = state.band;
    form.outcome.value = state.outcome;
    $("#page-size").value = String(state.limit);
    ["window", "band", "outcome"].forEach(function (name) {
      form[name].addEventListener("change", function () {
        state[name] = form[name].value;
        reload(true);
      });
    });
    form.model.addEventListener("change", function () {
      state.model = form.model.value.trim();
      reload(true);
    });
    form.addEventListener("submit", function (e) {
      e.preventDefault();
      state.model = form.model.value.trim();
      reload(true);
    });
    $("#refresh").addEventListener("click", function () { reload(false); });
    $("#export").addEventListener("click", exportMarkdown);
    // live: the newest rows as they come, as llama-swap's table; never under a reader's
    // eyes on a later page, nor in a hidden tab
    setInterval(function () {
      if ($("#live").checked && state.offset === 0 && !document.hidden) {
        reload(false);
      }
    }, LIVE_MS);
    $("#page-size").addEventListener("change", function () {
      state.limit = parseInt($("#page-size").value, 10);
      reload(true);
    });
    $("#prev").addEventListener("click", function () {
      state.offset = Math.max(0, state.offset - state.limit);
      loadRows();
    });
    $("#next").addEventListener("click", function () {
      state.offset += state.limit;
      loadRows();
    });
    $("#detail-close").addEventListener("click", function () {
      $("#detail").hidden = true;
      selected = null;
      Array.prototype.forEach.call($("#log-body").children, function (tr) {
        tr.classList.remove("selected");
      });
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    readAddress();
    readColumns();
    bindFilters();
    renderChooser();
    renderHead();
    reload(false);
  });
})();
