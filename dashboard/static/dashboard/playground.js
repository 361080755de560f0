/*
 * The playground (dashboard/templates/dashboard/playground.html).
 *
 * Every call goes to the proxy's own /v1/* as a client's would, so what the page shows is
 * what a client gets: the queue, the model loads, the errors. It sends the person's session
 * and the CSRF token of the frame's logout form, never an API key: with keys defined, the
 * proxy accepts that pair from this origin only (gpuproxy/proxy/staff_session.py).
 *
 * Time is performance.now() (monotonic, ms). The WebSocket /ws/dashboard gives the models and
 * their states; a model's "starting" spans are kept so that a request's wait can be drawn as
 * "loading" where its model was loading. Streams are read by hand (fetch + a reader), since
 * EventSource cannot POST; an SSE comment or the proxy's own waiting chunk
 * (id chatcmpl-gpuproxy-wait) is a sign of waiting, not a token.
 *
 * The chat and load-test pickers offer, besides the local models, the selectors and the peers'
 * models the proxy knows (the WebSocket state's `routing`), as llama-swap's load test targets
 * any of them. An answer is rendered as Markdown by markdown.js (text escaped first), once per
 * animation frame while it streams.
 */
(function () {
  "use strict";

  var WAIT_CHUNK = "chatcmpl-gpuproxy-wait";
  var SVG = "http://www.w3.org/2000/svg";
  var modelState = {};   // model id -> "stopped" | "starting" | "ready" | …
  var loadSpans = {};    // model id -> [{start, end}] (end null while starting)
  var modelIds = [];
  var selectors = [];    // the routing section's selectors: {id, strategy, pick, ...}
  var peerModels = [];   // "<peer>/<model>" for each model a peer lists
  var targetsKey = "";   // what the pickers were last filled with

  function $(sel, root) { return (root || document).querySelector(sel); }
  function all(sel, root) { return Array.prototype.slice.call((root || document).querySelectorAll(sel)); }
  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { e.setAttribute(k, attrs[k]); });
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function now() { return performance.now(); }
  function ms(v) { return v === null || v === undefined ? "—" : Math.round(v) + " ms"; }

  function csrf() {
    var input = $("input[name=csrfmiddlewaretoken]");
    return input ? input.value : "";
  }

  /* What an error answer says, for a person: the OpenAI envelope's message, else the text. */
  function errorOf(resp) {
    return resp.text().then(function (text) {
      var message = text;
      try {
        var parsed = JSON.parse(text);
        if (parsed && parsed.error) {
          message = typeof parsed.error === "string" ? parsed.error
            : (parsed.error.message || JSON.stringify(parsed.error));
        }
      } catch (e) { /* not JSON: the text as it is */ }
      return "HTTP " + resp.status + ": " + (message || resp.statusText || "no message");
    });
  }

  function post(path, body, extraHeaders, signal) {
    var headers = {"X-CSRFToken": csrf()};
    Object.keys(extraHeaders || {}).forEach(function (k) { headers[k] = extraHeaders[k]; });
    var isForm = body instanceof FormData;
    if (!isForm) headers["Content-Type"] = "application/json";
    return fetch(path, {method: "POST", credentials: "same-origin", headers: headers,
                        body: isForm ? body : JSON.stringify(body), signal: signal})
      .then(function (resp) {
        if (resp.ok) return resp;
        return errorOf(resp).then(function (m) { throw new Error(m); });
      });
  }

  /* A streamed chat completion. `on`: content(text), reasoning(text), waiting(text). */
  function stream(body, priority, signal, on) {
    return post("/v1/chat/completions", body, {"X-LlamaSwap-Priority": String(priority)}, signal)
      .then(function (resp) {
        var reader = resp.body.getReader();
        var decoder = new TextDecoder();
        var buf = "";
        function handle(event) {
          event.split("\n").forEach(function (line) {
            if (line.charAt(0) === ":") { on.waiting(line.slice(1).trim()); return; }
            if (line.indexOf("data:") !== 0) return;
            var data = line.slice(5).trim();
            if (data === "[DONE]" || data === "") return;
            var obj;
            try { obj = JSON.parse(data); } catch (e) { return; }
            if (obj.error) throw new Error(obj.error.message || JSON.stringify(obj.error));
            var choice = obj.choices && obj.choices[0];
            var delta = (choice && choice.delta) || {};
            if (obj.id === WAIT_CHUNK) { on.waiting(delta.reasoning_content || ""); return; }
            if (delta.reasoning_content) on.reasoning(delta.reasoning_content);
            if (delta.content) on.content(delta.content);
          });
        }
        function pump() {
          return reader.read().then(function (r) {
            if (r.done) { if (buf.trim()) handle(buf); return; }
            buf += decoder.decode(r.value, {stream: true}).replace(/\r\n/g, "\n");
            var i;
            while ((i = buf.indexOf("\n\n")) >= 0) {
              var event = buf.slice(0, i);
              buf = buf.slice(i + 2);
              handle(event);
            }
            return pump();
          });
        }
        return pump();
      });
  }

  // ---- the WebSocket: models and their load state --------------------------------------

  function setConnection(text, cls) {
    var c = $("#connection");
    c.textContent = text;
    c.className = "conn " + cls;
  }

  function onState(state) {
    var t = now();
    var ids = state.models.map(function (m) { return m.id; });
    state.models.forEach(function (m) {
      var before = modelState[m.id];
      var spans = loadSpans[m.id] || (loadSpans[m.id] = []);
      if (m.state === "starting" && before !== "starting") spans.push({start: t, end: null});
      if (m.state !== "starting" && before === "starting" && spans.length) spans[spans.length - 1].end = t;
      modelState[m.id] = m.state;
    });
    var routing = state.routing || {};
    selectors = routing.selectors || [];
    peerModels = [];
    (routing.peers || []).forEach(function (p) {
      (p.models || []).forEach(function (m) { peerModels.push(p.id + "/" + m); });
    });
    var key = [ids.join("\n"), selectors.map(function (x) { return x.id; }).join("\n"),
               peerModels.join("\n")].join("\n\n");
    if (key !== targetsKey) {
      targetsKey = key;
      modelIds = ids;
      all("select.pg-model").forEach(fillModels);
    }
    all("select.pg-model option").forEach(label);
    chat.refresh();
    lt.schedule();
  }

  /* A picker's options: the local models; in a picker marked pg-targets (chat, load test)
   * also the selectors and the peers' models, each group under its name. */
  function fillModels(select) {
    var chosen = select.value;
    select.textContent = "";
    function add(parent, id, kind) {
      var o = el("option", {value: id, "data-kind": kind}, id);
      label(o);
      parent.appendChild(o);
    }
    var wide = select.classList.contains("pg-targets") && (selectors.length || peerModels.length);
    var models = wide ? el("optgroup", {label: "models"}) : select;
    modelIds.forEach(function (id) { add(models, id, "model"); });
    if (wide) {
      select.appendChild(models);
      [["selectors", selectors.map(function (x) { return x.id; }), "selector"],
       ["peers", peerModels, "peer"]].forEach(function (g) {
        if (!g[1].length) return;
        var group = el("optgroup", {label: g[0], "data-kind": g[2]});
        g[1].forEach(function (id) { add(group, id, g[2]); });
        select.appendChild(group);
      });
    }
    var values = all("option", select).map(function (o) { return o.value; });
    if (values.indexOf(chosen) >= 0) select.value = chosen;
  }

  function selectorOf(id) {
    return selectors.filter(function (x) { return x.id === id; })[0] || null;
  }

  /* What an option says: a model's state, a selector's strategy and the target it would
   * pick now, a peer's model as such. */
  function label(o) {
    var kind = o.dataset.kind || "model";
    var sel = kind === "selector" ? selectorOf(o.value) : null;
    o.textContent = kind === "peer" ? o.value + " (peer)"
      : sel ? o.value + " (" + sel.strategy + " selector → " + (sel.pick || "?") + ")"
      : o.value + " (" + (modelState[o.value] || "?") + ")";
  }

  /* The local model whose load a request for `id` waits on: itself, or the model its
   * selector would pick now; a peer's model loads elsewhere (null). */
  function localModel(id) {
    if (modelState[id] !== undefined) return id;
    var sel = selectorOf(id);
    return sel && modelState[sel.pick] !== undefined ? sel.pick : null;
  }

  function connect(attempt) {
    var scheme = location.protocol === "https:" ? "wss://" : "ws://";
    var ws = new WebSocket(scheme + location.host + document.body.dataset.ws);
    ws.onopen = function () { attempt = 0; setConnection("connected", "conn-connected"); };
    ws.onmessage = function (e) {
      var msg = JSON.parse(e.data);
      if (msg.type === "state") onState(msg.state);
    };
    ws.onclose = function () {
      var wait = Math.min(30, Math.pow(2, attempt)) * (0.75 + Math.random() / 2);
      setConnection("disconnected, reconnecting in " + Math.round(wait) + " s", "conn-reconnecting");
      setTimeout(function () { connect(attempt + 1); }, wait * 1000);
    };
  }

  // ---- chat ------------------------------------------------------------------------------

  var chat = (function () {
    var form = $("#chat-form");
    var log = $("#chat-log");
    var status = $("#chat-status");
    var stop = $("#chat-stop");
    var history = [];
    var live = null;  // the exchange in progress: {model, started, first, waitText, ctrl}

    function bubble(role) {
      var b = el("div", {"class": "pg-msg pg-" + role, "data-testid": "chat-" + role});
      b.appendChild(el("div", {"class": "pg-role"}, role));
      log.appendChild(b);
      return b;
    }

    function refresh() {
      if (!live || live.first !== null) return;
      var local = localModel(live.model);
      var loading = local !== null && modelState[local] === "starting";
      var text = loading ? "loading " + local + "…"
        : live.waitText || "waiting for " + live.model + "…";
      status.textContent = text;
      status.dataset.phase = loading ? "loading" : "waiting";
    }

    /* The answer so far as Markdown, at most once a frame while it streams. */
    function markdown(content, raw, now) {
      function draw() {
        content.dataset.frame = "";
        content.innerHTML = window.gpuproxyMarkdown.render(raw());
        log.scrollTop = log.scrollHeight;  // the answer grew: keep its end in view
      }
      if (now) { draw(); return; }
      if (content.dataset.frame) return;
      content.dataset.frame = "1";
      requestAnimationFrame(function () { if (content.dataset.frame) draw(); });
    }

    function send(e) {
      e.preventDefault();
      if (live) return;
      var text = form.message.value.trim();
      if (!text || !form.model.value) return;
      var model = form.model.value;
      history.push({role: "user", content: text});
      bubble("user").appendChild(el("div", {"class": "pg-content"}, text));
      form.message.value = "";
      var messages = (form.system.value.trim()
        ? [{role: "system", content: form.system.value.trim()}] : []).concat(history);
      var b = bubble("assistant");
      var details = el("details", {"class": "pg-reasoning", "data-testid": "chat-reasoning", hidden: ""});
      details.appendChild(el("summary", {}, "reasoning"));
      var thought = el("div", {"class": "pg-thought"});
      details.appendChild(thought);
      b.appendChild(details);
      var content = el("div", {"class": "pg-content pg-md", "data-testid": "chat-content"});
      b.appendChild(content);
      var answer = "";
      function raw() { return answer; }
      live = {model: model, started: now(), first: null, waitText: "", ctrl: new AbortController(),
              tokens: 0};
      var mine = live;
      stop.disabled = false;
      form.querySelector("[data-testid=chat-send]").disabled = true;
      refresh();
      function token() {
        mine.tokens += 1;
        if (mine.first === null) {
          mine.first = now();
          status.dataset.phase = "streaming";
          status.textContent = "streaming… first token after " + ms(mine.first - mine.started);
        }
      }
      var body = {model: model, messages: messages, stream: true,
                  max_tokens: parseInt(form.max_tokens.value, 10) || undefined};
      stream(body, form.priority.value, live.ctrl.signal, {
        content: function (t) {
          token();
          answer += t;
          markdown(content, raw, false);
        },
        reasoning: function (t) { token(); details.hidden = false; thought.textContent += t; },
        waiting: function (t) { if (t) { mine.waitText = t; refresh(); } }
      }).then(function () {
        markdown(content, raw, true);
        history.push({role: "assistant", content: answer});
        var took = now() - mine.started;
        status.dataset.phase = "done";
        status.textContent = "done: first token " + ms(mine.first === null ? null : mine.first - mine.started)
          + ", " + mine.tokens + " tokens in " + ms(took);
      }, function (err) {
        markdown(content, raw, true);
        status.dataset.phase = "error";
        b.classList.add("pg-failed");
        if (err.name === "AbortError") {
          status.textContent = "stopped after " + ms(now() - mine.started);
        } else {
          status.textContent = err.message;
          content.appendChild(el("p", {"class": "pg-error", "data-testid": "chat-error"}, err.message));
        }
        history.pop();  // the question without an answer is not sent again
      }).then(function () {
        live = null;
        stop.disabled = true;
        form.querySelector("[data-testid=chat-send]").disabled = false;
      });
    }

    form.addEventListener("submit", send);
    form.message.addEventListener("keydown", function (e) {
      if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) form.requestSubmit();
    });
    stop.addEventListener("click", function () { if (live) live.ctrl.abort(); });
    $("#chat-clear").addEventListener("click", function () {
      if (live) live.ctrl.abort();
      history = [];
      log.textContent = "";
      status.textContent = "";
    });
    return {refresh: refresh};
  })();

  // ---- load test ------------------------------------------------------------------------

  var lt = (function () {
    var form = $("#lt-form");
    var groups = $("#lt-groups");
    var svg = $("#lt-timeline");
    var stopAll = $("#lt-stop");
    var run = null;  // {t0, requests, ctrl, rank, pending}
    var frame = 0;

    function addGroup(g) {
      var tr = el("tr", {"data-testid": "lt-group"});
      function cell(name, value, attrs) {
        var td = el("td", {"class": "num"});
        var input = el("input", Object.assign({name: name, type: "number", value: value,
                                               "class": "pg-num"}, attrs || {}));
        td.appendChild(input);
        tr.appendChild(td);
      }
      cell("count", g.count, {min: 1, max: 200});
      var mtd = el("td");
      var sel = el("select", {name: "model", "class": "pg-model pg-targets"});
      fillModels(sel);
      mtd.appendChild(sel);
      tr.appendChild(mtd);
      cell("priority", g.priority, {step: 1});
      cell("max_tokens", g.maxTokens, {min: 1});
      cell("words", g.words, {min: 1});
      cell("delay", g.delay, {min: 0});
      var rm = el("button", {type: "button", title: "remove this group"}, "×");
      rm.addEventListener("click", function () { tr.remove(); });
      var td = el("td");
      td.appendChild(rm);
      tr.appendChild(td);
      groups.appendChild(tr);
    }

    function read() {
      return all("tr", groups).map(function (tr) {
        function v(n) { return tr.querySelector("[name=" + n + "]").value; }
        return {count: parseInt(v("count"), 10) || 0, model: v("model"),
                priority: parseInt(v("priority"), 10) || 0,
                maxTokens: parseInt(v("max_tokens"), 10) || 16,
                words: parseInt(v("words"), 10) || 1, delay: parseInt(v("delay"), 10) || 0};
      });
    }

    function prompt(words) {
      var w = [];
      for (var i = 0; i < words; i++) w.push("word" + i);
      return "Repeat these words: " + w.join(" ");
    }

    function fire(g) {
      var r = {index: run.requests.length + 1, model: g.model, local: localModel(g.model),
               priority: g.priority,
               sent: now() - run.t0, first: null, end: null, rank: null, tokens: 0,
               state: "waiting", error: ""};
      run.requests.push(r);
      run.pending += 1;
      function token() {
        r.tokens += 1;
        if (r.first === null) {
          r.first = now() - run.t0;
          r.rank = ++run.rank;
          r.state = "streaming";
          schedule();
        }
      }
      var body = {model: g.model, stream: true, max_tokens: g.maxTokens,
                  messages: [{role: "user", content: prompt(g.words)}]};
      var mine = run;
      stream(body, g.priority, run.ctrl.signal, {content: token, reasoning: token,
                                                 waiting: function () {}})
        .then(function () { r.state = "done"; }, function (err) {
          r.state = "error";
          r.error = err.name === "AbortError" ? "stopped" : err.message;
        })
        .then(function () {
          r.end = now() - mine.t0;
          mine.pending -= 1;
          if (mine.pending === 0 && mine.fired) finish();
          schedule();
        });
    }

    function start(e) {
      e.preventDefault();
      if (run && (run.pending || !run.fired)) return;
      var plan = read().filter(function (g) { return g.count > 0 && g.model; });
      if (!plan.length) return;
      run = {t0: now(), requests: [], ctrl: new AbortController(), rank: 0, pending: 0,
             fired: false};
      var mine = run;
      svg.dataset.state = "running";
      stopAll.disabled = false;
      form.querySelector("[data-testid=lt-run]").disabled = true;
      var gi = 0;
      (function next() {
        if (mine !== run || mine.ctrl.signal.aborted) { mine.fired = true; return; }
        var g = plan[gi++];
        for (var k = 0; k < g.count; k++) fire(g);
        schedule();
        if (gi < plan.length) setTimeout(next, g.delay);
        else {
          mine.fired = true;
          if (mine.pending === 0) finish();
        }
      })();
    }

    function finish() {
      svg.dataset.state = "done";
      stopAll.disabled = true;
      form.querySelector("[data-testid=lt-run]").disabled = false;
      schedule();
    }

    function schedule() {
      if (!frame) frame = requestAnimationFrame(function () { frame = 0; render(); });
    }

    function phaseOf(r) {
      if (r.state === "waiting" && r.local !== null && modelState[r.local] === "starting") {
        return "loading";
      }
      return r.state;
    }

    function pct(sorted, p) {
      if (!sorted.length) return null;
      return sorted[Math.max(0, Math.ceil(p * sorted.length) - 1)];
    }

    function rect(g, x, y, w, h, cls) {
      if (w <= 0) return;
      var r = document.createElementNS(SVG, "rect");
      r.setAttribute("x", x.toFixed(1));
      r.setAttribute("y", y);
      r.setAttribute("width", Math.max(1, w).toFixed(1));
      r.setAttribute("height", h);
      r.setAttribute("class", cls);
      g.appendChild(r);
    }

    function svgText(parent, x, y, text, cls) {
      var t = document.createElementNS(SVG, "text");
      t.setAttribute("x", x);
      t.setAttribute("y", y);
      if (cls) t.setAttribute("class", cls);
      t.textContent = text;
      parent.appendChild(t);
    }

    function render() {
      if (!run) return;
      var t = now() - run.t0;
      var reqs = run.requests;
      var running = run.pending > 0 || !run.fired;
      var end = Math.max(1, t);
      if (!running) reqs.forEach(function (r) { end = Math.max(end, r.end || 0); });
      if (!running) end = Math.max(1, end);
      var left = 150, width = Math.max(400, svg.clientWidth || 900), row = 16, top = 20;
      var scale = (width - left - 10) / end;
      svg.setAttribute("viewBox", "0 0 " + width + " " + (top + reqs.length * row + 4));
      svg.setAttribute("height", top + reqs.length * row + 4);
      svg.textContent = "";
      var step = [0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600]
        .filter(function (c) { return end / 1000 / c <= 8; })[0] || 3600;
      for (var s = 0; s * 1000 <= end; s += step) {
        var x = left + s * 1000 * scale;
        var line = document.createElementNS(SVG, "line");
        line.setAttribute("x1", x); line.setAttribute("x2", x);
        line.setAttribute("y1", top - 4); line.setAttribute("y2", top + reqs.length * row);
        line.setAttribute("class", "lt-grid");
        svg.appendChild(line);
        svgText(svg, x + 2, 12, (Math.round(s * 10) / 10) + " s", "lt-axis");
      }
      reqs.forEach(function (r, i) {
        var g = document.createElementNS(SVG, "g");
        g.setAttribute("data-testid", "lt-row");
        g.setAttribute("data-index", r.index);
        g.setAttribute("data-state", phaseOf(r));
        var y = top + i * row;
        var bandOf = r.priority >= 50 ? "interactive" : r.priority <= -50 ? "batch" : "normal";
        svgText(g, 4, y + 12, "#" + r.index + " " + r.model + " p" + r.priority,
                "lt-label lt-" + bandOf);
        var waitEnd = r.first !== null ? r.first : (r.end !== null ? r.end : t);
        rect(g, left + r.sent * scale, y + 2, (waitEnd - r.sent) * scale, row - 4, "ph-waiting");
        (loadSpans[r.local] || []).forEach(function (span) {
          var a = Math.max(r.sent, span.start - run.t0);
          var b = Math.min(waitEnd, span.end === null ? t : span.end - run.t0);
          if (b > a) rect(g, left + a * scale, y + 2, (b - a) * scale, row - 4, "ph-loading");
        });
        if (r.first !== null) {
          var se = r.end !== null ? r.end : t;
          rect(g, left + r.first * scale, y + 2, (se - r.first) * scale, row - 4,
               r.state === "error" ? "ph-error" : "ph-streaming");
        } else if (r.state === "error") {
          rect(g, left + waitEnd * scale - 3, y + 2, 3, row - 4, "ph-error");
        }
        var title = document.createElementNS(SVG, "title");
        title.textContent = "#" + r.index + " " + r.model + " priority " + r.priority + ": "
          + phaseOf(r) + ", sent " + ms(r.sent) + ", first token "
          + ms(r.first === null ? null : r.first - r.sent) + (r.error ? ", " + r.error : "");
        g.appendChild(title);
        svg.appendChild(g);
      });
      table(reqs);
      totals(reqs);
      var done = reqs.filter(function (r) { return r.state === "done"; }).length;
      var failed = reqs.filter(function (r) { return r.state === "error"; }).length;
      $("#lt-summary").textContent = reqs.length + " requests: " + done + " done, " + failed
        + " failed, " + (reqs.length - done - failed) + " in progress; " + ms(end);
      if (running) schedule();
    }

    function table(reqs) {
      var body = $("#lt-requests");
      body.textContent = "";
      reqs.forEach(function (r) {
        var tr = el("tr", {"data-testid": "lt-request", "data-index": r.index,
                           "data-model": r.model, "data-priority": r.priority,
                           "data-state": phaseOf(r), "data-sent": Math.round(r.sent),
                           "data-rank": r.rank === null ? "" : r.rank});
        [["num", r.index], ["", r.model], ["num", r.priority], ["", phaseOf(r)],
         ["num", ms(r.sent)], ["num", ms(r.first === null ? null : r.first - r.sent)],
         ["num", r.rank === null ? "—" : r.rank],
         ["num", ms(r.end === null ? null : r.end - r.sent)], ["num", r.tokens],
         ["pg-error", r.error]].forEach(function (c) {
          tr.appendChild(el("td", c[0] ? {"class": c[0]} : {}, c[1]));
        });
        body.appendChild(tr);
      });
    }

    function totals(reqs) {
      var by = {};
      reqs.forEach(function (r) { (by[r.priority] = by[r.priority] || []).push(r); });
      var body = $("#lt-totals");
      body.textContent = "";
      Object.keys(by).map(Number).sort(function (a, b) { return b - a; }).forEach(function (p) {
        var rs = by[p];
        var ttft = rs.filter(function (r) { return r.first !== null; })
          .map(function (r) { return r.first - r.sent; }).sort(function (a, b) { return a - b; });
        var dur = rs.filter(function (r) { return r.state === "done"; })
          .map(function (r) { return r.end - r.sent; }).sort(function (a, b) { return a - b; });
        var tr = el("tr", {"data-testid": "lt-total", "data-priority": p});
        [["", p], ["num", rs.length],
         ["num", rs.filter(function (r) { return r.state === "done"; }).length],
         ["num", rs.filter(function (r) { return r.state === "error"; }).length],
         ["num", ms(pct(ttft, 0.5))], ["num", ms(pct(ttft, 0.95))],
         ["num", ms(pct(dur, 0.5))]].forEach(function (c) {
          tr.appendChild(el("td", c[0] ? {"class": c[0]} : {}, c[1]));
        });
        body.appendChild(tr);
      });
    }

    addGroup({count: 4, priority: -100, maxTokens: 24, words: 20, delay: 500});
    addGroup({count: 2, priority: 100, maxTokens: 24, words: 20, delay: 0});
    $("#lt-add").addEventListener("click", function () {
      addGroup({count: 1, priority: 0, maxTokens: 24, words: 20, delay: 0});
    });
    form.addEventListener("submit", start);
    stopAll.addEventListener("click", function () { if (run) run.ctrl.abort(); });
    return {schedule: schedule};
  })();

  // ---- speech: the model's voices ------------------------------------------------------

  /* llama-swap's speech tab asks `/v1/audio/voices?model=` for the list. Asking loads the
   * model, so it happens on a click, never by itself; the answers are kept per model for the
   * page's life. The voice stays free text: a model without the endpoint (or a list without
   * the wanted voice) still speaks with a typed one. The list may be an array of names, or
   * `{voices: [...]}` / `{data: [...]}` of names or of objects with `voice_id`, `id` or
   * `name`. With API keys defined the proxy takes the page's session on a POST only, so a
   * refused GET is asked again as a POST with the model in the body. */
  var voices = (function () {
    var form = $("[data-testid=speech-form]");
    var pick = $("[name=voice_choice]", form);
    var typed = $("[name=voice]", form);
    var note = $("#speech-voices-note");
    var button = $("#speech-voices");
    var known = {};  // model -> [names]

    function names(j) {
      var list = Array.isArray(j) ? j : (j && (j.voices || j.data)) || [];
      return list.map(function (v) {
        return typeof v === "string" ? v : v && (v.voice_id || v.id || v.name);
      }).filter(function (v) { return typeof v === "string" && v; });
    }

    function show(model) {
      var list = known[model];
      pick.textContent = "";
      if (!list || !list.length) {
        pick.hidden = true;
        typed.hidden = false;
        return;
      }
      list.forEach(function (v) { pick.appendChild(el("option", {value: v}, v)); });
      pick.appendChild(el("option", {value: ""}, "other (type it)…"));
      pick.hidden = false;
      pick.value = list.indexOf(typed.value) >= 0 ? typed.value : list[0];
      typed.hidden = pick.value !== "";
    }

    function ask(model) {
      var url = "/v1/audio/voices?model=" + encodeURIComponent(model);
      return fetch(url, {credentials: "same-origin", headers: {Accept: "application/json"}})
        .then(function (resp) {
          if (resp.status === 401 || resp.status === 403) return post(url, {model: model});
          if (resp.ok) return resp;
          return errorOf(resp).then(function (m) { throw new Error(m); });
        })
        .then(function (resp) { return resp.json(); });
    }

    function load() {
      var model = form.model.value;
      if (!model) return;
      button.disabled = true;
      note.dataset.state = "asking";
      note.textContent = "asking " + model + " for its voices…";
      ask(model).then(function (j) {
        known[model] = names(j);
        note.dataset.state = known[model].length ? "listed" : "none";
        note.textContent = known[model].length
          ? known[model].length + " voices from " + model
          : model + " lists no voice: type one";
      }, function (err) {
        known[model] = [];
        note.dataset.state = "failed";
        note.textContent = "no voice list (" + err.message + "): type a voice";
      }).then(function () {
        button.disabled = false;
        if (form.model.value === model) show(model);
      });
    }

    button.addEventListener("click", load);
    pick.addEventListener("change", function () {
      typed.hidden = pick.value !== "";
      if (pick.value === "") typed.focus();
    });
    form.model.addEventListener("change", function () {
      note.textContent = "";
      show(form.model.value);
    });
    return {
      chosen: function () { return !pick.hidden && pick.value ? pick.value : typed.value; }
    };
  })();

  // ---- the other endpoints: one form each -----------------------------------------------

  var simple = {
    images: function (f) {
      return post("/v1/images/generations", {model: f.model.value, prompt: f.prompt.value,
                                            n: 1, size: f.size.value,
                                            response_format: "b64_json"})
        .then(function (resp) { return resp.json(); })
        .then(function (j) {
          var out = el("div", {"class": "pg-images"});
          (j.data || []).forEach(function (d) {
            var src = d.b64_json ? "data:image/png;base64," + d.b64_json : d.url;
            if (src) out.appendChild(el("img", {src: src, alt: f.prompt.value}));
          });
          if (!out.childNodes.length) out.appendChild(el("pre", {}, JSON.stringify(j, null, 2)));
          return out;
        });
    },
    speech: function (f) {
      return post("/v1/audio/speech", {model: f.model.value, input: f.input.value,
                                      voice: voices.chosen()})
        .then(function (resp) { return resp.blob(); })
        .then(function (blob) {
          return el("audio", {controls: "", src: URL.createObjectURL(blob),
                              "data-testid": "speech-audio"});
        });
    },
    transcription: function (f) {
      var data = new FormData();
      data.append("model", f.model.value);
      data.append("file", f.file.files[0]);
      return post("/v1/audio/transcriptions", data)
        .then(function (resp) { return resp.json(); })
        .then(function (j) {
          return el("pre", {"data-testid": "transcript"},
                    typeof j.text === "string" ? j.text : JSON.stringify(j, null, 2));
        });
    },
    rerank: function (f) {
      var docs = f.documents.value.split("\n").map(function (s) { return s.trim(); })
        .filter(Boolean);
      return post("/v1/rerank", {model: f.model.value, query: f.query.value, documents: docs})
        .then(function (resp) { return resp.json(); })
        .then(function (j) {
          var t = el("table", {"class": "grid compact"});
          var head = el("tr");
          ["rank", "score", "document"].forEach(function (h) { head.appendChild(el("th", {}, h)); });
          t.appendChild(head);
          (j.results || []).slice().sort(function (a, b) {
            return b.relevance_score - a.relevance_score;
          }).forEach(function (r, i) {
            var tr = el("tr", {"data-testid": "rerank-row", "data-index": r.index});
            tr.appendChild(el("td", {"class": "num"}, i + 1));
            tr.appendChild(el("td", {"class": "num"}, Number(r.relevance_score).toFixed(3)));
            tr.appendChild(el("td", {}, docs[r.index]));
            t.appendChild(tr);
          });
          return t;
        });
    }
  };

  all("form.pg-simple").forEach(function (f) {
    f.addEventListener("submit", function (e) {
      e.preventDefault();
      var out = $(".pg-result", f);
      var button = $("button[type=submit]", f);
      button.disabled = true;
      out.textContent = "";
      out.appendChild(el("p", {"class": "pg-status"}, "waiting for " + f.model.value + "…"));
      simple[f.dataset.endpoint](f).then(function (node) {
        out.textContent = "";
        out.appendChild(node);
      }, function (err) {
        out.textContent = "";
        out.appendChild(el("p", {"class": "pg-error", "data-testid": "result-error"}, err.message));
      }).then(function () { button.disabled = false; });
    });
  });

  // ---- tabs -------------------------------------------------------------------------------

  function show(name) {
    all("[role=tab]").forEach(function (b) {
      b.setAttribute("aria-selected", String(b.dataset.tab === name));
    });
    all(".pg-panel").forEach(function (p) { p.hidden = p.dataset.panel !== name; });
  }
  all("[role=tab]").forEach(function (b) {
    b.addEventListener("click", function () {
      show(b.dataset.tab);
      history.replaceState(null, "", "#" + b.dataset.tab);
    });
  });
  if (location.hash && $("[data-tab=" + location.hash.slice(1) + "]")) show(location.hash.slice(1));

  connect(0);
})();
