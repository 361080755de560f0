/*
 * The guarantees panel of the proxy settings page, re-rendered as the admin types.
 *
 * A line-for-line mirror of scheduling/guarantees.py, which renders the same panel on the
 * server (so the page is right without JavaScript); tests/test_guarantees.py runs both on the
 * same values and compares the text. Change them together. No library, no CDN.
 */
(function () {
  "use strict";

  var BAND_GAP = 100;
  var MAX_BONUS = BAND_GAP - 1;
  var NUMBER = /^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$/;
  var AUTO_SWAPS = 6; // scheduling/affinity_budget.py, as MAX_BUDGET_SECONDS
  var MAX_BUDGET_SECONDS = 365 * 86400;
  var BUDGET_SECONDS = /^(\d+\.?\d*|\.\d+)[ \t\n\r\f\v]*s?$/;

  function guarantee(title, text, ok) {
    return { title: title, text: text, ok: ok === undefined ? true : ok };
  }

  function halfUp(value) {
    return Math.floor(value + 0.5);
  }

  function formatDuration(seconds) {
    if (seconds < 10) {
      return (halfUp(seconds * 100) / 100).toFixed(2).replace(/\.?0+$/, "") + " s";
    }
    if (seconds < 120) {
      return halfUp(seconds) + " s";
    }
    var whole, rest;
    if (seconds < 2 * 3600) {
      whole = halfUp(seconds);
      rest = whole % 60;
      return Math.floor(whole / 60) + " min" + (rest ? " " + rest + " s" : "");
    }
    if (seconds < 2 * 86400) {
      whole = halfUp(seconds / 60);
      rest = whole % 60;
      return Math.floor(whole / 60) + " h" + (rest ? " " + rest + " min" : "");
    }
    whole = halfUp(seconds / 3600);
    rest = whole % 24;
    return Math.floor(whole / 24) + " d" + (rest ? " " + rest + " h" : "");
  }

  function number(value) {
    return String(value);
  }

  function parseNumber(text) {
    text = (text || "").trim();
    if (!NUMBER.test(text)) {
      return null;
    }
    var value = Number(text);
    return isFinite(value) ? value : null;
  }

  /* scheduling/affinity_budget.py's parse_budget, for the text typed: {seconds, swaps}, or
   * null where it would raise (refused on save). */
  function parseBudget(text) {
    text = (text || "").replace(/^[ \t\n\r\f\v]+|[ \t\n\r\f\v]+$/g, "").toLowerCase();
    if (text === "" || text === "off") {
      return { seconds: 0, swaps: 0 };
    }
    if (text === "auto") {
      return { seconds: 0, swaps: AUTO_SWAPS };
    }
    if (BUDGET_SECONDS.test(text)) {
      var seconds = Math.round(parseFloat(text) * 1000) / 1000; // to the millisecond
      return seconds > MAX_BUDGET_SECONDS ? null : { seconds: seconds, swaps: 0 };
    }
    return null;
  }

  function problems(agingDivisor, bonus, budget) {
    var found = [];
    if (parseBudget(budget) === null) {
      found.push(guarantee("Affinity budget",
        "affinityBudget must be auto, a number of seconds or empty (off) — refused on save",
        false));
    }
    if (bonus === null || !isFinite(bonus)) {
      found.push(guarantee("Swap affinity bonus",
        "swapAffinityBonus is not a number — refused on save", false));
    } else if (bonus !== Math.trunc(bonus)) {
      found.push(guarantee("Swap affinity bonus",
        "swapAffinityBonus must be a whole number — refused on save", false));
    } else if (bonus < 0) {
      found.push(guarantee("Swap affinity bonus",
        "bonus < 0: it must be 0.." + MAX_BONUS + " — refused on save", false));
    } else if (bonus > MAX_BONUS) {
      found.push(guarantee("Band isolation",
        "bonus ≥ " + BAND_GAP + ": band isolation is broken (the bonus would lift a request " +
        "into the next band) — refused on save", false));
    }
    if (agingDivisor === null || !isFinite(agingDivisor)) {
      found.push(guarantee("Aging", "agingDivisor is not a number — refused on save", false));
    } else if (agingDivisor <= 0) {
      found.push(guarantee("Aging",
        "agingDivisor ≤ 0: waiting would never raise a score, so low priorities could " +
        "starve — refused on save", false));
    }
    return found;
  }

  function noOvertakingAfter(gap, agingDivisor, bonus) {
    return (gap + bonus) * agingDivisor;
  }

  function crossover(gap, agingDivisor, affinity) {
    return (gap + (affinity || 0)) * agingDivisor;
  }

  function budgetText(budgetTyped, d, b) {
    if (!b) {
      return "with a bonus of 0 there is no affinity to bound.";
    }
    var budget = parseBudget(budgetTyped);
    var then = " plus the service running then; affinity is then ignored for it until it " +
      "is served.";
    if (budget.swaps) {
      return "auto: no request is kept back by affinity for longer than " +
        number(budget.swaps) + " × its model's measured swap cost (a 30 s load: " +
        formatDuration(budget.swaps * 30) + ")" + then;
    }
    if (budget.seconds) {
      return "no request is kept back by affinity for longer than " +
        formatDuration(budget.seconds) + then;
    }
    return "off: only the queue bounds how long affinity holds a request back: requests for " +
      "the loaded model arriving more than " + formatDuration(noOvertakingAfter(0, d, b)) +
      " after it no longer pass it, but all that arrived before then go first; auto bounds " +
      "it by " + number(AUTO_SWAPS) + " swap-times.";
  }

  function guarantees(agingDivisor, bonus, budget) {
    var bad = problems(agingDivisor, bonus, budget);
    if (bad.length) {
      return bad;
    }
    var d = agingDivisor, b = Math.trunc(bonus);
    var ds = number(d), bs = String(b);
    var fd = formatDuration;

    function t(gap) {
      return fd(noOvertakingAfter(gap, d, b));
    }

    function formula(gap) {
      return gap ? "(" + gap + " + " + bs + ") × " + ds + " s" : bs + " × " + ds + " s";
    }

    return [
      guarantee("Band isolation",
        "holds: the bonus (" + bs + ") is below the " + BAND_GAP + " points between bands, " +
        "so of two requests that have waited equally long, the one in the higher band always " +
        "wins, whichever model is loaded."),
      guarantee("Batch vs. fresh interactive",
        "a waiting batch request outranks a fresh interactive one after " +
        fd(crossover(200, d)) + " (200 × " + ds + " s)" +
        (b ? " when both or neither have affinity; after " + fd(crossover(200, d, b)) +
             " when only the interactive one has it, " + fd(crossover(200, d, -b)) +
             " when only the batch one has."
           : "; with a bonus of 0, affinity changes nothing.")),
      guarantee("Normal vs. fresh interactive",
        "a normal request outranks a fresh interactive one after " +
        fd(crossover(100, d)) + " (100 × " + ds + " s)" +
        (b ? "; " + fd(crossover(100, d, b)) + " or " + fd(crossover(100, d, -b)) +
             " with affinity on one side."
           : ".")),
      guarantee("No overtaking: batch behind interactive",
        "an interactive request arriving more than " + t(200) + " (" + formula(200) +
        ") after a batch request is never served before it."),
      guarantee("No overtaking: normal behind interactive",
        "an interactive request arriving more than " + t(100) + " (" + formula(100) +
        ") after a normal one is never served before it (the same holds for normal behind " +
        "batch)."),
      guarantee("No overtaking: same priority",
        "a request of the same priority arriving more than " + t(0) + " (" + formula(0) +
        ") later is never served first" +
        (b === 0 ? " (strict arrival order)."
                 : "; that is how far the affinity bonus may reorder a band to save swaps.")),
      guarantee("Longest wait behind interactive",
        "a normal request waits at most " + t(100) + " behind fresh interactive arrivals: " +
        "after that nothing new can pass it, and it waits only for what arrived before."),
      guarantee("Affinity budget", budgetText(budget, d, b)),
    ];
  }

  var api = {
    formatDuration: formatDuration,
    parseNumber: parseNumber,
    parseBudget: parseBudget,
    guarantees: guarantees,
  };

  if (typeof module !== "undefined" && module.exports) {
    module.exports = api; // node, for the parity test
  }
  if (typeof document === "undefined") {
    return;
  }
  globalThis.gpuproxyGuarantees = api; // whatif.js formats its durations with formatDuration

  /* The page: the same markup as templates/admin/scheduling/proxysettings/change_form.html. */
  function render(list, items) {
    while (list.firstChild) {
      list.removeChild(list.firstChild);
    }
    items.forEach(function (g) {
      var li = document.createElement("li");
      li.className = "guarantee " + (g.ok ? "guarantee-ok" : "guarantee-bad");
      var title = document.createElement("strong");
      title.textContent = g.title;
      li.appendChild(title);
      li.appendChild(document.createTextNode(": " + g.text));
      list.appendChild(li);
    });
  }

  function start() {
    var list = document.getElementById("guarantees-list");
    var divisor = document.getElementById("id_aging_divisor");
    var bonus = document.getElementById("id_swap_affinity_bonus");
    var budget = document.getElementById("id_affinity_budget");
    var scheduler = document.getElementById("id_scheduler");
    var fifoNote = document.getElementById("guarantees-fifo");
    if (!list || !divisor || !bonus) {
      return;
    }
    function update() {
      render(list, guarantees(parseNumber(divisor.value), parseNumber(bonus.value),
                              budget ? budget.value : ""));
      if (scheduler && fifoNote) {
        fifoNote.hidden = scheduler.value !== "fifo";
      }
    }
    divisor.addEventListener("input", update);
    bonus.addEventListener("input", update);
    if (budget) {
      budget.addEventListener("input", update);
    }
    if (scheduler) {
      scheduler.addEventListener("change", update);
    }
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
