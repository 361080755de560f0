/*
 * A small Markdown renderer for the playground's chat answers (playground.js), as llama-swap's
 * playground renders them. No dependency: the boxes this runs on are often offline.
 *
 * Safe by construction, since the answer is a model's text and a model repeats what it is
 * fed: every piece of the source is HTML-escaped before it is placed in the output, and the
 * only markup written is this file's own constant tags. The one attribute that takes source
 * text is a link's href, written only for an http(s) URL without quotes, spaces or angle
 * brackets (a `javascript:` link stays text), with rel="noopener noreferrer" target="_blank".
 *
 * What it knows: fenced code blocks (``` or ~~~, with a language; an unterminated fence runs
 * to the end, as a streaming answer's does until it closes), inline code, **bold**, *italic*
 * (and the underscore forms), ~~strike~~, headings, bullet and numbered lists (nested by
 * indentation), block quotes, rules, GitHub tables, paragraphs (a single newline is a line
 * break, as chat models mean it), links and bare http(s) URLs. Math ($...$, $$...$$,
 * \(...\), \[...\]) is shown as monospace text: KaTeX is not available offline.
 *
 * In node (tests/test_markdown_js.py) `module.exports` is the API; in the page it is
 * `window.gpuproxyMarkdown`.
 */
(function (root) {
  "use strict";

  var FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
  var HEADING = /^ {0,3}(#{1,6})(?:\s+(.*?))?(?:\s+#+)?\s*$/;
  var RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
  var QUOTE = /^ {0,3}> ?(.*)$/;
  var ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  var TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;
  var URL_OK = /^https?:\/\/[^\s<>"'`]+$/i;
  var LANG_OK = /^[\w+#.-]{1,32}$/;
  var MARK = "\u0000";

  function esc(text) {
    return String(text).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
  }

  // ---- inline ---------------------------------------------------------------------------

  /* One run of text: code spans, math, links and URLs are set aside first (their insides
   * are not Markdown), the rest escaped, then the emphasis marks turned into tags. */
  function inline(text, noLinks) {
    var stash = [];
    function keep(html) {
      stash.push(html);
      return MARK + (stash.length - 1) + MARK;
    }
    var s = String(text).split(MARK).join("");
    s = s.replace(/(`+)([\s\S]*?[^`])\1(?!`)/g, function (all, ticks, code) {
      var inner = code.replace(/^ ([\s\S]*\S[\s\S]*) $/, "$1");
      return keep("<code>" + esc(inner) + "</code>");
    });
    s = s.replace(/\\\(([\s\S]+?)\\\)|\\\[([\s\S]+?)\\\]/g, function (all, a, b) {
      return keep('<code class="md-math">' + esc(a !== undefined ? a : b) + "</code>");
    });
    s = s.replace(/\$\$([\s\S]+?)\$\$|\$(?=[^\s$])([^$\n]*?[^\s$\\])\$(?!\d)/g,
                  function (all, a, b) {
                    return keep('<code class="md-math">' + esc(a !== undefined ? a : b) + "</code>");
                  });
    if (!noLinks) {
      s = s.replace(/\[([^\]\n]+)\]\(\s*([^()\s]+)\s*\)/g, function (all, label, url) {
        if (!URL_OK.test(url)) return all;
        // a code span in the label is set aside already: keep it, render the rest
        var html = label.split(/(\u0000\d+\u0000)/).map(function (piece, k) {
          return k % 2 ? piece : inline(piece, true);
        }).join("");
        return keep(link(url, html));
      });
      s = s.replace(/<(https?:\/\/[^\s<>"'`]+)>/gi, function (all, url) {
        return keep(link(url, esc(url)));
      });
      s = s.replace(/\bhttps?:\/\/[^\s<>"'`\u0000]+/gi, function (all) {
        // sentence punctuation and emphasis marks after a URL are not part of it
        var m = /[.,:;!?)\]*_~]+$/.exec(all);
        var url = m ? all.slice(0, m.index) : all;
        if (!URL_OK.test(url)) return all;
        return keep(link(url, esc(url))) + all.slice(url.length);
      });
    }
    s = esc(s);
    s = s.replace(/\*\*\*(?=[^\s*])([^*]*?[^\s*])\*\*\*/g, wrap("<strong><em>", "</em></strong>"));
    s = s.replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, wrap("<strong>", "</strong>"));
    s = s.replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, wrap("<strong>", "</strong>", true));
    s = s.replace(/\*(?=[^\s*])([^*]*?[^\s*])\*/g, wrap("<em>", "</em>"));
    s = s.replace(/(^|[^\w])_(?=[^\s_])([^_]*?[^\s_])_(?!\w)/g, wrap("<em>", "</em>", true));
    s = s.replace(/~~(?=\S)([\s\S]*?\S)~~/g, wrap("<del>", "</del>"));
    s = s.replace(/\n/g, "<br>");
    var back = new RegExp(MARK + "(\\d+)" + MARK, "g");
    function restore(all, i) { return stash[Number(i)]; }
    // a link's label may hold a code span's mark: twice at most
    for (var n = 0; n < 3 && s.indexOf(MARK) >= 0; n++) s = s.replace(back, restore);
    return s;
  }

  /* A replacer putting the marked text between `open` and `close`, unless the text holds
   * half of another emphasis (`**a *b** c*`): the marks then stay as they are, so that the
   * tags always nest. `lead`: the pattern's first group is a character kept before. */
  function wrap(open, close, lead) {
    return function (all, a, b) {
      var before = lead ? a : "";
      var inner = lead ? b : a;
      var depth = {};
      var ok = true;
      inner.replace(/<(\/?)(strong|em|del)>/g, function (tag, slash, name) {
        depth[name] = (depth[name] || 0) + (slash ? -1 : 1);
        if (depth[name] < 0) ok = false;
        return tag;
      });
      Object.keys(depth).forEach(function (k) { if (depth[k]) ok = false; });
      return ok ? before + open + inner + close : all;
    };
  }

  function link(url, labelHtml) {
    return '<a href="' + esc(url) + '" rel="noopener noreferrer" target="_blank">' +
      labelHtml + "</a>";
  }

  // ---- blocks ---------------------------------------------------------------------------

  function isBlank(line) { return /^\s*$/.test(line); }

  function startsBlock(line) {
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
      ITEM.test(line) || /^\s*\$\$/.test(line);
  }

  function cells(line) {
    var t = line.trim().replace(/^\|/, "").replace(/\|$/, "");
    return t.split(/(?<!\\)\|/).map(function (c) { return c.trim().replace(/\\\|/g, "|"); });
  }

  function table(head, rule, body) {
    var aligns = cells(rule).map(function (c) {
      var l = c.charAt(0) === ":", r = c.charAt(c.length - 1) === ":";
      return l && r ? "center" : r ? "right" : l ? "left" : "";
    });
    function row(line, tag) {
      var cs = cells(line);
      var out = "<tr>";
      for (var i = 0; i < aligns.length; i++) {
        var align = aligns[i] ? ' class="md-' + aligns[i] + '"' : "";
        out += "<" + tag + align + ">" + inline(cs[i] === undefined ? "" : cs[i]) +
          "</" + tag + ">";
      }
      return out + "</tr>";
    }
    return '<table class="md-table"><thead>' + row(head, "th") + "</thead><tbody>" +
      body.map(function (l) { return row(l, "td"); }).join("") + "</tbody></table>";
  }

  /* A list starting at lines[i]: items at this indentation, their deeper lines rendered
   * as a nested document. Returns [html, next index]. */
  function list(lines, i) {
    var first = ITEM.exec(lines[i]);
    var indent = first[1].length;
    var ordered = /\d/.test(first[2]);
    var start = ordered ? parseInt(first[2], 10) : 1;
    var items = [];
    while (i < lines.length) {
      var m = ITEM.exec(lines[i]);
      if (m && m[1].length === indent && /\d/.test(m[2]) === ordered) {
        items.push([m[3]]);
        i++;
        continue;
      }
      if (isBlank(lines[i])) {
        var next = i + 1 < lines.length ? lines[i + 1] : "";
        var nm = ITEM.exec(next);
        var deeper = /^(\s*)/.exec(next)[1].length > indent;
        if (!isBlank(next) && ((nm && nm[1].length >= indent) || deeper)) {
          items[items.length - 1].push("");
          i++;
          continue;
        }
        break;
      }
      var lead = /^(\s*)/.exec(lines[i])[1].length;
      if (lead > indent || (!m && !startsBlock(lines[i]))) {
        items[items.length - 1].push(lines[i].slice(Math.min(lead, indent + 2)));
        i++;
        continue;
      }
      break;
    }
    var tag = ordered ? "ol" : "ul";
    var html = "<" + tag + (ordered && start !== 1 ? ' start="' + start + '"' : "") + ">" +
      items.map(function (item) {
        var rest = item.slice(1);
        var text = item[0];
        var j = 0;
        while (j < rest.length && !isBlank(rest[j]) && !ITEM.test(rest[j]) &&
               !FENCE.test(rest[j])) {
          text += "\n" + rest[j].trim();
          j++;
        }
        var inner = inline(text);
        var more = rest.slice(j).join("\n");
        return "<li>" + inner + (more.trim() ? blocks(more) : "") + "</li>";
      }).join("") + "</" + tag + ">";
    return [html, i];
  }

  function blocks(text) {
    var lines = text.split("\n");
    var out = [];
    var i = 0;
    while (i < lines.length) {
      var line = lines[i];
      var m;
      if (isBlank(line)) { i++; continue; }
      if ((m = FENCE.exec(line))) {
        var fence = m[1];
        var lang = LANG_OK.test(m[2]) ? m[2] : "";
        var code = [];
        i++;
        var closing = new RegExp("^ {0,3}" + fence.charAt(0) + "{" + fence.length + ",}\\s*$");
        while (i < lines.length && !closing.test(lines[i])) code.push(lines[i++]);
        var open = i >= lines.length;
        i++;
        out.push('<pre class="md-code"' + (lang ? ' data-lang="' + esc(lang) + '"' : "") +
                 (open ? ' data-open=""' : "") + "><code" +
                 (lang ? ' class="language-' + esc(lang) + '"' : "") + ">" +
                 esc(code.join("\n")) + "</code></pre>");
        continue;
      }
      if (/^\s*\$\$/.test(line)) {
        var one = /^\s*\$\$([\s\S]+?)\$\$\s*$/.exec(line);
        if (one) {
          out.push('<pre class="md-math">' + esc(one[1].trim()) + "</pre>");
          i++;
          continue;
        }
        var math = [line.replace(/^\s*\$\$/, "")];
        i++;
        while (i < lines.length && lines[i].indexOf("$$") < 0) math.push(lines[i++]);
        if (i < lines.length) math.push(lines[i++].replace(/\$\$[\s\S]*$/, ""));
        out.push('<pre class="md-math">' + esc(math.join("\n").trim()) + "</pre>");
        continue;
      }
      if ((m = HEADING.exec(line))) {
        var level = m[1].length;
        out.push("<h" + level + ">" + inline(m[2] || "") + "</h" + level + ">");
        i++;
        continue;
      }
      if (RULE.test(line)) {
        out.push("<hr>");
        i++;
        continue;
      }
      if (QUOTE.test(line)) {
        var quoted = [];
        while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
          quoted.push(m[1]);
          i++;
        }
        out.push("<blockquote>" + blocks(quoted.join("\n")) + "</blockquote>");
        continue;
      }
      if (ITEM.test(line)) {
        var done = list(lines, i);
        out.push(done[0]);
        i = done[1];
        continue;
      }
      if (line.indexOf("|") >= 0 && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1]) &&
          lines[i + 1].indexOf("-") >= 0) {
        var head = line;
        var rule = lines[i + 1];
        var body = [];
        i += 2;
        while (i < lines.length && !isBlank(lines[i]) && lines[i].indexOf("|") >= 0) {
          body.push(lines[i++]);
        }
        out.push(table(head, rule, body));
        continue;
      }
      var para = [line.trim()];
      i++;
      while (i < lines.length && !isBlank(lines[i]) && !startsBlock(lines[i])) {
        para.push(lines[i++].trim());
      }
      out.push("<p>" + inline(para.join("\n")) + "</p>");
    }
    return out.join("");
  }

  /* The HTML of a Markdown text; every character of it escaped where it is text. */
  function render(text) {
    return blocks(String(text === null || text === undefined ? "" : text)
      .replace(/\r\n?/g, "\n").replace(/\t/g, "    "));
  }

  var api = {render: render, escape: esc};
  if (typeof module !== "undefined" && module.exports) {
    module.exports = api;
  } else {
    root.gpuproxyMarkdown = api;
  }
})(this);
