/* The logs page (dashboard/templates/dashboard/logs.html): each pane follows one source over
   the page's `feed` (Server-Sent Events: {"reset": true, "lines": [...]} first, then
   {"lines": [...]}) and renders each line's ANSI SGR colours (30-37, 90-97, 40-47, 100-107,
   38/48;5 and ;2, bold, dim, italic, underline, reset) as spans. Every character of a line is
   written with textContent, never as HTML; other escape sequences and control characters are
   dropped, never shown raw. No dependency. */
(function () {
  "use strict";
  var KEEP = 2000;  // lines per pane
  var CSI = /\x1b\[([0-9;:?]*)([@-~])/g;
  var CONTROL = /\x1b[@-Z\\-_]?|[\x00-\x08\x0b-\x1f\x7f]/g;  // what is left after CSI: dropped

  function fresh() {
    return {fg: null, bg: null, bold: false, dim: false, italic: false, underline: false};
  }

  function cube(n) {  /* xterm's 256 colours past the first 16, as rgb() */
    if (n >= 232) { var g = 8 + (n - 232) * 10; return "rgb(" + g + "," + g + "," + g + ")"; }
    n -= 16;
    var steps = [0, 95, 135, 175, 215, 255];
    return "rgb(" + steps[Math.floor(n / 36)] + "," + steps[Math.floor(n / 6) % 6] + "," + steps[n % 6] + ")";
  }

  function extended(codes, i) {  /* 38;5;n or 38;2;r;g;b: [colour, next index] */
    if (codes[i + 1] === 5 && codes.length > i + 2) {
      var n = codes[i + 2];
      if (n < 0 || n > 255 || isNaN(n)) return [null, i + 3];
      return [n < 16 ? {ansi: n} : {rgb: cube(n)}, i + 3];
    }
    if (codes[i + 1] === 2 && codes.length > i + 4) {
      var rgb = codes.slice(i + 2, i + 5).map(function (v) { return Math.max(0, Math.min(255, v || 0)); });
      return [{rgb: "rgb(" + rgb.join(",") + ")"}, i + 5];
    }
    return [null, codes.length];
  }

  function apply(state, params) {
    var codes = params === "" ? [0] : params.split(/[;:]/).map(function (p) { return p === "" ? 0 : parseInt(p, 10); });
    for (var i = 0; i < codes.length; i++) {
      var c = codes[i];
      if (c === 0) { var f = fresh(); Object.keys(f).forEach(function (k) { state[k] = f[k]; }); }
      else if (c === 1) state.bold = true;
      else if (c === 2) state.dim = true;
      else if (c === 3) state.italic = true;
      else if (c === 4) state.underline = true;
      else if (c === 22) { state.bold = false; state.dim = false; }
      else if (c === 23) state.italic = false;
      else if (c === 24) state.underline = false;
      else if (c >= 30 && c <= 37) state.fg = {ansi: c - 30};
      else if (c >= 90 && c <= 97) state.fg = {ansi: c - 90 + 8};
      else if (c === 39) state.fg = null;
      else if (c >= 40 && c <= 47) state.bg = {ansi: c - 40};
      else if (c >= 100 && c <= 107) state.bg = {ansi: c - 100 + 8};
      else if (c === 49) state.bg = null;
      else if (c === 38 || c === 48) {
        var got = extended(codes, i);
        if (c === 38) state.fg = got[0]; else state.bg = got[0];
        i = got[1] - 1;
      }
    }
  }

  function span(state, text) {
    text = text.replace(CONTROL, "");
    if (!text) return null;
    var plain = !state.fg && !state.bg && !state.bold && !state.dim && !state.italic && !state.underline;
    if (plain) return document.createTextNode(text);
    var s = document.createElement("span");
    s.textContent = text;
    var classes = [];
    if (state.fg && state.fg.ansi !== undefined) classes.push("ansi-fg-" + state.fg.ansi);
    if (state.bg && state.bg.ansi !== undefined) classes.push("ansi-bg-" + state.bg.ansi);
    if (state.bold) classes.push("ansi-bold");
    if (state.dim) classes.push("ansi-dim");
    if (state.italic) classes.push("ansi-italic");
    if (state.underline) classes.push("ansi-underline");
    if (classes.length) s.className = classes.join(" ");
    if (state.fg && state.fg.rgb) s.style.color = state.fg.rgb;
    if (state.bg && state.bg.rgb) s.style.backgroundColor = state.bg.rgb;
    return s;
  }

  /* One line as a <div> of text nodes and spans; `state` carries over to the next line, as a
     terminal's does. */
  function render(line, state) {
    var div = document.createElement("div");
    div.className = "log-line";
    var at = 0, m;
    CSI.lastIndex = 0;
    while ((m = CSI.exec(line)) !== null) {
      var part = span(state, line.slice(at, m.index));
      if (part) div.appendChild(part);
      if (m[2] === "m") apply(state, m[1]);
      at = CSI.lastIndex;
    }
    var rest = span(state, line.slice(at));
    if (rest) div.appendChild(rest);
    return div;
  }
  window.gpuproxyAnsi = {render: render, fresh: fresh};

  function Pane(section, feedUrl) {
    var select = section.querySelector("[data-testid=log-source]");
    var lines = section.querySelector("[data-testid=log-lines]");
    var status = section.querySelector("[data-testid=log-status]");
    var follow = section.querySelector("[data-testid=log-follow]");
    var filter = section.querySelector("[data-testid=log-filter]");
    var source = null, state = fresh();

    function shows(div) {  /* the filter: a case-insensitive substring of the line's text */
      var q = filter.value.trim().toLowerCase();
      div.hidden = q !== "" && div.textContent.toLowerCase().indexOf(q) < 0;
    }

    function say(text, kind) { status.textContent = text; status.dataset.state = kind; }

    function add(batch) {
      var stick = follow.checked;
      var frag = document.createDocumentFragment();
      batch.forEach(function (line) {
        var div = render(line, state);
        shows(div);
        frag.appendChild(div);
      });
      lines.appendChild(frag);
      while (lines.childNodes.length > KEEP) lines.removeChild(lines.firstChild);
      if (stick) lines.scrollTop = lines.scrollHeight;
    }

    function open() {
      if (source) source.close();
      lines.textContent = "";
      state = fresh();
      section.dataset.source = select.value;
      say("connecting…", "connecting");
      source = new EventSource(feedUrl + "?source=" + encodeURIComponent(select.value));
      source.onopen = function () { say("following", "live"); };
      source.onmessage = function (e) {
        var msg = JSON.parse(e.data);
        if (msg.reset) { lines.textContent = ""; state = fresh(); }
        add(msg.lines || []);
        say("following", "live");
      };
      source.onerror = function () {
        if (source.readyState === EventSource.CLOSED) {
          say("stopped: the proxy refused this source (reload the page to pick again)", "closed");
        } else {
          say("disconnected, reconnecting…", "connecting");
        }
      };
    }

    select.addEventListener("change", open);
    filter.addEventListener("input", function () {
      lines.querySelectorAll(".log-line").forEach(shows);
    });
    section.querySelector("[data-testid=log-clear]").addEventListener("click", function () {
      lines.textContent = "";
    });
    lines.addEventListener("scroll", function () {  /* scrolled up: stop following */
      var atBottom = lines.scrollHeight - lines.scrollTop - lines.clientHeight < 4;
      if (follow.checked !== atBottom && document.activeElement === lines) follow.checked = atBottom;
    });
    open();
  }

  document.addEventListener("DOMContentLoaded", function () {
    var main = document.querySelector(".logs-page");
    /* ?source=<model> (the overview's "logs" link, llama-swap's model page) picks the first
       pane's source; one the select does not list is ignored, the default stays */
    var wanted = new URLSearchParams(location.search).get("source");
    var first = main.querySelector(".log-pane [data-testid=log-source]");
    if (wanted && first && Array.prototype.some.call(first.options, function (o) {
      return o.value === wanted;
    })) first.value = wanted;
    main.querySelectorAll(".log-pane").forEach(function (s) { new Pane(s, main.dataset.feed); });
  });
})();
