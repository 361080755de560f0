/* The performance page (dashboard/templates/dashboard/performance.html): polls the page's
   `data` endpoint (/api/performance's body, llama-swap's shape) every sampling interval with
   ?after= the newest timestamp it holds, keeps an hour, and draws each chart as inline SVG.
   A GPU chart with no GPU series says so instead of drawing zeros. No dependency. */
(function () {
  "use strict";
  var SVGNS = "http://www.w3.org/2000/svg";
  var H = 170, L = 78, R = 10, T = 10, B = 20;
  var KEEP_MS = 3600 * 1000;
  var root, sys = [], gpu = [], last = null, windowS = 300, every = 5;

  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { e.setAttribute(k, attrs[k]); });
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function svg(tag, attrs, text) {
    var e = document.createElementNS(SVGNS, tag);
    Object.keys(attrs || {}).forEach(function (k) { e.setAttribute(k, attrs[k]); });
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function num(v, unit) {
    if (v === null || v === undefined || !isFinite(v)) return "—";
    var a = Math.abs(v);
    var s = a >= 100 ? v.toFixed(0) : a >= 10 ? v.toFixed(1) : v.toFixed(2);
    return s + (unit ? " " + unit : "");
  }
  function clock(ms) {
    var d = new Date(ms);
    return [d.getHours(), d.getMinutes(), d.getSeconds()]
      .map(function (n) { return String(n).padStart(2, "0"); }).join(":");
  }
  function at(s) { return Date.parse(s.timestamp); }

  /* series: [{label, points: [[ms, value], ...]}]; opts: {unit, max, empty} */
  function draw(name, series, opts) {
    var figure = root.querySelector('[data-chart="' + name + '"]');
    var plot = figure.querySelector(".plot");
    var now = figure.querySelector(".now");
    plot.textContent = "";
    var W = Math.max(320, Math.round(plot.clientWidth));  // drawn at its size: text stays legible
    // the window, or less while the samples span less: a fresh start is not a thin sliver
    var t1 = Date.now();
    var earliest = t1;
    series.forEach(function (s) { if (s.points.length) earliest = Math.min(earliest, s.points[0][0]); });
    var t0 = Math.max(windowS ? t1 - windowS * 1000 : t1 - KEEP_MS, earliest);
    if (t1 - t0 < 10000) t0 = t1 - 10000;
    var shown = series.map(function (s) {
      return {label: s.label, points: s.points.filter(function (p) {
        return p[0] >= t0 && p[1] !== null && isFinite(p[1]);
      })};
    });
    var count = shown.reduce(function (n, s) { return n + s.points.length; }, 0);
    figure.dataset.series = String(series.length);
    figure.dataset.points = String(count);
    if (!series.length || !count) {
      now.textContent = "";
      plot.appendChild(el("p", {"class": "chart-empty", "data-testid": "chart-empty"},
                          series.length ? "no samples in this window yet" : opts.empty));
      return;
    }
    var top = opts.max || 0;
    if (!opts.max) {
      shown.forEach(function (s) { s.points.forEach(function (p) { top = Math.max(top, p[1]); }); });
      top = top > 0 ? top * 1.15 : 1;
    }
    var x = function (t) { return L + (W - L - R) * (t - t0) / Math.max(1, t1 - t0); };
    var y = function (v) { return T + (H - T - B) * (1 - Math.min(v, top) / top); };
    var s = svg("svg", {viewBox: "0 0 " + W + " " + H, width: W, height: H, role: "img",
                        "aria-label": figure.querySelector("figcaption").firstChild.textContent.trim()});
    [0, 0.5, 1].forEach(function (f) {
      var yy = y(top * f);
      s.appendChild(svg("line", {"class": "gridline", x1: L, x2: W - R, y1: yy, y2: yy}));
      s.appendChild(svg("text", {"class": "tick", x: L - 4, y: yy + 4, "text-anchor": "end"},
                        num(top * f, opts.unit)));
    });
    [[t0, "start"], [(t0 + t1) / 2, "middle"], [t1, "end"]].forEach(function (tick) {
      s.appendChild(svg("text", {"class": "tick", x: x(tick[0]), y: H - 4,
                                 "text-anchor": tick[1]}, clock(tick[0])));
    });
    var legend = el("ul", {"class": "legend"});
    shown.forEach(function (ser, i) {
      if (!ser.points.length) return;
      var d = ser.points.map(function (p, j) {
        return (j ? "L" : "M") + x(p[0]).toFixed(1) + "," + y(p[1]).toFixed(1);
      }).join(" ");
      var path = svg("path", {"class": "line s" + (i % 4), d: d});
      var latest = ser.points[ser.points.length - 1][1];
      path.appendChild(svg("title", {}, ser.label + ": " + num(latest, opts.unit)));
      s.appendChild(path);
      if (ser.points.length === 1) {
        var p = ser.points[0];
        s.appendChild(svg("circle", {"class": "dot s" + (i % 4), cx: x(p[0]), cy: y(p[1]), r: 2.5}));
      }
      var item = el("li");
      item.appendChild(el("span", {"class": "swatch s" + (i % 4)}));
      item.appendChild(document.createTextNode(ser.label + " " + num(latest, opts.unit)));
      legend.appendChild(item);
    });
    plot.appendChild(s);
    plot.appendChild(legend);
    var first = shown.find(function (ser) { return ser.points.length; });
    var latest = num(first.points[first.points.length - 1][1], opts.unit);
    now.textContent = latest;
    hover(s, shown, x, t0, t1, now, latest, opts.unit);
  }

  /* Pointing at a chart shows each series' sample nearest that moment in its caption. */
  function hover(s, shown, x, t0, t1, now, latest, unit) {
    var cursor = svg("line", {"class": "cursor", y1: T, y2: H - B, x1: -10, x2: -10});
    s.appendChild(cursor);
    s.addEventListener("mousemove", function (e) {
      var box = s.getBoundingClientRect();
      var t = t0 + (t1 - t0) * (e.clientX - box.left - L) / Math.max(1, box.width - L - R);
      var parts = [], at = null;
      shown.forEach(function (ser) {
        var best = null;
        ser.points.forEach(function (p) {
          if (best === null || Math.abs(p[0] - t) < Math.abs(best[0] - t)) best = p;
        });
        if (best) { parts.push((shown.length > 1 ? ser.label + " " : "") + num(best[1], unit)); at = best[0]; }
      });
      if (at === null) return;
      cursor.setAttribute("x1", x(at)); cursor.setAttribute("x2", x(at));
      now.textContent = "at " + clock(at) + ": " + parts.join(", ");
    });
    s.addEventListener("mouseleave", function () {
      cursor.setAttribute("x1", -10); cursor.setAttribute("x2", -10);
      now.textContent = latest;
    });
  }

  function gpuSeries(field) {
    var byGpu = {}, order = [];
    gpu.forEach(function (g) {
      var key = g.id + "/" + g.uuid;
      if (!byGpu[key]) { byGpu[key] = {label: "#" + g.id + " " + g.name, points: []}; order.push(key); }
      byGpu[key].points.push([at(g), field(g)]);
    });
    return order.map(function (k) { return byGpu[k]; });
  }

  function network() {
    var recv = [], sent = [];
    for (var i = 1; i < sys.length; i++) {
      var a = sys[i - 1], b = sys[i], dt = (at(b) - at(a)) / 1000;
      if (dt <= 0) continue;
      var sum = function (s, key) {
        return (s.net_io || []).reduce(function (n, io) { return n + io[key]; }, 0);
      };
      var r = sum(b, "bytes_recv") - sum(a, "bytes_recv");
      var w = sum(b, "bytes_sent") - sum(a, "bytes_sent");
      if (r < 0 || w < 0) continue;  // a counter reset (an interface came or went)
      recv.push([at(b), r * 8 / dt / 1e6]);
      sent.push([at(b), w * 8 / dt / 1e6]);
    }
    return [{label: "received", points: recv}, {label: "sent", points: sent}];
  }

  function redraw() {
    var noGpu = "no GPU series: the monitor found no GPU (nvidia-smi or rocm-smi) on this machine";
    draw("cpu", [{label: "all cores", points: sys.map(function (s) {
      var c = s.cpu_util_per_core || [];
      return [at(s), c.length ? c.reduce(function (a, b) { return a + b; }, 0) / c.length : null];
    })}], {unit: "%", max: 100});
    var memory = [{label: "memory", points: sys.map(function (s) {
      return [at(s), s.mem_total_mb ? 100 * s.mem_used_mb / s.mem_total_mb : null];
    })}];
    if (sys.some(function (s) { return s.swap_total_mb > 0; })) {
      memory.push({label: "swap", points: sys.map(function (s) {
        return [at(s), s.swap_total_mb ? 100 * s.swap_used_mb / s.swap_total_mb : null];
      })});
    }
    draw("memory", memory, {unit: "%", max: 100});
    draw("load", ["1", "5", "15"].map(function (n) {
      return {label: n + " min", points: sys.map(function (s) { return [at(s), s["load_avg_" + n]]; })};
    }), {});
    draw("network", network(), {unit: "Mbit/s"});
    draw("gpu-util", gpuSeries(function (g) { return g.gpu_util_pct; }),
         {unit: "%", max: 100, empty: noGpu});
    draw("gpu-vram", gpuSeries(function (g) {
      return g.mem_total_mb ? 100 * g.mem_used_mb / g.mem_total_mb : null;
    }), {unit: "%", max: 100, empty: noGpu});
    draw("gpu-temp", gpuSeries(function (g) { return g.temp_c; }), {unit: "°C", empty: noGpu});
    draw("gpu-power", gpuSeries(function (g) { return g.power_draw_w; }), {unit: "W", empty: noGpu});
    root.dataset.samples = String(sys.length);
  }

  function status(text) { document.getElementById("perf-status").textContent = text; }

  function poll() {
    var url = root.dataset.url + (last ? "?after=" + encodeURIComponent(last) : "");
    fetch(url, {credentials: "same-origin", headers: {Accept: "application/json"}})
      .then(function (r) {
        return r.json().then(function (body) { return {status: r.status, body: body}; },
                             function () { return {status: r.status, body: null}; });
      })
      .then(function (res) {
        var off = document.getElementById("perf-off");
        if (res.status === 503 && res.body && res.body.enabled === false) {
          off.hidden = false;
          root.dataset.state = "off";
          status("monitoring is off");
          sys = []; gpu = []; last = null;
          redraw();
          return;
        }
        if (res.status !== 200 || !res.body) {
          root.dataset.state = "error";
          status(res.status === 403 ? "your session ended: log in again"
                                    : "the proxy answered " + res.status + "; trying again");
          return;
        }
        off.hidden = true;
        root.dataset.state = "on";
        sys = sys.concat(res.body.sys_stats || []);
        gpu = gpu.concat(res.body.gpu_stats || []);
        if (sys.length) last = sys[sys.length - 1].timestamp;
        var oldest = Date.now() - KEEP_MS;
        sys = sys.filter(function (s) { return at(s) >= oldest; });
        gpu = gpu.filter(function (g) { return at(g) >= oldest; });
        status(sys.length + " samples, updated " + clock(Date.now()) + ", every " + every + " s");
        redraw();
      })
      .catch(function () { root.dataset.state = "error"; status("the proxy is unreachable; trying again"); })
      .then(function () { setTimeout(poll, every * 1000); });
  }

  document.addEventListener("DOMContentLoaded", function () {
    root = document.getElementById("perf");
    every = Math.min(30, Math.max(1, parseFloat(root.dataset.every) || 5));
    root.querySelectorAll(".segmented button").forEach(function (button) {
      button.addEventListener("click", function () {
        windowS = parseInt(button.dataset.window, 10);
        root.dataset.window = String(windowS);
        root.querySelectorAll(".segmented button").forEach(function (b) {
          b.setAttribute("aria-pressed", String(b === button));
        });
        redraw();
      });
    });
    window.addEventListener("resize", redraw);
    poll();
  });
})();
