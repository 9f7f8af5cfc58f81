"""The one markdown table writer (qeval.present.markdown) and every table built with it: a `|` or a line break in a
cell is escaped, so it never adds a column or ends the table. Expected lines are written out here by hand."""

from __future__ import annotations

import re
from types import SimpleNamespace

from deployment_records import machine, memory_entry, record_json, speed_entry

from qeval.compare.metric_registry import MetricValue
from qeval.present import baselines_text, deploy_text, recipes_text, report
from qeval.present.markdown import markdown_table
from qeval.storage.deployment import COMPONENTS, DeploymentRecord

LABEL = "Q4|K"  # a label with a pipe in it
ESCAPED = "Q4\\|K"


def cells(line: str) -> list[str]:
    """A table line's cells, split at the borders only (an escaped \\| is no border)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def rows_with(table: str, text: str) -> list[list[str]]:
    return [cells(line) for line in table.splitlines() if text in line]


def assert_one_table(table: str) -> int:
    """Every line of `table` a table line with as many cells as its heading; the count of columns."""
    lines = table.splitlines()
    widths = {len(cells(line)) for line in lines}
    assert all(line.startswith("| ") or line.startswith("|-") for line in lines), table
    assert len(widths) == 1, table
    return widths.pop()


def test_the_writer_escapes_pipes_and_line_breaks_and_aligns_columns():
    table = markdown_table(["a|b", "n"], [["x|y", 1], ["two\nlines", 2.5], ["crlf\r\nend", ""]], right=[1])
    assert table == ("| a\\|b | n |\n"
                     "|---|---:|\n"
                     "| x\\|y | 1 |\n"
                     "| two<br>lines | 2.5 |\n"
                     "| crlf<br>end |  |")
    assert markdown_table(["a"], []) == "| a |\n|---|"


def test_deploy_speed_and_memory_tables_escape_a_label():
    on = machine()
    rec = DeploymentRecord.from_json(record_json(
        LABEL, "f" * 64, "q8_0", on, [memory_entry(4096, {"model": 270, "kv": 12, "compute": 500}),
                                      memory_entry(32768, "failed to create a context | out of memory")],
        [speed_entry("pp", 512, 0, 1000.0), speed_entry("tg", 128, 0, 50.0)]))
    speed = deploy_text.speed_table([rec])
    assert assert_one_table(speed) == 4
    assert rows_with(speed, ESCAPED) == [[ESCAPED, "q8_0/q8_0", "1,000.00 ± 4%", "50.00 ± 4%"]]
    assert speed.splitlines()[1] == "|---|---|---:|---:|"
    memory = deploy_text.memory_table([rec])
    assert assert_one_table(memory) == 3 + len(COMPONENTS) + 3
    measured, failed = rows_with(memory, ESCAPED)
    assert measured[:4] == [ESCAPED, "q8_0/q8_0", "4096", "270.00"]
    assert failed[:4] == [ESCAPED, "q8_0/q8_0", "32768", "failed to create a context \\| out of memory"]
    assert failed[4:] == [""] * (len(COMPONENTS) + 2)


def test_the_ppl_matrix_escapes_a_model_file_name():
    summary = SimpleNamespace(perplexity={"ppl_cand": 12.5, "ppl_cand_se": 0.25, "ppl_ref": 12.0, "ppl_ref_se": 0.2},
                              reference=SimpleNamespace(facts={"file_name": "ref.gguf"}))
    table = report.ppl_matrix_markdown([("a", f"/m/{LABEL}.gguf", "q8_0")], [summary])
    assert assert_one_table(table) == 2
    assert table.splitlines()[0] == "| model | KV q8_0 |"
    assert rows_with(table, ESCAPED) == [[f"{ESCAPED}.gguf", "12.5000 ± 0.2500"]]


def sweep_row(**more) -> dict:
    return {"group": LABEL, "tensors": 2, "types": "q4_k→q3_k", "bytes_saved": 2e6, "kld_cost": 0.001,
            "kld_cost_se": 0.0002, "kld_per_mb": 5e-4, **more}


def test_the_recipe_tables_escape_their_cells():
    sensitivity = recipes_text.sensitivity_markdown([sweep_row(held_out={"diff": 0.002, "se": 0.001},
                                                               chunks=8, stopped="settled")])
    assert assert_one_table(sensitivity) == 9
    assert rows_with(sensitivity, ESCAPED) == [[ESCAPED, "2", "q4_k→q3_k", "2.0", "+0.00100 ± 0.00020", "5.00e-04",
                                                "+0.00200 ± 0.00100", "8", "settled"]]
    measured = {"label": LABEL, "recipe": "Q4_K_M a|b=q8_0", "bytes": 3e6, "kld_mean": 0.01, "kld_mean_se": 0.001,
                "same_top1_pct": 95.0}
    board = recipes_text.recipes_markdown([measured])
    assert assert_one_table(board) == 6
    assert rows_with(board, ESCAPED)[0][:2] == [ESCAPED, "`Q4_K_M a\\|b=q8_0`"]
    stock = {"label": "Q3_K_M", "bytes": 3.1e6, "kld_mean": 0.02, "kld_mean_se": 0.002, "same_top1_pct": 93.0,
             "diff": -0.01, "se": 0.001}
    budget = {"budget": "≤ 3 MB | KLD", "measured": measured, "predicted_bytes": 2.9e6, "predicted_kld": 0.011,
              "stock": stock}
    budgets = recipes_text.budgets_markdown([budget])
    assert assert_one_table(budgets) == 11
    assert rows_with(budgets, ESCAPED)[0][:2] == ["≤ 3 MB \\| KLD", ESCAPED]
    choices = recipes_text.choices_markdown([{**budget, "stock": {"label": LABEL, "diff": -0.01, "se": 0.001}}])
    assert assert_one_table(choices) == 9
    assert rows_with(choices, "chosen Q4")[0][:3] == ["≤ 3 MB \\| KLD", f"chosen {ESCAPED}", ESCAPED]


def test_a_baseline_table_escapes_its_cells():
    entry = SimpleNamespace(id="e1", model=LABEL, candidate={"quant": "Q4_K_M"}, reference=None,
                            settings={"corpus": "wiki | test"}, metrics={"kld_mean": MetricValue(0.0123, 0.0004)},
                            note=None)
    b = SimpleNamespace(name="b", title="t", source={"title": "s"}, entries=[entry])
    text = baselines_text.baseline_text(b)
    table = "\n".join(line for line in text.splitlines() if line.startswith("|"))
    assert assert_one_table(table) == 8
    row = rows_with(table, "e1")[0]
    assert row[1] == ESCAPED and row[-1] == "wiki \\| test"
