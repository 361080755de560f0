/*
 * The overview's Fleet section (dashboard/templates/dashboard/dashboard.html): every node that
 * shares this database, one row each, from `data-fleet` (gpuproxy/api/fleet.py, the staff
 * session's path to what /api/fleet answers).
 *
 * Polled every 2 s rather than sent over the overview's WebSocket: the socket carries this
 * node's own state, pushed by its run loop, while the fleet is other nodes' rows in the
 * database, which only a read can see (the nodes write them about once a second, and a dead
 * node's row says so only by ageing). Node names, model ids and versions come from other
 * processes: written with textContent, never innerHTML. Rows are kept by node, so an opened
 * queue breakdown stays open across polls.
 */
(function () {
  "use strict";

  var EVERY_MS = 2000;
  var BANDS = ["interactive", "normal", "batch"];

  function el(tag, attrs, text) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (name) { node.setAttribute(name, attrs[name]); });
    if (text !== undefined) {
      node.textContent = text;
    }
    return node;
  }

  function setText(node, text) {
    if (node.textContent !== text) {
      node.textContent = text;
    }
  }

  /** A heartbeat's age: tenths of a second while it is young, coarser once it is stale. */
  function age(s) {
    if (s < 60) {
      return Math.max(s, 0).toFixed(1) + " s ago";
    }
    if (s < 3600) {
      return Math.floor(s / 60) + " min ago";
    }
    if (s < 86400) {
      return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min ago";
    }
    return Math.floor(s / 86400) + " d ago";
  }

  /** Each model and band with requests waiting, as "model band: depth (oldest N s)". */
  function queueLines(queue) {
    var lines = [];
    Object.keys(queue || {}).sort().forEach(function (model) {
      var bands = queue[model] || {};
      var names = BANDS.filter(function (b) { return b in bands; })
        .concat(Object.keys(bands).filter(function (b) { return BANDS.indexOf(b) < 0; }));
      names.forEach(function (band) {
        var q = bands[band] || {};
        if (!q.depth) {
          return;
        }
        lines.push(model + " " + band + ": " + q.depth + " (oldest " +
                   Number(q.oldest_wait_s || 0).toFixed(1) + " s)");
      });
    });
    return lines;
  }

  function inFlightTitle(inFlight) {
    return Object.keys(inFlight || {}).sort().filter(function (m) { return inFlight[m]; })
      .map(function (m) { return m + ": " + inFlight[m]; }).join("\n");
  }

  function createRow(n) {
    var row = el("tr", { "data-testid": "fleet-row", "data-node": n.node });
    var name = el("td", { "data-testid": "fleet-node" });
    name.appendChild(el("span", { "class": "model-id" }, n.node));
    var queued = el("details", { "class": "fleet-queue", "data-testid": "fleet-queued" });
    queued.appendChild(el("summary"));
    queued.appendChild(el("ul", { "data-testid": "fleet-queue-lines" }));
    var queuedCell = el("td", { "class": "num" });
    queuedCell.appendChild(queued);
    var status = el("td");
    status.appendChild(el("span", { "data-testid": "fleet-status" }));
    [name, status, el("td", { "class": "num", "data-testid": "fleet-heartbeat" }),
     el("td", { "data-testid": "fleet-loaded" }), queuedCell,
     el("td", { "class": "num", "data-testid": "fleet-in-flight" }),
     el("td", { "class": "path", "data-testid": "fleet-listen" }),
     el("td", { "data-testid": "fleet-version" })].forEach(function (td) {
      row.appendChild(td);
    });
    return row;
  }

  function updateRow(row, n, thisNode) {
    row.setAttribute("data-status", n.status);
    var name = row.querySelector("[data-testid=fleet-node]");
    var mine = name.querySelector(".sub");
    if (n.node === thisNode && !mine) {
      name.appendChild(el("span", { "class": "sub" }, "this node"));
    }
    var status = row.querySelector("[data-testid=fleet-status]");
    status.className = "badge badge-node-" + n.status;
    setText(status, n.status);
    status.title = n.status === "down"
      ? "no heartbeat for longer than the fleet's limit: killed, crashed, frozen or cut off"
      : n.status === "stopped" ? "stopped cleanly (it said so as it stopped)"
      : n.status === "draining" ? "stopping: it finishes what it holds and takes no new work"
      : "heartbeat fresh";
    var beat = row.querySelector("[data-testid=fleet-heartbeat]");
    setText(beat, age(n.heartbeat_age_s));
    beat.title = "last heartbeat " + n.heartbeat_at + " (the database's clock); started " +
      n.started_at + (n.pid ? ", pid " + n.pid : "");
    setText(row.querySelector("[data-testid=fleet-loaded]"),
            n.loaded.length ? n.loaded.join(", ") : "—");
    var details = row.querySelector("[data-testid=fleet-queued]");
    var lines = queueLines(n.queue);
    setText(details.querySelector("summary"), String(n.queue_depth));
    details.title = lines.join("\n");
    var list = details.querySelector("ul");
    if (list.textContent !== lines.join("")) {
      list.replaceChildren.apply(list, lines.map(function (l) {
        return el("li", { "data-testid": "fleet-queue-line" }, l);
      }));
    }
    var flying = row.querySelector("[data-testid=fleet-in-flight]");
    setText(flying, String(n.in_flight_total));
    flying.title = inFlightTitle(n.in_flight);
    // the address other nodes forward to (GPUPROXY_ADVERTISE), else the --listen one
    var address = row.querySelector("[data-testid=fleet-listen]");
    setText(address, n.url || n.listen || "—");
    address.title = n.url ? "advertised; listens on " + (n.listen || "?") : "";
    setText(row.querySelector("[data-testid=fleet-version]"), n.version || "—");
  }

  function render(section, body) {
    var table = section.querySelector("table");
    var tbody = section.querySelector("[data-testid=fleet-nodes]");
    var note = section.querySelector("[data-testid=fleet-note]");
    var nodes = body.fleet || [];
    if (!nodes.length) {
      // SQLite: one line; PostgreSQL with no row yet (no node publishes): nothing to show
      section.hidden = !body.note;
      table.hidden = true;
      note.hidden = !body.note;
      setText(note, body.note ? "One node; the fleet view needs PostgreSQL." : "");
      note.title = body.note || "";
      return;
    }
    section.hidden = false;
    table.hidden = false;
    note.hidden = true;
    // A Map, not {}: `constructor`, `toString` and `__proto__` are node names too.
    var existing = new Map();
    Array.prototype.forEach.call(tbody.children, function (row) {
      existing.set(row.getAttribute("data-node"), row);
    });
    nodes.forEach(function (n, i) {
      var row = existing.get(n.node) || createRow(n);
      existing.delete(n.node);
      updateRow(row, n, body.this_node);
      if (tbody.children[i] !== row) {
        tbody.insertBefore(row, tbody.children[i] || null);
      }
    });
    existing.forEach(function (row) { row.remove(); });
  }

  /** A failed read: say why under the table, and keep the last rows (they are what is known). */
  function failed(section, text) {
    var note = section.querySelector("[data-testid=fleet-note]");
    section.hidden = false;
    note.hidden = false;
    setText(note, "The fleet view could not be read: " + text);
    note.title = "";
  }

  function start() {
    var section = document.getElementById("fleet");
    var url = document.body.getAttribute("data-fleet");
    if (!section || !url) {
      return;
    }
    function poll() {
      fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } })
        .then(function (response) {
          return response.json().then(function (body) {
            if (response.ok) {
              render(section, body);
            } else {
              failed(section, (body.error && body.error.message) || "HTTP " + response.status);
            }
          });
        })
        .catch(function () { failed(section, "the proxy did not answer; retrying"); })
        .then(function () { setTimeout(poll, EVERY_MS); });
    }
    poll();
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
