"""Text of `qeval template`: per candidate, whether its chat template writes the samples as the reference's."""

from __future__ import annotations


def template_check_text(result: dict) -> str:
    ref = result["reference"]
    lines = [f"reference template: {ref['source']} (sha256 {ref['template_sha256'][:12]}); {result['samples']} "
             f"renderings of {result['corpus']}, compared as {result['compared_as']}"]
    for c in result["candidates"]:
        lines.append(_verdict(c, result["samples"]))
        d = c["first_difference"]
        if d is not None:
            where = f"token {d['token']}, character {d['char']}" if "token" in d else f"character {d['char']}"
            lines += [f"    first difference: {d['sample']}, {where}",
                      f"      reference: {d['reference']!r}",
                      f"      candidate: {d['candidate']!r}"]
    failed = sum(not c["passed"] for c in result["candidates"])
    lines.append("PASSED: every template renders as the reference's" if result["passed"] else
                 f"FAILED: {failed} of {len(result['candidates'])} templates render otherwise")
    return "\n".join(lines)


def _verdict(c: dict, samples: int) -> str:
    name = f"{c['source']} (sha256 {c['template_sha256'][:12]})"
    if c["same_text"]:
        return f"SAME  {name}: the same template text"
    if c["passed"]:
        return f"SAME  {name}: another text, the same {samples} renderings"
    return f"DIFF  {name}: {c['differing']} of {samples} renderings differ"
