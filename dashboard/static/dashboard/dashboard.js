/*
 * The live dashboard (dashboard/templates/dashboard/dashboard.html): one WebSocket, `/ws/dashboard`, and nothing
 * polled. The server sends a whole state at most a few times a second (dashboard/consumer.py
 * lists the messages); this script reconciles it into the page by key, so rows, buttons and
 * the log selection survive an update instead of being rebuilt under the user's pointer.
 *
 * Model ids, client addresses and log lines are user-controlled: everything is written with
 * textContent and DOM calls, never innerHTML. No framework, no chart library, no CDN (the
 * proxy runs on offline GPU boxes); the two charts are drawn here as inline SVG.
 */
(function () {
  "use strict";

  var BANDS = ["interactive", "normal", "batch"];
  var LOG_LINES_KEPT = 1000;
  var BACKOFF_MAX_S = 30;
  var MESSAGES_KEPT = 5;
  var MESSAGE_SECONDS = { ok: 20, info: 20, error: 120 }; // then a message fades away
  var SVG_NS = "http://www.w3.org/2000/svg";

  var ws = null;
  var attempts = 0; // failed connections in a row, for the backoff
  var retryTimer = null;
  var countdownTimer = null;
  var pending = {}; // model id -> action sent and not answered yet
  var pendingNotes = {}; // model id -> its "loading a…" message, replaced by the result
  var cancelled = {}; // request id -> what it was, to say so when the result comes
  var lastHistory = null; // JSON of the last drawn history: redraw only when it changed
  var logSource = ""; // what the log tail shows ("" = off)
  var profilePending = false; // a profile switch sent and not answered yet
  var profileActive = ""; // the active profile as the last state said ("" = none)
  var baseTitle = ""; // the page's own title, under the connection's mark
  // the tab title's mark, as llama-swap's: connected, trying to, waiting to retry
  var TITLE_MARKS = { connected: "🟢", connecting: "🟡", reconnecting: "🔴" };

  // ---- small helpers --------------------------------------------------------------------

  function $(selector, root) {
    return (root || document).querySelector(selector);
  }

  /** An element with attributes and children (strings become text nodes, never HTML). */
  function el(tag, attrs) {
    var node = document.createElement(tag);
    var name;
    for (name in attrs || {}) {
      if (attrs[name] !== null && attrs[name] !== undefined) {
        node.setAttribute(name, attrs[name]);
      }
    }
    for (var i = 2; i < arguments.length; i++) {
      var child = arguments[i];
      if (child === null || child === undefined) {
        continue;
      }
      node.appendChild(typeof child === "string" ? document.createTextNode(child) : child);
    }
    return node;
  }

  function svg(tag, attrs) {
    var node = document.createElementNS(SVG_NS, tag);
    for (var name in attrs || {}) {
      node.setAttribute(name, attrs[name]);
    }
    return node;
  }

  function setText(node, text) {
    text = text === null || text === undefined ? "" : String(text);
    if (node.textContent !== text) {
      node.textContent = text;
    }
  }

  function formatSeconds(s) {
    if (s === null || s === undefined) {
      return "—";
    }
    if (s < 10) {
      return s.toFixed(1) + " s";
    }
    if (s < 120) {
      return Math.round(s) + " s";
    }
    if (s < 7200) {
      var whole = Math.round(s);
      return Math.floor(whole / 60) + " min " + (whole % 60) + " s";
    }
    var minutes = Math.round(s / 60);
    return Math.floor(minutes / 60) + " h " + (minutes % 60) + " min";
  }

  function formatMs(ms) {
    if (ms === null || ms === undefined) {
      return "—";
    }
    return ms < 1000 ? Math.round(ms) + " ms" : formatSeconds(ms / 1000);
  }

  function formatBytes(n) {
    if (n === null || n === undefined) {
      return "—";
    }
    if (n < 1024) {
      return n + " B";
    }
    if (n < 1024 * 1024) {
      return (n / 1024).toFixed(1) + " KiB";
    }
    return (n / 1024 / 1024).toFixed(1) + " MiB";
  }

  /** A typographic minus: "−100" reads better than "-100" in a table. */
  function signed(text) {
    return String(text).replace(/^-/, "−");
  }

  function formatPriority(p) {
    return p > 0 ? "+" + p : signed(p);
  }

  function clock(date) {
    return date.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit",
                                          hour12: false });
  }

  /**
   * Make `tbody`'s keyed rows match `items`, in order: existing rows are updated in place,
   * new ones created, missing ones removed. Returns nothing; `update` sees every row.
   */
  function syncRows(tbody, items, keyOf, create, update) {
    var existing = new Map();
    Array.prototype.forEach.call(tbody.children, function (row) {
      existing.set(row.dataset.key, row);
    });
    var previous = null;
    items.forEach(function (item) {
      var key = String(keyOf(item));
      var row = existing.get(key);
      if (row) {
        existing.delete(key);
      } else {
        row = create(item);
        row.dataset.key = key;
      }
      update(row, item);
      var wanted = previous ? previous.nextSibling : tbody.firstChild;
      if (row !== wanted) {
        tbody.insertBefore(row, wanted);
      }
      previous = row;
    });
    existing.forEach(function (row) {
      row.remove();
    });
  }

  /** A cell whose seconds keep counting between states (elapsed, waited). */
  function setTicking(node, seconds) {
    node.dataset.tickBase = String(seconds);
    node.dataset.tickAt = String(performance.now());
    setText(node, formatSeconds(seconds));
  }

  function tick() {
    var now = performance.now();
    document.querySelectorAll("[data-tick-base]").forEach(function (node) {
      var base = Number(node.dataset.tickBase);
      var at = Number(node.dataset.tickAt);
      setText(node, formatSeconds(base + (now - at) / 1000));
    });
  }

  // ---- messages -------------------------------------------------------------------------

  function say(text, kind) {
    kind = kind || "info";
    var list = $("#messages");
    var item = el("li", { "class": "message message-" + kind, "data-testid": "result" },
                  el("time", {}, clock(new Date())), " ", text);
    list.insertBefore(item, list.firstChild);
    while (list.children.length > MESSAGES_KEPT) {
      list.lastChild.remove();
    }
    setTimeout(function () { item.remove(); }, MESSAGE_SECONDS[kind] * 1000);
    return item;
  }

  // ---- the socket -----------------------------------------------------------------------

  function send(message) {
    if (ws === null || ws.readyState !== WebSocket.OPEN) {
      say("not connected: " + message.action + " was not sent", "error");
      return false;
    }
    ws.send(JSON.stringify(message));
    return true;
  }

  function setConnection(kind, text) {
    var node = $("#connection");
    node.className = "conn conn-" + kind;
    setText(node, text);
    document.title = TITLE_MARKS[kind] + " " + baseTitle; // seen from another tab too
    $("#main").classList.toggle("stale", kind !== "connected");
  }

  function connect() {
    var scheme = location.protocol === "https:" ? "wss://" : "ws://";
    var socket = new WebSocket(scheme + location.host + document.body.dataset.ws);
    ws = socket;
    setConnection("connecting", attempts ? "reconnecting…" : "connecting…");
    socket.onopen = function () {
      attempts = 0;
      setConnection("connected", "connected");
      if (logSource) {
        send({ action: "logs", source: logSource }); // the tail ended with the old socket
      }
    };
    socket.onmessage = function (event) {
      var message;
      try {
        message = JSON.parse(event.data);
      } catch (e) {
        return;
      }
      if (message.type === "state") {
        render(message.state);
      } else if (message.type === "result") {
        onResult(message);
      } else if (message.type === "log") {
        onLog(message);
      }
    };
    socket.onclose = function () {
      if (ws !== socket) {
        return;
      }
      ws = null;
      pending = {};
      profilePending = false;
      $("#profile-select").disabled = false;
      Object.keys(pendingNotes).forEach(function (id) { pendingNotes[id].remove(); });
      pendingNotes = {};
      scheduleReconnect();
    };
  }

  /** Exponential backoff with jitter, capped: a proxy restart is not met by a storm. */
  function scheduleReconnect() {
    attempts += 1;
    var delay = Math.min(BACKOFF_MAX_S, Math.pow(2, attempts - 1)) * (0.75 + Math.random() / 2);
    var due = performance.now() + delay * 1000;
    var hint = attempts >= 4 ? " (if it persists, log in again)" : "";
    function countdown() {
      var left = Math.max(0, Math.ceil((due - performance.now()) / 1000));
      setConnection("reconnecting", "disconnected, reconnecting in " + left + " s" + hint);
    }
    countdown();
    clearInterval(countdownTimer);
    countdownTimer = setInterval(countdown, 1000);
    clearTimeout(retryTimer);
    retryTimer = setTimeout(function () {
      clearInterval(countdownTimer);
      connect();
    }, delay * 1000);
  }

  function onResult(message) {
    var target = message.target === null || message.target === undefined
      ? "" : String(message.target);
    if (pending[target] === message.action) {
      delete pending[target];
      if (pendingNotes[target]) {
        pendingNotes[target].remove();
        delete pendingNotes[target];
      }
    }
    var text = message.message || (message.ok ? "done" : "failed");
    if (message.action === "profile") {
      profilePending = false;
      $("#profile-select").disabled = false;
      if (!message.ok) {
        $("#profile-select").value = profileActive; // back to the one in force, at once
        text = "could not switch the profile: " + text;
      }
    } else if (message.action === "cancel") {
      var what = "the request " + (cancelled[target] || target);
      delete cancelled[target];
      text = message.ok ? "cancelled " + what : "could not cancel " + what + ": " + text;
    } else if (message.action === "unload_all") {
      text = message.ok ? "unloaded all models: " + text : "could not unload all: " + text;
    } else if (!target || text.indexOf(target) < 0) {
      text = message.action + " " + target + ": " + text; // say what it is about
    }
    say(text, message.ok ? "ok" : "error");
  }

  // ---- rendering ------------------------------------------------------------------------

  function render(state) {
    var s = state.scheduler || {};
    setText($("#scheduler-kind"), s.kind);
    setText($("#scheduler-bonus"), s.swap_affinity_bonus);
    setText($("#scheduler-divisor"), s.aging_divisor);
    renderModels(state.models || []);
    renderRouting(state.routing || {});
    renderBands(state.bands || []);
    renderInFlight(state.in_flight || []);
    renderRecent(state.recent || []);
    renderLogSources(state.models || []);
    var history = JSON.stringify(state.history || null);
    if (history !== lastHistory && state.history) {
      lastHistory = history;
      renderCharts(state.history);
    }
  }

  var ACTIONS = [["load", "Load"], ["unload", "Unload"], ["restart", "Restart"]];

  function renderModels(models) {
    syncRows($("#models-body"), models, function (m) { return m.id; }, function (m) {
      var actions = el("td", { "class": "actions" });
      ACTIONS.forEach(function (pair) {
        var button = el("button", { type: "button", "data-testid": pair[0],
                                    "data-action": pair[0] }, pair[1]);
        button.addEventListener("click", function () {
          if (send({ action: pair[0], model: m.id })) {
            pending[m.id] = pair[0];
            if (pendingNotes[m.id]) {
              pendingNotes[m.id].remove();
            }
            pendingNotes[m.id] = say(pair[0] + " " + m.id + "…", "info");
            updateModelButtons(row, row._model);
          }
        });
        actions.appendChild(button);
      });
      var row = el("tr", { "data-testid": "model-row", "data-model": m.id },
        el("td", {}, el("a", { "class": "model-id", "data-testid": "model-id",
                               href: document.body.dataset.activity + "?model=" +
                                 encodeURIComponent(m.id),
                               title: "this model's requests (the Activity page)" }, m.id),
           el("span", { "class": "sub", "data-testid": "model-sub" }),
           el("span", { "class": "tags", "data-testid": "capabilities" })),
        el("td", {}, el("span", { "class": "badge", "data-testid": "state" }),
           " ", el("span", { "class": "badge badge-restart", "data-testid": "restart-needed",
                             title: "the definition changed: it restarts once idle" },
                   "restart needed")),
        el("td", { "class": "num", "data-testid": "in-flight" }),
        el("td", { "class": "num", "data-testid": "pid" }),
        actions);
      actions.appendChild(el("a", { "data-testid": "logs-link",
                                    href: document.body.dataset.logs + "?source=" +
                                      encodeURIComponent(m.id),
                                    title: "this model's output, followed live" }, "logs"));
      // the model's own server (llama-server's web UI) through the proxy, once it is ready
      actions.appendChild(el("a", { "data-testid": "upstream-link", href: m.upstream,
                                    target: "_blank", rel: "noopener",
                                    title: "the model's own server, through the proxy" },
                             "open ↗"));
      return row;
    }, function (row, m) {
      row._model = m;
      var badge = $("[data-testid=state]", row);
      setText(badge, m.state);
      badge.className = "badge badge-" + m.state;
      var sub = [];
      if (m.name && m.name !== m.id) {
        sub.push(m.name);
      }
      if (m.aliases && m.aliases.length) {
        sub.push("aliases: " + m.aliases.join(", "));
      }
      setText($("[data-testid=model-sub]", row), sub.join(" · "));
      var tags = $("[data-testid=capabilities]", row);
      var tagList = m.capabilities || [];
      if (tags.dataset.shown !== tagList.join("|")) {
        tags.dataset.shown = tagList.join("|");
        tags.replaceChildren.apply(tags, tagList.map(function (t) {
          return el("span", { "class": "tag", "data-testid": "capability" }, t);
        }));
      }
      var link = $("[data-testid=upstream-link]", row);
      link.hidden = m.state !== "ready";
      link.setAttribute("href", m.upstream);
      $("[data-testid=restart-needed]", row).hidden = !m.restart_needed;
      setText($("[data-testid=in-flight]", row), m.in_flight);
      setText($("[data-testid=pid]", row), m.pid === null ? "—" : m.pid);
      updateModelButtons(row, m);
    });
    $("#models-empty").hidden = models.length > 0;
    $("#models table").hidden = models.length === 0;
    var running = models.filter(function (m) { return m.state !== "stopped"; });
    var unloadAll = $("#unload-all");
    unloadAll.disabled = running.length === 0 || pending[""] === "unload_all";
    unloadAll.classList.toggle("busy", pending[""] === "unload_all");
    unloadAll._running = running.map(function (m) { return m.id; });
  }

  /** Unload all, after a confirmation that names what stops (llama-swap's UI asks too). */
  function unloadAll() {
    var names = $("#unload-all")._running || [];
    if (!names.length || !window.confirm("Unload all models? " + names.join(", ") +
        (names.length === 1 ? " stops" : " stop") + ", each with its unload timeout to " +
        "exit cleanly; the next request for one loads it again.")) {
      return;
    }
    if (send({ action: "unload_all" })) {
      pending[""] = "unload_all";
      pendingNotes[""] = say("unloading all models…", "info");
      $("#unload-all").disabled = true;
    }
  }

  function updateModelButtons(row, m) {
    var busy = pending[m.id] !== undefined;
    row.querySelectorAll("button[data-action]").forEach(function (button) {
      var action = button.dataset.action;
      var useless = (action === "load" && (m.state === "ready" || m.state === "starting")) ||
                    (action !== "load" && m.state === "stopped");
      button.disabled = busy || useless;
      button.classList.toggle("busy", pending[m.id] === action);
    });
  }

  /** A table of plain rows (few, and rebuilt only when their text changed); a cell is a
   * string, {code: text} or {disabled: text}. */
  function fillTable(box, tbody, rows) {
    var key = JSON.stringify(rows);
    box.hidden = rows.length === 0;
    if (tbody.dataset.shown === key) {
      return;
    }
    tbody.dataset.shown = key;
    tbody.replaceChildren.apply(tbody, rows.map(function (cells) {
      return el.apply(null, ["tr", { "data-testid": "routing-row", "data-key": cells[0] }]
        .concat(cells.map(function (cell) {
          if (typeof cell === "string") {
            return el("td", {}, cell);
          }
          return el("td", {}, cell.code !== undefined ? el("code", {}, cell.code)
                                : el("span", { "class": "disabled" }, cell.disabled));
        })));
    }));
  }

  function renderRouting(r) {
    var router = $("[data-testid=router]");
    setText(router, r.router === "matrix" ? "matrix" : (r.router ? "group" : "—"));
    var profile = r.active_profile;
    var shown = $("[data-testid=active-profile]");
    setText(shown, profile ? profile.name + (profile.defined ? "" : " (not defined)") : "none");
    shown.className = profile && !profile.defined ? "undefined" : "";
    if (profile && profile.description) {
      shown.title = profile.description;
    } else {
      shown.removeAttribute("title");
    }
    renderProfileChoice(r.profiles || [], profile);
    fillTable($("#routing-sets"), $("[data-testid=matrix-sets]"),
      r.router === "matrix" ? (r.matrix_sets || []).map(function (m) {
        return [m.name, { code: m.dsl }];
      }) : []);
    var pins = profile ? profile.pins || {} : {};
    fillTable($("#routing-pins"), $("[data-testid=profile-pins]"),
      Object.keys(pins).map(function (name) {
        return [name, pins[name] ? pins[name] : { disabled: "disabled (404)" }];
      }));
    fillTable($("#routing-selectors"), $("[data-testid=selectors]"),
      (r.selectors || []).map(function (s) {
        var strategy = s.strategy === "spillover" ? "spillover " + s.spillover : s.strategy;
        return [s.id + (s.unlisted ? " (unlisted)" : ""), strategy, s.targets.join(" → "),
                s.pick || "—"];
      }));
    fillTable($("#routing-peers"), $("[data-testid=peers]"),
      (r.peers || []).map(function (p) {
        return [p.id, p.host, p.models.join(", "), p.priority_forward];
      }));
  }

  /** The active profile as a choice (none + each profile), when any is defined: switching
   * sends the "profile" action, whose answer comes as a result, the new pins with the state. */
  function renderProfileChoice(names, profile) {
    var select = $("#profile-select");
    select.hidden = names.length === 0;
    $("[data-testid=active-profile]").hidden = names.length > 0;
    if (!names.length) {
      return;
    }
    var active = profile ? profile.name : "";
    profileActive = active;
    var options = [["", "none"]].concat(names.map(function (n) { return [n, n]; }));
    if (active && names.indexOf(active) < 0) {
      options.push([active, active + " (not defined)"]);
    }
    var key = JSON.stringify(options);
    if (select.dataset.shown !== key) {
      select.dataset.shown = key;
      select.replaceChildren.apply(select, options.map(function (o) {
        return el("option", { value: o[0] }, o[1]);
      }));
    }
    if (!profilePending) {
      select.value = active; // a failed switch goes back to the one in force
    }
  }

  function onProfileChoice() {
    var select = $("#profile-select");
    if (send({ action: "profile", name: select.value || null })) {
      profilePending = true;
      select.disabled = true;
    }
  }

  function renderBands(bands) {
    bands.forEach(function (b) {
      if (BANDS.indexOf(b.band) < 0) {
        return;
      }
      setText($("[data-testid=depth-" + b.band + "]"), b.depth);
      var oldest = $("[data-testid=oldest-" + b.band + "]");
      if (b.depth) {
        setTicking(oldest, b.oldest_wait_s);
      } else {
        delete oldest.dataset.tickBase;
        setText(oldest, "—");
      }
      var waiting = (b.waiting || []).slice().sort(function (x, y) {
        // dispatch order first; requests waiting on a load after them, oldest first
        var px = x.position === null ? Infinity : x.position;
        var py = y.position === null ? Infinity : y.position;
        return px - py || y.waited_s - x.waited_s;
      });
      syncRows($("[data-testid=waiting-" + b.band + "]"), waiting,
        function (r) { return r.seq; }, function (r) {
          return el("tr", { "data-testid": "waiting-row", "data-model": r.model,
                            "data-seq": r.seq },
            el("td", { "data-testid": "position" }),
            el("td", { "data-testid": "model" }, r.model),
            el("td", { "class": "num", "data-testid": "priority" }),
            el("td", { "class": "num", "data-testid": "score" }),
            el("td", { "class": "num", "data-testid": "waited" }));
        }, function (row, r) {
          var position = $("[data-testid=position]", row);
          setText(position, r.loading ? "loading" : "#" + r.position);
          position.className = r.loading ? "loading" : "";
          setText($("[data-testid=priority]", row), formatPriority(r.priority));
          setText($("[data-testid=score]", row), signed(Number(r.score).toFixed(1)));
          setTicking($("[data-testid=waited]", row), r.waited_s);
        });
      var column = $("[data-testid=band-" + b.band + "]");
      $("table", column).hidden = waiting.length === 0;
      var more = $("[data-testid=more-" + b.band + "]");
      var hidden = b.depth - (b.waiting || []).length;
      more.hidden = hidden <= 0;
      setText(more, hidden > 0 ? "… and " + hidden + " more" : "");
      column.classList.toggle("has-waiting", b.depth > 0);
    });
  }

  function renderInFlight(requests) {
    syncRows($("#inflight-body"), requests, function (r) { return r.id; }, function (r) {
      var cancel = el("button", { type: "button", "class": "danger", "data-testid": "cancel" },
                      "Cancel");
      cancel.addEventListener("click", function () {
        var what = "to " + r.model + " from " + (r.client || "an unknown client");
        if (window.confirm("Cancel the request " + what + "? Its client gets an error.")) {
          if (send({ action: "cancel", request_id: r.id })) {
            cancelled[r.id] = what;
            cancel.disabled = true;
          }
        }
      });
      return el("tr", { "data-testid": "inflight-row", "data-id": r.id, "data-model": r.model },
        el("td", { "data-testid": "model" }, r.model),
        el("td", {}, el("span", { "class": "badge badge-band-" + r.band, "data-testid": "band" },
                        r.band)),
        el("td", { "class": "num", "data-testid": "priority" }, formatPriority(r.priority)),
        el("td", {}, el("span", { "data-testid": "client" }, r.client || "—"),
           // the user agent and session id under it (the client's to make long: cut, whole
           // on hover), so the section still fits beside Models
           el("span", { "class": "sub clip", "data-testid": "user-agent",
                        title: r.user_agent || "" }, r.user_agent || ""),
           el("span", { "class": "sub clip", "data-testid": "session",
                        title: r.session_id ? "session id: " + r.session_id : "" },
              r.session_id ? "session " + r.session_id : "")),
        el("td", { "class": "path", "data-testid": "path" },
           r.path + (r.stream ? " (stream)" : "")),
        el("td", { "class": "num", "data-testid": "elapsed" }),
        el("td", { "class": "num", "data-testid": "bytes" }),
        el("td", { "class": "actions" }, cancel));
    }, function (row, r) {
      setTicking($("[data-testid=elapsed]", row), r.elapsed_s);
      setText($("[data-testid=bytes]", row), formatBytes(r.bytes));
    });
    $("#inflight-empty").hidden = requests.length > 0;
    $("#inflight table").hidden = requests.length === 0;
  }

  function renderRecent(rows) {
    syncRows($("#recent-body"), rows, function (r) { return r.request_id; }, function (r) {
      var finished = new Date(r.time);
      var tokens = r.completion_tokens === null || r.completion_tokens === undefined
        ? "—" : String(r.completion_tokens);
      var status = r.status === null || r.status === undefined ? "—" : String(r.status);
      return el("tr", { "data-testid": "recent-row", "data-id": r.request_id,
                        "data-model": r.model || "", "data-band": r.band,
                        "data-outcome": r.outcome },
        el("td", { title: r.time }, isNaN(finished) ? r.time : clock(finished)),
        el("td", { "data-testid": "model" }, r.model || "—"),
        el("td", {}, el("span", { "class": "badge badge-band-" + r.band, "data-testid": "band" },
                        r.band)),
        el("td", {}, el("span", { "class": "badge badge-outcome-" + outcomeKind(r.outcome),
                                  "data-testid": "outcome" }, r.outcome)),
        el("td", { "class": "num", "data-testid": "status" }, status),
        el("td", { "class": "path" }, r.path || ""),
        el("td", { "class": "num" }, formatMs(r.queue_wait_ms)),
        el("td", { "class": "num" }, formatMs(r.ttft_ms)),
        el("td", { "class": "num" }, formatMs(r.duration_ms)),
        el("td", { "class": "num" }, tokens));
    }, function () {});
    $("#recent-empty").hidden = rows.length > 0;
    $("#recent table").hidden = rows.length === 0;
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

  // ---- charts ---------------------------------------------------------------------------

  var CHART = { width: 560, height: 170, left: 44, right: 10, top: 10, bottom: 24 };

  /** A round step for about `ticks` grid lines up to `max`. */
  function niceStep(max, ticks) {
    var raw = max / ticks;
    var power = Math.pow(10, Math.floor(Math.log10(raw)));
    var steps = [1, 2, 2.5, 5, 10];
    for (var i = 0; i < steps.length; i++) {
      if (steps[i] * power >= raw) {
        return steps[i] * power;
      }
    }
    return 10 * power;
  }

  /** The frame of a chart over `n` minutes: axes, grid, labels; returns x() and y().
   * `whole`: the values are counts, so the grid never falls between two whole numbers. */
  function frame(root, n, max, unit, whole) {
    var c = CHART;
    var step = niceStep(max || 1, 3);
    if (whole) {
      step = Math.max(1, Math.round(step));
    }
    var top = Math.max(step, Math.ceil((max || 1) / step) * step);
    var plotW = c.width - c.left - c.right;
    var plotH = c.height - c.top - c.bottom;
    function x(i) {
      return c.left + (n <= 1 ? plotW : (i / (n - 1)) * plotW);
    }
    function y(v) {
      return c.top + plotH - (v / top) * plotH;
    }
    for (var v = 0; v <= top + step / 2; v += step) {
      root.appendChild(svg("line", { x1: c.left, x2: c.width - c.right, y1: y(v), y2: y(v),
                                     "class": v === 0 ? "axis" : "grid" }));
      var label = svg("text", { x: c.left - 6, y: y(v) + 4, "class": "tick",
                                "text-anchor": "end" });
      label.textContent = String(Number(v.toFixed(3))) + unit;
      root.appendChild(label);
    }
    [[0, "−60 min", "start"], [Math.round((n - 1) / 2), "−30 min", "middle"],
     [n - 1, "now", "end"]].forEach(function (t) {
      var label = svg("text", { x: x(t[0]), y: c.height - 6, "class": "tick",
                                "text-anchor": t[2] });
      label.textContent = t[1];
      root.appendChild(label);
    });
    return { x: x, y: y };
  }

  function minuteLabel(start) {
    return new Date(start * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit",
                                                           hour12: false });
  }

  function newChart(title) {
    var root = svg("svg", { viewBox: "0 0 " + CHART.width + " " + CHART.height,
                            role: "img" });
    var t = svg("title", {});
    t.textContent = title;
    root.appendChild(t);
    return root;
  }

  function renderCharts(h) {
    var minutes = h.minute || [];
    var n = minutes.length;

    // queue wait: one line per band, broken where a minute had no dispatch (null)
    var waits = h.queue_wait_avg_s || {};
    var max = 0;
    BANDS.forEach(function (b) {
      (waits[b] || []).forEach(function (v) {
        if (v !== null && v > max) {
          max = v;
        }
      });
    });
    var wait = newChart("Queue wait per band, average per minute, last hour");
    var f = frame(wait, n, max, " s");
    BANDS.forEach(function (b) {
      var values = waits[b] || [];
      var d = "";
      var drawing = false;
      values.forEach(function (v, i) {
        if (v === null || v === undefined) {
          drawing = false;
          return;
        }
        d += (drawing ? " L" : " M") + f.x(i).toFixed(1) + " " + f.y(v).toFixed(1);
        drawing = true;
        var dot = svg("circle", { cx: f.x(i), cy: f.y(v), r: 2.5, "class": "dot band-" + b });
        var tip = svg("title", {});
        tip.textContent = minuteLabel(minutes[i]) + " " + b + ": " + formatSeconds(v) +
          " average, " + ((h.dispatched || {})[b] || [])[i] + " dispatched";
        dot.appendChild(tip);
        wait.appendChild(dot);
      });
      if (d) {
        wait.insertBefore(svg("path", { d: d.trim(), "class": "line band-" + b }),
                          wait.querySelector("circle"));
      }
    });
    var waitBox = $("#chart-wait");
    waitBox.replaceChildren(wait, legend());

    // swaps: one bar per minute
    var swaps = h.swaps || [];
    var most = Math.max.apply(null, swaps.concat([0]));
    var bars = newChart("Swaps per minute, last hour");
    var g = frame(bars, n, Math.max(most, 1), "", true);
    var plotW = CHART.width - CHART.left - CHART.right;
    var barW = Math.max(1, plotW / Math.max(n, 1) - 2);
    swaps.forEach(function (v, i) {
      if (!v) {
        return;
      }
      var bar = svg("rect", { x: g.x(i) - barW / 2, y: g.y(v), width: barW,
                              height: Math.max(0, g.y(0) - g.y(v)), "class": "bar" });
      var tip = svg("title", {});
      tip.textContent = minuteLabel(minutes[i]) + ": " + v + " swap" + (v === 1 ? "" : "s");
      bar.appendChild(tip);
      bars.appendChild(bar);
    });
    var total = swaps.reduce(function (a, b) { return a + b; }, 0);
    $("#chart-swaps").replaceChildren(bars, el("p", { "class": "chart-note",
                                                      "data-testid": "swaps-total" },
      total + " swap" + (total === 1 ? "" : "s") + " in the last hour"));
  }

  function legend() {
    var list = el("ul", { "class": "legend" });
    BANDS.forEach(function (b) {
      list.appendChild(el("li", {}, el("span", { "class": "swatch band-" + b }), b));
    });
    return list;
  }

  // ---- logs -----------------------------------------------------------------------------

  function renderLogSources(models) {
    var select = $("#log-source");
    var wanted = ["", "proxy"].concat(models.map(function (m) { return m.id; }));
    var have = Array.prototype.map.call(select.options, function (o) { return o.value; });
    if (have.join("\n") === wanted.join("\n")) {
      return;
    }
    var current = select.value;
    select.replaceChildren.apply(select, wanted.map(function (value) {
      return el("option", { value: value }, value || "(off)");
    }));
    select.value = wanted.indexOf(current) >= 0 ? current : "";
  }

  function onLog(message) {
    if (!logSource || message.source !== logSource) {
      return; // a late batch of a tail that was just switched off or over
    }
    var pre = $("#log-lines");
    var atBottom = pre.scrollHeight - pre.scrollTop - pre.clientHeight < 30;
    var kept = message.reset ? [] : (pre.textContent ? pre.textContent.split("\n") : []);
    kept = kept.concat(message.lines || []);
    if (kept.length > LOG_LINES_KEPT) {
      kept = kept.slice(kept.length - LOG_LINES_KEPT);
    }
    pre.textContent = kept.join("\n");
    if ($("#log-follow").checked && (atBottom || message.reset)) {
      pre.scrollTop = pre.scrollHeight;
    }
  }

  function onLogSource() {
    logSource = $("#log-source").value;
    $("#log-lines").textContent = "";
    send({ action: "logs", source: logSource || null });
  }

  // ---- start ----------------------------------------------------------------------------

  document.addEventListener("DOMContentLoaded", function () {
    baseTitle = document.title;
    $("#log-source").addEventListener("change", onLogSource);
    $("#profile-select").addEventListener("change", onProfileChoice);
    $("#unload-all").addEventListener("click", unloadAll);
    setInterval(tick, 500);
    connect();
  });
})();
