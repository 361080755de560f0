/*
 * The what-if panel of the proxy settings page: what the scheduler, aging divisor and swap
 * affinity bonus being typed would have done to the activity log's last 24 h.
 *
 * The server replays (GET /api/whatif, gpuproxy/api/whatif.py); this only asks, debounced
 * (a stale question is aborted), and renders the answer with textContent. Durations are
 * formatted by guarantees.js's formatDuration (the mirror of scheduling/guarantees.py), and
 * the verdict is the server's text (scheduling/whatif.py), so neither is written a third time.
 * The markup is in templates/admin/scheduling/proxysettings/change_form.html.
 */
(function () {
  "use strict";

  var DEBOUNCE_MS = 400;
  var WINDOW = "24h";
  var BANDS = ["interactive", "normal", "batch", "all"];

  function formatDuration(seconds) {
    return window.gpuproxyGuarantees.formatDuration(seconds);
  }

  function duration(value) {
    return value === null || value === undefined ? "–" : formatDuration(value);
  }

  function count(n) {
    return Number(n).toLocaleString("en-US");
  }

  function el(tag, text, className) {
    var node = document.createElement(tag);
    if (text !== undefined && text !== null) {
      node.textContent = text;
    }
    if (className) {
      node.className = className;
    }
    return node;
  }

  function row(cells, header) {
    var tr = document.createElement("tr");
    cells.forEach(function (cell) {
      var td = el(header ? "th" : "td", cell.text, cell.className);
      if (cell.span) {
        td.colSpan = cell.span;
      }
      if (header && cell.span) {
        td.scope = "colgroup";
      }
      tr.appendChild(td);
    });
    return tr;
  }

  function figures(bands, name) {
    var f = bands[name];
    return f ? [f.p50, f.p95, f.max] : [null, null, null];
  }

  function table(data) {
    var t = el("table", null, "whatif-table");
    t.setAttribute("data-testid", "whatif-table");
    var head = document.createElement("thead");
    head.appendChild(row([{ text: "" }, { text: "" }, { text: "today", span: 3 },
      { text: "what if", span: 3 }], true));
    head.appendChild(row(["band", "n", "p50", "p95", "max", "p50", "p95", "max"].map(
      function (text) { return { text: text }; }), true));
    t.appendChild(head);
    var body = document.createElement("tbody");
    BANDS.forEach(function (name) {
      var a = data.today.bands[name], b = data.other.bands[name];
      if (!a && !b) {
        return;
      }
      var tr = row([{ text: name }, { text: count((a || b).n) }].concat(
        figures(data.today.bands, name).map(function (v) { return { text: duration(v) }; }),
        figures(data.other.bands, name).map(function (v, i) {
          var before = figures(data.today.bands, name)[i];
          var changed = v !== null && before !== null && v !== before;
          return { text: duration(v), className: changed ? "whatif-changed" : "" };
        })));
      tr.setAttribute("data-band", name);
      body.appendChild(tr);
    });
    var swaps = row([{ text: "swaps", span: 2 }, { text: count(data.today.swaps), span: 3 },
      { text: count(data.other.swaps), span: 3,
        className: data.other.swaps !== data.today.swaps ? "whatif-changed" : "" }]);
    swaps.setAttribute("data-testid", "whatif-swaps");
    body.appendChild(swaps);
    var delta = data.other.makespan - data.today.makespan;
    var makespan = row([{ text: "makespan", span: 2 },
      { text: duration(data.today.makespan), span: 3 },
      { text: duration(data.other.makespan) + (delta ? " (" + (delta > 0 ? "+" : "−") +
        formatDuration(Math.abs(delta)) + ")" : ""), span: 3,
        className: delta ? "whatif-changed" : "" }]);
    makespan.setAttribute("data-testid", "whatif-makespan");
    body.appendChild(makespan);
    t.appendChild(body);
    return t;
  }

  function notes(data) {
    var list = el("ul", null, "whatif-notes");
    var lines = (data.notes || []).slice();
    var leftOut = Object.keys(data.window.left_out || {}).map(function (why) {
      return count(data.window.left_out[why]) + " " + why;
    });
    if (leftOut.length) {
      lines.push("not replayed: " + leftOut.join(", "));
    }
    lines.forEach(function (text) {
      list.appendChild(el("li", text));
    });
    return lines.length ? list : null;
  }

  function fidelity(data) {
    var f = data.fidelity, tol = data.tolerance;
    var bad = data.verdict_level === "no" || data.verdict_level === "nothing";
    var p = el("p", null, "whatif-fidelity" + (bad ? " whatif-bad" : ""));
    p.setAttribute("data-testid", "whatif-fidelity");
    p.appendChild(el("strong", "Does today's replay match the log? "));
    p.appendChild(document.createTextNode(
      (f.share_within === null ? "-" : Math.round(f.share_within * 100) + "%") + " of " +
      count(f.n) + " queue waits within " +
      tol.seconds + " s or " + Math.round(tol.share * 100) + "% of the recorded one; swaps: " +
      (f.recorded_swaps === null ? "" : "recorded " + count(f.recorded_swaps) + ", ") +
      "replayed " + count(f.replayed_swaps) + " — " + data.verdict + "."));
    return p;
  }

  function render(result, data) {
    while (result.firstChild) {
      result.removeChild(result.firstChild);
    }
    result.appendChild(el("p", count(data.window.requests) + " requests of " +
      data.window.label + " replayed", "help whatif-window"));
    result.appendChild(table(data));
    var n = notes(data);
    if (n) {
      result.appendChild(n);
    }
    result.appendChild(fidelity(data));
  }

  function start() {
    var panel = document.getElementById("whatif");
    var state = document.getElementById("whatif-state");
    var result = document.getElementById("whatif-result");
    var scheduler = document.getElementById("id_scheduler");
    var divisor = document.getElementById("id_aging_divisor");
    var bonus = document.getElementById("id_swap_affinity_bonus");
    var budget = document.getElementById("id_affinity_budget");
    if (!panel || !state || !result || !window.gpuproxyGuarantees) {
      return;
    }
    // A view-only page shows the values as text, not inputs: ask about today's values.
    var inputs = [scheduler, divisor, bonus, budget].filter(function (x) { return x; });
    var timer = null;
    var inFlight = null;

    function show(text, kind) {
      state.textContent = text;
      state.className = "whatif-state" + (kind ? " whatif-" + kind : "");
      state.hidden = !text;
    }

    function ask() {
      timer = null;
      if (inFlight) {
        inFlight.abort();
      }
      var controller = new AbortController();
      inFlight = controller;
      var query = new URLSearchParams({ window: WINDOW });
      [[scheduler, "scheduler"], [divisor, "aging_divisor"], [bonus, "swap_affinity_bonus"],
       [budget, "affinity_budget"]].forEach(function (pair) {
        if (pair[0]) {
          query.set(pair[1], pair[0].value);
        }
      });
      show("computing…", "busy");
      panel.setAttribute("aria-busy", "true");
      result.classList.add("whatif-stale");
      fetch(panel.getAttribute("data-url") + "?" + query.toString(), {
        signal: controller.signal,
        credentials: "same-origin",
        headers: { Accept: "application/json" },
      }).then(function (response) {
        return response.json().catch(function () {
          return { error: { message: "the server answered " + response.status +
            " without a JSON body" } };
        }).then(function (data) {
          if (controller !== inFlight) {
            return;
          }
          inFlight = null;
          panel.removeAttribute("aria-busy");
          result.classList.remove("whatif-stale");
          if (!response.ok || data.error) {
            result.hidden = true;
            show((data.error && data.error.message) || "the server answered " +
              response.status, "error");
          } else if (data.empty) {
            result.hidden = true;
            show("Nothing to replay in the last 24 h: " + data.message, "empty");
          } else {
            render(result, data);
            result.hidden = false;
            show("", "");
          }
        });
      }).catch(function (err) {
        if (err.name === "AbortError") {
          return;
        }
        if (controller === inFlight) {
          inFlight = null;
          panel.removeAttribute("aria-busy");
          result.hidden = true;
          show("The what-if replay could not be fetched (" + err.message + "): is the " +
            "proxy running? Reload the page to try again.", "error");
        }
      });
    }

    function later() {
      if (timer !== null) {
        clearTimeout(timer);
      }
      timer = setTimeout(ask, DEBOUNCE_MS);
    }

    inputs.forEach(function (input) {
      input.addEventListener(input === scheduler ? "change" : "input", later);
    });
    ask();
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
