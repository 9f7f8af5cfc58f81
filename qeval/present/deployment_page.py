"""The deployment question on the board's HTML page (qeval.present.html_page): the inputs a reader sets (memory,
context, generation speed, depth, quality; also from the page's URL: ?mem=8&ctx=32768&tg=20&depth=4096&by=kld_mean,
so an answer can be linked), the board's figures as JSON, and the plain script that answers live.

The script's rule (RULES: which rows pass, in which order, and why each other one is ruled out) is
qeval.compare.deployment_choice's, worded as qeval.present.choose_text words it: tests/test_choose_rule.py runs it,
taken from a written page, under Node.js over shared cases and holds every decision to Python's, and
tests/test_deployment_page.py holds the whole page to `qeval choose` in a browser. The fronts are not recomputed in
the page: every front over a measured context and depth is computed in Python (deployment_board.with_front) and
looked up.
"""

from __future__ import annotations

import html
import json
import math

from qeval.compare import metric_registry
from qeval.compare.deployment_choice import Candidate, Question, better
from qeval.present.deployment_board import QUALITIES, DeploymentBoard


def question_link(q: Question) -> str:
    """The question as the page's URL parameters (mem=8&ctx=32768&tg=20&depth=4096), read back by its script."""
    parts = []
    if q.memory_gib is not None:
        parts += [f"mem={q.memory_gib:g}", f"ctx={q.n_ctx}"]
    if q.min_tg is not None:
        parts += [f"tg={q.min_tg:g}", f"depth={q.depth}"]
    if q.by != "kld_mean":
        parts.append(f"by={q.by}")
    return "&".join(parts)


def qualities_data() -> list[dict]:
    """The qualities a reader may ask for, as the script reads them: key, heading, better direction."""
    return [{"key": key, "heading": metric_registry.METRICS[key].heading, "better": better(key)} for key in QUALITIES]


def candidate_data(c: Candidate, quality: dict[str, float | None]) -> dict:
    """A candidate as the script's rule reads it: its figures on the machine and its quality per quality metric
    (`quality`: key -> value; a missing or non-finite one is no quality figure)."""
    return {"label": c.label, "reference": c.reference,
            "quality": {k: v if v is not None and math.isfinite(v) else None for k, v in quality.items()},
            "memory": {str(k): v for k, v in c.memory.items()}, "tg": {str(k): v for k, v in c.tg.items()},
            "elsewhere": c.elsewhere, "excluded": c.excluded, "recorded": c.recorded}


def page_data(board: DeploymentBoard, rows) -> dict:
    """What the script reads: the machine, the measured contexts and depths, each row's figures on the machine and
    its quality and quality text per quality metric, and every front."""
    metrics = [metric_registry.METRICS[key] for key in QUALITIES]
    out_rows = []
    for row, c in zip(rows, board.candidates(rows)):
        held = {m.key: row.metrics.get(m.key) for m in metrics}
        quality_text = {m.key: f"{m.heading} " + ("(the reference)" if row.reference else
                                                  m.cell(*((mv.value, mv.se) if mv else (None, None))))
                        for m, mv in zip(metrics, held.values())}
        out_rows.append({**candidate_data(c, {k: None if mv is None else mv.value for k, mv in held.items()}),
                         "quality_text": quality_text})
    context, depth = board.front_at
    return {"machine": {"key": board.machine.key, "text": board.machine.text},
            "contexts": list(board.contexts()), "depths": list(board.depths()),
            "qualities": qualities_data(), "rows": out_rows, "defaults": {"ctx": context, "depth": depth},
            "fronts": {f"{by}|{'' if n is None else n}|{'' if d is None else d}": list(labels)
                       for (by, n, d), labels in board.fronts.items()}}


def _options(values, blank: str) -> str:
    return f'<option value="">{html.escape(blank)}</option>' + "".join(
        f'<option value="{v}">{v:,}</option>' for v in values)


def question_html(board: DeploymentBoard, rows) -> str:
    """The question's inputs, the answer's place and the script, for a page whose table rows carry data-label and
    whose cells carry data-col (their written column)."""
    data = json.dumps(page_data(board, rows), allow_nan=False).replace("<", "\\u003c")
    qualities = "".join(f'<option value="{key}"{" selected" if key == "kld_mean" else ""}>'
                        f'{html.escape(metric_registry.METRICS[key].heading)}</option>' for key in QUALITIES)
    return f"""<section id="question">
<h2>Which row fits? <small>(measured on {html.escape(board.machine.text)})</small></h2>
<form id="ask" onsubmit="return false">
<label>memory <input id="mem" type="number" min="0" step="any" placeholder="GiB"> GiB</label>
<label>at context <select id="ctx">{_options(board.contexts(), "(no memory limit)")}</select></label>
<label>generation at least <input id="tg" type="number" min="0" step="any" placeholder="tokens/s"> tokens/s</label>
<label>at depth <select id="depth">{_options(board.depths(), "(no speed limit)")}</select></label>
<label>best <select id="by">{qualities}</select></label>
<a id="link" href="?">link to this question</a>
</form>
<p id="problem" class="problem"></p>
<p id="asked"></p>
<p id="answer"></p>
<ul id="passing"></ul>
<p id="ruled-heading"></p>
<ul id="ruled-out"></ul>
<p id="front"></p>
<p class="notes">Only figures measured at exactly that context and depth count (no interpolation), on this machine
only; the reference is the best quality by definition. The same question on the command line: <code>qeval choose
RUNS --memory M --context C --min-tg S --depth D</code>.</p>
</section>
<script type="application/json" id="board-data">{data}</script>
<script id="choose-rule">{RULES}</script>
<script>{SCRIPT}</script>
"""


# The rule of qeval.compare.deployment_choice (reasons, choose), worded as qeval.present.choose_text words it: pure
# functions of the board's data and a question, so that tests/test_choose_rule.py can run them outside a browser.
RULES = """
var qevalChoose = (function () {
  "use strict";
  var GIB = 1073741824;
  var count = function (n) { return Number(n).toLocaleString("en-US"); };
  var quality = function (data, key) { return data.qualities.filter(function (q) { return q.key === key; })[0]; };
  var fixed = function (value, decimals) {  // Python's f"{value:.Nf}": a tie rounds to even, toFixed rounds it up
    var text = value.toFixed(decimals), exact = value.toFixed(100);
    var cut = exact.indexOf(".") + 1 + decimals, last = Number(text.charAt(text.length - 1));
    return /^50*$/.test(exact.slice(cut)) && last % 2 === 1 ? exact.slice(0, cut) : text;
  };
  var beside = function (value, limit, decimals) {  // choose_text.beside
    var text = fixed(value, decimals);
    for (var d = decimals + 1; d < 7 && Number(text) === limit; d++) { text = fixed(value, d); }
    return text;
  };

  function figureReasons(figures, at, axis, missed, kind, text) {
    var figure = figures[String(at)], where = axis + " " + count(at);
    if (figure === undefined || figure === null) {
      var there = Object.keys(figures).map(Number).sort(function (a, b) { return a - b; }).map(count);
      return [["not measured", "not measured at " + where +
               (there.length ? " (measured " + axis + "s: " + there.join(", ") + ")" : "")]];
    }
    if (typeof figure === "string") {
      return [["could not be measured", "could not be measured at " + where + ": " + figure]];
    }
    return missed(figure) ? [[kind, text(figure) + " at " + where]] : [];
  }

  function reasons(data, row, q) {
    if (row.excluded) { return [["not a candidate", row.excluded]]; }
    var measured = row.recorded || Object.keys(row.memory).length || Object.keys(row.tg).length;
    if (!measured) {
      if (row.elsewhere) { return [["measured on another machine", "measured on another machine: " + row.elsewhere]]; }
      return [["not measured", "not measured: no speed or memory record"]];
    }
    var out = (row.reference || row.quality[q.by] !== null) ? [] :
      [["no quality figure", "no " + quality(data, q.by).heading + " figure"]];
    if (q.ctx !== null) {
      out = out.concat(figureReasons(row.memory, q.ctx, "context", function (bytes) { return bytes > q.mem * GIB; },
        "does not fit", function (bytes) {
          return "does not fit: " + beside(bytes / GIB, q.mem, 2) + " GiB > " + String(q.mem) + " GiB";
        }));
    }
    if (q.depth !== null) {
      out = out.concat(figureReasons(row.tg, q.depth, "depth", function (tps) { return tps < q.tg; },
        "too slow", function (tps) {
          return "too slow: " + beside(tps, q.tg, 1) + " tokens/s < " + String(q.tg) + " tokens/s";
        }));
    }
    return out;
  }

  function order(data, q) {
    var better = quality(data, q.by).better;
    return function (a, b) {
      var key = function (r) {
        var v = r.reference ? -Infinity : better * -r.quality[q.by];
        var mem = q.ctx === null ? 0 : r.memory[String(q.ctx)];
        var tps = q.depth === null ? 0 : r.tg[String(q.depth)];
        return [v, mem, -tps];
      };
      var x = key(a), y = key(b);
      for (var i = 0; i < 3; i++) { if (x[i] !== y[i]) { return x[i] < y[i] ? -1 : 1; } }
      return a.label < b.label ? -1 : a.label > b.label ? 1 : 0;
    };
  }

  // The rows that pass, best first, and every other row with its reasons ([kind, text] each), in the board's order.
  function decide(data, q) {
    var passing = [], ruled = [];
    data.rows.forEach(function (row) {
      var why = reasons(data, row, q);
      if (why.length) { ruled.push([row, why]); } else { passing.push(row); }
    });
    passing.sort(order(data, q));
    return {passing: passing, ruled: ruled};
  }

  return {GIB: GIB, count: count, quality: quality, fixed: fixed, decide: decide};
})();
"""


# The page around the rule: inputs, URL parameters, the answer's words and the board's marks.
SCRIPT = """
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("board-data").textContent);
  var GIB = qevalChoose.GIB, count = qevalChoose.count, fixed = qevalChoose.fixed;
  var el = function (id) { return document.getElementById(id); };
  var quality = function (key) { return qevalChoose.quality(data, key); };
  var listed = function (xs) { return xs.length ? xs.join(", ") : "none"; };

  function named(row) { return row.label + (row.reference ? " (reference)" : ""); }

  function figuresText(row, q) {
    var parts = [row.quality_text[q.by]];
    if (q.ctx !== null) {
      parts.push(fixed(row.memory[String(q.ctx)] / GIB, 2) + " GiB at context " + count(q.ctx));
    }
    if (q.depth !== null) {
      parts.push(fixed(row.tg[String(q.depth)], 1) + " tokens/s at depth " + count(q.depth));
    }
    return parts.join(", ");
  }

  function read() {
    var q = {by: el("by").value, mem: null, ctx: null, tg: null, depth: null}, problems = [];
    var mem = el("mem").value.trim(), ctx = el("ctx").value, tg = el("tg").value.trim(), depth = el("depth").value;
    if (mem !== "") {
      q.mem = Number(mem);
      if (!(q.mem > 0) || !isFinite(q.mem)) { problems.push("memory " + mem + " is not a positive size in GiB"); }
    }
    if (tg !== "") {
      q.tg = Number(tg);
      if (!(q.tg >= 0) || !isFinite(q.tg)) { problems.push("speed " + tg + " is not 0 tokens/s or more"); }
    }
    if (ctx !== "") { q.ctx = Number(ctx); }
    if (depth !== "") { q.depth = Number(depth); }
    if ((mem === "") !== (ctx === "")) { problems.push("a memory limit is asked at a context: set both"); }
    if ((tg === "") !== (depth === "")) { problems.push("a generation speed is asked at a depth: set both"); }
    return {q: q, problems: problems, asked: mem !== "" || tg !== ""};
  }

  function frontOf(q) {
    var key = q.by + "|" + (q.ctx === null ? "" : q.ctx) + "|" + (q.depth === null ? "" : q.depth);
    return data.fronts[key] || [];
  }

  function setList(id, lines) {
    var ul = el(id);
    ul.textContent = "";
    lines.forEach(function (line) {
      var li = document.createElement("li");
      li.textContent = line;
      ul.appendChild(li);
    });
  }

  function mark(q, verdicts, front) {
    document.querySelectorAll("#leaderboard tbody tr").forEach(function (tr) {
      var label = tr.getAttribute("data-label"), v = verdicts[label];
      tr.classList.remove("best", "passes", "ruled");
      var cell = tr.querySelector('td[data-col="answer"]');
      if (v) { tr.classList.add(v.kind); }
      if (cell) { cell.textContent = v ? v.text : ""; }
      var onFront = tr.querySelector('td[data-col="deployment_front"]');
      if (onFront) { onFront.textContent = front.indexOf(label) >= 0 ? "\\u2713" : ""; }
    });
    document.querySelectorAll("#leaderboard [data-col]").forEach(function (cell) {
      var col = cell.getAttribute("data-col");
      var asked = (q.ctx !== null && col === "memory_gib@" + q.ctx) ||
                  (q.depth !== null && /^tg[0-9]+@d[0-9]+$/.test(col) && col.split("@d")[1] === String(q.depth));
      cell.classList.toggle("asked", asked);
    });
  }

  function update(fromUrl) {
    var r = read(), q = r.q, params = new URLSearchParams();
    if (q.mem !== null || el("mem").value.trim() !== "") { params.set("mem", el("mem").value.trim()); }
    if (q.ctx !== null) { params.set("ctx", q.ctx); }
    if (el("tg").value.trim() !== "") { params.set("tg", el("tg").value.trim()); }
    if (q.depth !== null) { params.set("depth", q.depth); }
    if (q.by !== "kld_mean") { params.set("by", q.by); }
    el("link").setAttribute("href", "?" + params.toString());
    if (!fromUrl) { try { history.replaceState(null, "", "?" + params.toString()); } catch (e) { /* file: pages */ } }
    el("problem").textContent = r.problems.join("; ");
    var unasked = q.ctx === null && q.depth === null;  // the board's front: its largest context, deepest depth
    var front = frontOf(unasked ? {by: q.by, ctx: data.defaults.ctx, depth: data.defaults.depth} : q);
    ["asked", "answer", "ruled-heading", "front"].forEach(function (id) { el(id).textContent = ""; });
    setList("passing", []); setList("ruled-out", []);
    if (r.problems.length || !r.asked) {
      if (!r.asked && !r.problems.length) {
        el("asked").textContent = "Set a memory limit and a context, a generation speed and a depth, or both.";
      }
      mark(q, {}, front);
      return;
    }
    var asks = [];
    if (q.ctx !== null) { asks.push("fits " + String(q.mem) + " GiB at context " + count(q.ctx)); }
    if (q.depth !== null) { asks.push("generates at least " + String(q.tg) + " tokens/s at depth " + count(q.depth)); }
    el("asked").textContent = "Question: the best " + quality(q.by).heading + " that " + asks.join(" and ") +
      ", on " + data.machine.key + " (" + data.machine.text + ")";
    var decided = qevalChoose.decide(data, q), passing = decided.passing, ruled = decided.ruled, verdicts = {};
    ruled.forEach(function (rw) {
      verdicts[rw[0].label] = {kind: "ruled", text: rw[1].map(function (w) { return w[1]; }).join("; ")};
    });
    passing.forEach(function (row, i) {
      verdicts[row.label] = i ? {kind: "passes", text: "passes"} : {kind: "best", text: "best"};
    });
    el("answer").textContent = "Answer: " + (passing.length ? named(passing[0]) + ": " + figuresText(passing[0], q) :
                                             "none: no row passes");
    setList("passing", passing.slice(1).map(function (row) {
      return "Also passing: " + named(row) + ": " + figuresText(row, q);
    }));
    el("ruled-heading").textContent = ruled.length ? "Ruled out:" : "Ruled out: none";
    setList("ruled-out", ruled.map(function (rw) {
      return named(rw[0]) + ": " + rw[1].map(function (w) { return w[1]; }).join("; ");
    }));
    var axes = [quality(q.by).heading];
    if (q.ctx !== null) { axes.push("memory at context " + count(q.ctx)); }
    if (q.depth !== null) { axes.push("generation speed at depth " + count(q.depth)); }
    el("front").textContent = "Front (" + axes.join(" \\u00d7 ") + "): " + listed(front);
    mark(q, verdicts, front);
  }

  function fromUrl() {
    var p = new URLSearchParams(window.location.search), problems = [];
    var number = function (name, what, positive) {
      var v = p.get(name);
      if (v === null) { return; }
      var x = Number(v);
      if (v.trim() === "" || !isFinite(x) || (positive ? !(x > 0) : !(x >= 0))) {
        problems.push(name + "=" + v + " is not " + what);
        return;
      }
      el(name).value = v;
    };
    var measured = function (name, options, what) {
      var v = p.get(name);
      if (v === null) { return; }
      if (options.indexOf(v) < 0) {
        problems.push(name + "=" + v + " was not measured on " + data.machine.key + ": measured " + what + " are " +
                      listed(options));
        return;
      }
      el(name).value = v;
    };
    number("mem", "a positive size in GiB", true); number("tg", "a speed of 0 tokens/s or more", false);
    measured("ctx", data.contexts.map(String), "contexts"); measured("depth", data.depths.map(String), "depths");
    var by = p.get("by");
    if (by !== null) {
      if (quality(by)) { el("by").value = by; } else { problems.push("by=" + by + " is not a quality on this board"); }
    }
    update(true);
    if (problems.length) {
      var others = el("problem").textContent;
      el("problem").textContent = problems.concat(others ? [others] : []).join("; ");
    }
  }

  function start() {
    ["mem", "ctx", "tg", "depth", "by"].forEach(function (id) {
      el(id).addEventListener("input", function () { update(false); });
      el(id).addEventListener("change", function () { update(false); });
    });
    fromUrl();
  }
  if (document.readyState === "loading") { document.addEventListener("DOMContentLoaded", start); } else { start(); }
})();
"""
