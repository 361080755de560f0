"""The playground's Markdown renderer (dashboard/static/dashboard/markdown.js) run in node, as
tests/test_guarantees.py runs the admin's script: what it makes of each construct (the HTML
worked out by hand), of hostile answers (markup, `javascript:` links, attribute breaks, an
unterminated fence), and, over a few thousand answers pieced together at random, that its
output holds only its own tags and attributes, properly nested, with http(s) links only.

The answer is a model's text, and a model repeats what it is fed: the page puts the
renderer's output in with innerHTML, so this is the page's only guard against markup.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests.helpers import tool

JS = Path(__file__).resolve().parents[1] / "dashboard" / "static" / "dashboard" / "markdown.js"
LINK = ' rel="noopener noreferrer" target="_blank"'

NODE_SCRIPT = """
const md = require(process.argv[1]);
const input = JSON.parse(require("fs").readFileSync(0, "utf8"));
process.stdout.write(JSON.stringify(input.map(md.render)));
"""


def render(texts: list[str]) -> list[str]:
    out = subprocess.run([tool("node", "nodejs"), "-e", NODE_SCRIPT, str(JS)],
                         input=json.dumps(texts), text=True, capture_output=True, check=True,
                         timeout=60)
    return json.loads(out.stdout)


CASES = [
    # inline
    ("Some **bold**, *it*, `a<b`.",
     "<p>Some <strong>bold</strong>, <em>it</em>, <code>a&lt;b</code>.</p>"),
    ("snake_case stays, _em_ and __strong__ and ~~gone~~",
     "<p>snake_case stays, <em>em</em> and <strong>strong</strong> and <del>gone</del></p>"),
    ("***both***", "<p><strong><em>both</em></strong></p>"),
    ("2 * 3 * 4", "<p>2 * 3 * 4</p>"),  # spaced stars are arithmetic, not emphasis
    ("*a **b* c**", "<p>*a <strong>b* c</strong></p>"),  # crossing marks: tags still nest
    ("``a `tick` b``", "<p><code>a `tick` b</code></p>"),
    ("line one\nline two", "<p>line one<br>line two</p>"),
    ("first\n\nsecond", "<p>first</p><p>second</p>"),
    # headings, rules, quotes
    ("# Title", "<h1>Title</h1>"),
    ("### Three ###", "<h3>Three</h3>"),
    ("#hashtag", "<p>#hashtag</p>"),
    ("> quoted **b**\n\n---", "<blockquote><p>quoted <strong>b</strong></p></blockquote><hr>"),
    # code blocks
    ("```python\nif a < b:\n    print('x')\n```\nafter",
     '<pre class="md-code" data-lang="python"><code class="language-python">if a &lt; b:\n'
     "    print(&#39;x&#39;)</code></pre><p>after</p>"),
    ("~~~\n**not bold**\n~~~", '<pre class="md-code"><code>**not bold**</code></pre>'),
    # lists
    ("- a\n- b\n  - c\n- d",
     "<ul><li>a</li><li>b<ul><li>c</li></ul></li><li>d</li></ul>"),
    ("3. three\n4. *four*", '<ol start="3"><li>three</li><li><em>four</em></li></ol>'),
    # tables
    ("| a | b |\n|:-:|--:|\n| 1 | `|` |",
     '<table class="md-table"><thead><tr><th class="md-center">a</th>'
     '<th class="md-right">b</th></tr></thead><tbody><tr><td class="md-center">1</td>'
     '<td class="md-right">`</td></tr></tbody></table>'),
    # math: monospace text, no KaTeX
    ("$x^2$ and \\(a+b\\)",
     '<p><code class="md-math">x^2</code> and <code class="md-math">a+b</code></p>'),
    ("$$\n\\int_0^1 f\n$$", '<pre class="md-math">\\int_0^1 f</pre>'),
    ("costs $5 and $10", "<p>costs $5 and $10</p>"),  # money, not math
    # links: http(s) only
    ("[docs](https://example.com/a?b=1&c=2)",
     f'<p><a href="https://example.com/a?b=1&amp;c=2"{LINK}>docs</a></p>'),
    ("see https://example.com/x.",
     f'<p>see <a href="https://example.com/x"{LINK}>https://example.com/x</a>.</p>'),
    ("<https://ok.example/a>",
     f'<p><a href="https://ok.example/a"{LINK}>https://ok.example/a</a></p>'),
    ("[`run` it](http://h:8080/)",
     f'<p><a href="http://h:8080/"{LINK}><code>run</code> it</a></p>'),
]

HOSTILE = [
    ("<img src=x onerror=alert(1)>", "<p>&lt;img src=x onerror=alert(1)&gt;</p>"),
    ("<script>alert(1)</script>", "<p>&lt;script&gt;alert(1)&lt;/script&gt;</p>"),
    ("[click](javascript:alert(1))", "<p>[click](javascript:alert(1))</p>"),
    ("[click](JavaScript:alert`1`)", "<p>[click](JavaScript:alert<code>1</code>)</p>"),
    ("[a](data:text/html;base64,PHNjcmlwdD4=)", "<p>[a](data:text/html;base64,PHNjcmlwdD4=)</p>"),
    ("[a](//evil.example/x)", "<p>[a](//evil.example/x)</p>"),
    ("<javascript:alert(1)>", "<p>&lt;javascript:alert(1)&gt;</p>"),
    # a quote cannot end the href and start an attribute: the URL stops before it
    ('[x](https://a.b/"onmouseover="alert(1))',
     f'<p>[x](<a href="https://a.b/"{LINK}>https://a.b/</a>&quot;onmouseover=&quot;alert(1))</p>'),
    ("**<b onclick=x>bold</b>**",
     "<p><strong>&lt;b onclick=x&gt;bold&lt;/b&gt;</strong></p>"),
    # an unterminated fence is code to the end (a streaming answer's, until it closes)
    ("```js\nunterminated <script>alert(1)</script>",
     '<pre class="md-code" data-lang="js" data-open=""><code class="language-js">unterminated '
     "&lt;script&gt;alert(1)&lt;/script&gt;</code></pre>"),
    # a language that is not a plain word is dropped, not written into the class
    ('```js" onclick="alert(1)\ncode\n```', '<pre class="md-code"><code>code</code></pre>'),
    # the renderer's own placeholder character in the answer cannot pull in other HTML
    ("x\u00000\u0000 `<b>`", "<p>x0 <code>&lt;b&gt;</code></p>"),
    ("$<img src=x>$", '<p><code class="md-math">&lt;img src=x&gt;</code></p>'),
    ("| <i> | b |\n|---|---|\n| [x](javascript:1) | c |",
     '<table class="md-table"><thead><tr><th>&lt;i&gt;</th><th>b</th></tr></thead><tbody>'
     "<tr><td>[x](javascript:1)</td><td>c</td></tr></tbody></table>"),
]


@pytest.mark.parametrize(("cases"), [CASES, HOSTILE], ids=["constructs", "hostile"])
def test_each_construct_renders_to_the_html_worked_out_by_hand(cases):
    got = render([text for text, _ in cases])
    assert [(text, html) for (text, _), html in zip(cases, got, strict=True)] == cases


ALLOWED = {
    "p": set(), "br": set(), "strong": set(), "em": set(), "del": set(), "hr": set(),
    "h1": set(), "h2": set(), "h3": set(), "h4": set(), "h5": set(), "h6": set(),
    "ul": set(), "ol": {"start"}, "li": set(), "blockquote": set(),
    "pre": {"class", "data-lang", "data-open"}, "code": {"class"},
    "table": {"class"}, "thead": set(), "tbody": set(), "tr": set(),
    "th": {"class"}, "td": {"class"}, "a": {"href", "rel", "target"},
}
VOID = {"br", "hr"}
CLASSES = re.compile(r"^(md-code|md-math|md-table|md-left|md-right|md-center|language-[\w+#.-]+)$")
HREF = re.compile(r"^https?://[^\s<>\"'`]+$", re.IGNORECASE)


class Checker(HTMLParser):
    """Every tag and attribute one the renderer writes, every tag closed in order."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.problems: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag not in ALLOWED:
            self.problems.append(f"tag <{tag}>")
            return
        for name, value in attrs:
            if name not in ALLOWED[tag]:
                self.problems.append(f"attribute {name} on <{tag}>")
            elif name == "class" and not CLASSES.match(value or ""):
                self.problems.append(f"class {value!r}")
            elif name == "href" and not HREF.match(value or ""):
                self.problems.append(f"href {value!r}")
        if tag == "a" and (dict(attrs).get("rel"), dict(attrs).get("target")) != (
                "noopener noreferrer", "_blank"):
            self.problems.append(f"link without rel/target: {attrs}")
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack.pop() != tag:
            self.problems.append(f"</{tag}> out of order")

    def close(self):
        super().close()
        if self.stack:
            self.problems.append(f"unclosed {self.stack}")


PIECES = [
    "**", "*", "__", "_", "~~", "`", "```", "```js\n", "~~~\n", "$", "$$", "\\(", "\\)", "# ",
    "## ", "- ", "1. ", "  - ", "> ", "| a | b |\n|---|---|\n", "|", "---\n", "\n", "\n\n",
    "word ", "snake_case ", "[x](", ")", "](", "https://ok.example/p?a=1&b=2", "http://h/",
    "javascript:alert(1)", "JAVASCRIPT:", "data:text/html,", "<img src=x onerror=alert(1)>",
    "<script>", "</script>", '"', "'", "<", ">", "&amp;", "&", "\u0000", "\u00001\u0000",
    "onmouseover=", "<https://ok.example/>", "<javascript:x>", "    ", "\t", "\r\n",
]


def test_any_answer_renders_to_its_own_tags_only_nested_with_http_links_only():
    rng = random.Random(2026)  # fixed: a failure is reproducible
    texts = ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 40)))
             for _ in range(3000)]
    for text, html in zip(texts, render(texts), strict=True):
        checker = Checker()
        checker.feed(html)
        checker.close()
        assert checker.problems == [], (text, html)
