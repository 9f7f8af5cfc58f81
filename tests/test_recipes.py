"""Recipes (issue 27): parsing and refusals, llama-imatrix's files, overrides reaching llama.cpp's quantizer (read back
from the built GGUF with gguf-py), tensor groups of Gemma-3 and of a tiny qwen35moe, a sweep's figures against
float64 arithmetic on its saved per-token values, reuse by variant identity, and the greedy chooser against a plain
step-by-step greedy."""

from __future__ import annotations

import dataclasses
import json
import re
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import tinymodels
from conftest import assert_cli_error, run_cli

from qeval import api
from qeval.engine import recipe as recipes
from qeval.compare import chunk_split, recipe_choice
from qeval.compare.recipe_choice import Option
from qeval.errors import QevalError
from qeval.orchestrate import demo
from qeval.orchestrate import recipes as measured
from qeval.orchestrate import sensitivity
from qeval.storage.gguf_file import read_gguf
from qeval.storage.imatrix import read_imatrix
from qeval.storage.variants import LEDGER, Ledger


# --------------------------------------------------------------------------------------------------
# recipes as text
# --------------------------------------------------------------------------------------------------
def test_recipe_text_round_trips_and_names_what_it_is():
    r = recipes.parse("q3_k_m token_embd=Q5_0 'ffn_.*=q5_0'")
    assert r.base == "Q3_K_M" and r.overrides == (("token_embd", "q5_0"), ("ffn_.*", "q5_0"))
    assert recipes.parse(r.text()) == r
    assert r.canonical() == {"base": "Q3_K_M", "overrides": [["token_embd", "q5_0"], ["ffn_.*", "q5_0"]],
                             "imatrix": None}
    # the order of overrides is part of the recipe: llama.cpp takes the first pattern that matches
    swapped = recipes.parse("Q3_K_M ffn_.*=q5_0 token_embd=q5_0")
    assert swapped.label() != r.label() and swapped.canonical() != r.canonical()
    assert recipes.parse("Q4_K_M").label() == "Q4_K_M"
    assert re.fullmatch(r"Q3_K_M\+q5_0\.[0-9a-f]{8}", r.label())


@pytest.mark.parametrize("recipe, fragment", [
    ("Q9_K_X", "unknown base type"),
    ("Q4_K_M ffn_down=q9_9", "unknown tensor type"),
    ("Q4_K_M ffn_(=q4_0", "no valid regex"),
    ("Q4_K_M ffn_down", "no PATTERN=TYPE"),
    ("ffn_down=q4_0", "must start with a base type"),
    ("Q4_K_M imatrix=/nonexistent/imatrix.gguf", "does not exist"),
])
def test_bad_recipes_get_one_clear_message(tmp_path, recipe, fragment):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")
    assert_cli_error(run_cli("recipe", "measure", recipe, "--ref", "REF", "--source", source,
                             "--runs-dir", tmp_path), fragment)


def test_a_missing_source_gets_one_clear_message(tmp_path):
    assert_cli_error(run_cli("recipe", "measure", "Q4_K_M", "--ref", "REF", "--source", tmp_path / "none.gguf",
                             "--runs-dir", tmp_path), "does not exist")


def test_a_sweep_refuses_an_unknown_target_type(tmp_path):
    assert_cli_error(run_cli("recipe", "sweep", "Q4_K_M", "--to", "q7_x", "--ref", "REF", "--source",
                             tmp_path / "none.gguf", "--runs-dir", tmp_path), "unknown tensor type")


# --------------------------------------------------------------------------------------------------
# llama-imatrix's files
# --------------------------------------------------------------------------------------------------
def test_legacy_imatrix_is_sums_over_calls(tmp_path):
    rng = np.random.default_rng(0)
    entries = {"blk.0.ffn_down.weight": (7, rng.random(64)), "output.weight": (0, rng.random(32))}
    parts = [struct.pack("<i", len(entries))]
    for name, (ncall, sums) in entries.items():
        parts += [struct.pack("<i", len(name)), name.encode(), struct.pack("<ii", ncall, len(sums)),
                  sums.astype("<f4").tobytes()]
    parts += [struct.pack("<i", 12), struct.pack("<i", 4), b"wiki"]  # chunk count and dataset (optional trailer)
    path = tmp_path / "imatrix.dat"
    path.write_bytes(b"".join(parts))
    got = read_imatrix(path)
    assert set(got) == set(entries)
    for name, (ncall, sums) in entries.items():
        want = sums.astype(np.float32).astype(np.float64) / (ncall if ncall > 0 else 1)
        np.testing.assert_allclose(got[name], want, rtol=1e-6)


def write_gguf_imatrix(path: Path, entries: dict[str, tuple[np.ndarray, np.ndarray]]) -> Path:
    """llama-imatrix's GGUF layout: NAME.in_sum2 (experts x columns) and NAME.counts (experts x 1), float32."""
    w = gguf.GGUFWriter(path, "imatrix")
    for name, (sums, counts) in entries.items():
        w.add_tensor(f"{name}.in_sum2", sums.astype(np.float32))
        w.add_tensor(f"{name}.counts", counts.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_imatrix_is_sums_over_counts_per_expert(tmp_path):
    rng = np.random.default_rng(1)
    sums = rng.random((3, 16)).astype(np.float32)  # 3 experts x 16 columns
    counts = np.array([[4.0], [0.0], [10.0]], dtype=np.float32)
    path = write_gguf_imatrix(tmp_path / "imatrix.gguf", {"blk.0.ffn_down_exps.weight": (sums, counts)})
    got = read_imatrix(path)["blk.0.ffn_down_exps.weight"]
    want = np.concatenate([sums[0] / 4.0, np.ones(16), sums[2] / 10.0])  # a count of 0: ones, as llama-quantize
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_an_imatrix_is_known_by_its_content(tmp_path):
    a = write_gguf_imatrix(tmp_path / "a.gguf", {"x.weight": (np.ones((1, 8)), np.ones((1, 1)))})
    b = write_gguf_imatrix(tmp_path / "b.gguf", {"x.weight": (np.ones((1, 8)), np.ones((1, 1)))})
    c = write_gguf_imatrix(tmp_path / "c.gguf", {"x.weight": (np.full((1, 8), 2.0), np.ones((1, 1)))})
    ra, rb, rc = (recipes.parse(f"Q4_0 imatrix={p}") for p in (a, b, c))
    assert ra.canonical() == rb.canonical() != rc.canonical()  # the path is no part of it, the content is
    assert recipes.parse(ra.text()) == ra and ra.label() == rb.label() != rc.label()


def test_a_file_that_is_no_imatrix_is_refused(tmp_path):
    path = tmp_path / "junk.dat"
    path.write_bytes(b"\x05\x00\x00\x00abc")
    with pytest.raises(QevalError, match="neither a GGUF imatrix"):
        read_imatrix(path)


def test_the_ledger_reads_what_it_wrote_and_refuses_a_broken_file(tmp_path):
    """variants.json: key -> {"recipe", "label", "facts"}, as qeval.storage.variants documents it."""
    Ledger(tmp_path).put("k1", "Q4_0 ffn_.*=q8_0", "Q4_0+ffn_.q8_0.1234abcd", {"fingerprint": "f"})
    assert json.loads((tmp_path / LEDGER).read_text()) == {
        "k1": {"recipe": "Q4_0 ffn_.*=q8_0", "label": "Q4_0+ffn_.q8_0.1234abcd", "facts": {"fingerprint": "f"}}}
    again = Ledger(tmp_path)
    assert (again.get("k1"), again.label("k1"), again.get("k2"), again.label("k2")) == \
        ({"fingerprint": "f"}, "Q4_0+ffn_.q8_0.1234abcd", None, None)
    (tmp_path / LEDGER).write_text("{not json")
    with pytest.raises(QevalError, match="cannot read the recipes' ledger"):
        Ledger(tmp_path)


# --------------------------------------------------------------------------------------------------
# the greedy chooser
# --------------------------------------------------------------------------------------------------
def random_options(rng, n_groups: int) -> list[Option]:
    """Each group: its base (0, 0) and 1-4 moves; convex in (bytes, KLD) so that every option is on its hull."""
    out = []
    for g in range(n_groups):
        out.append(Option(f"g{g}", "", 0, 0.0))
        steps = np.sort(rng.uniform(1e-4, 1e-2, size=rng.integers(1, 5)))  # KLD per byte saved, rising
        bytes_, kld = 0, 0.0
        for i, rate in enumerate(steps):
            saved = int(rng.integers(1_000, 50_000))
            bytes_, kld = bytes_ - saved, kld + rate * saved
            out.append(Option(f"g{g}", f"t{i}", bytes_, kld))
    return out


def plain_greedy(options: list[Option], base_bytes: int, base_kld: float, max_bytes: int) -> dict[str, Option]:
    """Every group at its smallest option; then, over and over, the one next step (one group one option up) that
    removes the most KLD per byte and fits, until none fits."""
    by_group: dict[str, list[Option]] = {}
    for o in options:
        by_group.setdefault(o.group, []).append(o)
    ladders = {g: sorted(opts, key=lambda o: o.bytes) for g, opts in by_group.items()}
    at = {g: 0 for g in ladders}
    size = base_bytes + sum(lad[0].bytes for lad in ladders.values())
    while True:
        best = None
        for g, lad in ladders.items():
            if at[g] + 1 < len(lad):
                cur, nxt = lad[at[g]], lad[at[g] + 1]
                rate = (nxt.kld - cur.kld) / (nxt.bytes - cur.bytes)
                if size + nxt.bytes - cur.bytes <= max_bytes and (best is None or rate < best[0]):
                    best = (rate, g)
        if best is None:
            return {g: lad[at[g]] for g, lad in ladders.items()}
        g = best[1]
        size += ladders[g][at[g] + 1].bytes - ladders[g][at[g]].bytes
        at[g] += 1


@pytest.mark.parametrize("seed", range(20))
def test_greedy_equals_plain_greedy_and_keeps_the_budget(seed):
    rng = np.random.default_rng(seed)
    options = random_options(rng, int(rng.integers(2, 7)))
    base_bytes, base_kld = 1_000_000, 0.01
    smallest = base_bytes + sum(min(o.bytes for o in options if o.group == g) for g in {o.group for o in options})
    budget = int(rng.uniform(smallest, base_bytes))
    choice = recipe_choice.choose(options, base_bytes, base_kld, max_bytes=budget)
    want = plain_greedy(options, base_bytes, base_kld, budget)
    assert {o.group: o for o in choice.options} == want
    assert choice.bytes == base_bytes + sum(o.bytes for o in want.values()) <= budget
    assert choice.kld == pytest.approx(base_kld + sum(o.kld for o in want.values()), rel=1e-12)


def test_the_base_recipe_beats_a_greedy_that_walks_past_a_large_step():
    # from the smallest recipe (the embedding down: 50 bytes), two steps up of 10 bytes that remove KLD at a better
    # rate are taken first; then the embedding's step of 50 no longer fits a budget of 105, which the base keeps
    options = [Option("embd", "", 0, 0.0), Option("embd", "q4", -50, 0.01),
               Option("a", "", 0, 0.0), Option("a", "q8", 10, -0.004), Option("b", "", 0, 0.0),
               Option("b", "q8", 10, -0.004)]
    choice = recipe_choice.choose(options, 100, 0.01, max_bytes=105)
    assert choice.moves() == () and (choice.bytes, choice.kld) == (100, 0.01)
    assert plain_greedy(options, 100, 0.01, 105)["embd"].type == "q4"  # what the greedy alone reaches


def test_greedy_under_a_kld_budget_stops_once_within_it():
    options = [Option("a", "", 0, 0.0), Option("a", "lo", -100, 0.010), Option("b", "", 0, 0.0),
               Option("b", "lo", -100, 0.001)]
    # from the smallest recipe (both moved: 0.011), a's 100 bytes remove the most KLD: taken first, and then the
    # budget is met: b stays moved
    choice = recipe_choice.choose(options, 1000, 0.0, max_kld=0.0105)
    assert {o.group: o.type for o in choice.options} == {"a": "", "b": "lo"}
    assert choice.bytes == 900 and choice.kld == pytest.approx(0.001)
    assert recipe_choice.choose(options, 1000, 0.0, max_kld=0.02).bytes == 800  # both moved already within it


def test_hull_drops_options_not_worth_their_bytes():
    a, mid_bad, b = Option("g", "x", -200, 0.02), Option("g", "y", -100, 0.015), Option("g", "", 0, 0.0)
    assert recipe_choice.hull([b, mid_bad, a]) == [a, b]  # y sits above the line from x to the base
    worse = Option("g", "z", -50, 0.03)  # more bytes than x and more KLD: never chosen
    assert recipe_choice.hull([a, b, worse]) == [a, b]


# --------------------------------------------------------------------------------------------------
# a tiny qwen35moe through the quantizer, the groups, a sweep and reuse
# --------------------------------------------------------------------------------------------------
N_CTX, N_CHUNKS = 64, 4


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, gemma_tokenizer) -> dict:
    """A tiny random-weight qwen35moe in F16 (the source), its Q8_0 and a reference store of it."""
    directory = tmp_path_factory.mktemp("recipes-qwen35moe")
    f16 = tinymodels.build_qwen35moe(directory / "qwen35moe-F16.gguf", gemma_tokenizer)
    q8 = demo.quantize(f16, directory / "qwen35moe-Q8_0.gguf", demo.DERIVED_FTYPES["Q8_0"])
    runs = directory / "runs"
    api.capture_store(str(q8), "REF", runs_dir=runs, n_ctx=N_CTX, chunks=N_CHUNKS,
                      settings=api.EngineSettings(flash_attn="off"))
    return {"source": f16, "runs": runs}


def tensor_types_of(path: Path) -> dict[str, str]:
    return {t.name: t.type_name.lower() for t in read_gguf(path).tensors}


def test_overrides_reach_the_quantizer_and_the_dry_run_predicts_the_file(qwen, tmp_path):
    source = qwen["source"]
    r = recipes.parse(r"Q4_0 ffn_down_exps=q8_0 ^blk\.[0-9]+\.ssm_out\.weight$=q5_1 ^output\.weight$=q5_0")
    built = recipes.build(source, r, tmp_path / "variant.gguf", nthread=2)
    stock = recipes.build(source, recipes.parse("Q4_0"), tmp_path / "stock.gguf", nthread=2)
    got, base = tensor_types_of(built), tensor_types_of(stock)
    for name, t in got.items():
        if ".ffn_down_exps." in name:
            assert t == "q8_0", name
        elif re.fullmatch(r"blk\.\d+\.ssm_out\.weight", name):
            assert t == "q5_1", name
        elif name == "output.weight":
            assert t == "q5_0"
        else:
            assert t == base[name], name  # everything else as the stock type makes it
    assert sum(".ffn_down_exps." in n for n in got) == 4 and sum(".ssm_out." in n for n in got) == 3
    planned = recipes.plan(source, r)
    assert {n: p.type for n, p in planned.items()} == got
    data = sum(-(-t.n_bytes // 32) * 32 for t in read_gguf(built).tensors)
    assert recipes.planned_data_bytes(planned) == data
    # the metadata is the source's but for what llama.cpp adds (gguf-py wrote this source): within a few bytes
    assert 0 <= built.stat().st_size - recipes.planned_bytes(planned, source.stat().st_size) <= 256


def test_groups_of_a_qwen35moe_follow_its_tensor_names(qwen):
    planned = recipes.plan(qwen["source"], recipes.parse("Q8_0"))
    groups = {g.name: g for g in recipes.tensor_groups(planned)}
    for name in ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "attn_qkv", "attn_gate",
                 "ssm_out", "ssm_alpha", "ssm_beta", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
                 "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"):
        assert name in groups, (name, sorted(groups))
    assert "attn_norm" not in groups and "ssm_norm" not in groups  # one-dimensional: kept in float
    assert len(groups["ssm_out"].tensors) == 3 and len(groups["attn_q"].tensors) == 1  # 3 recurrent, 1 attention
    names = list(planned)
    for g in groups.values():  # each pattern names exactly its group's tensors
        assert sorted(n for n in names if re.search(g.pattern, n)) == sorted(g.tensors), g.name


def test_groups_of_gemma3_and_its_planned_sizes(models):
    source = models["Q4_K_M"]
    planned = recipes.plan(source, recipes.parse("Q4_K_M"))
    groups = {g.name: len(g.tensors) for g in recipes.tensor_groups(planned)}
    assert groups == {"token_embd": 1, **{name: 18 for name in ("attn_q", "attn_k", "attn_v", "attn_output",
                                                                   "ffn_gate", "ffn_up", "ffn_down")}}
    # a source llama.cpp wrote: the planned size is the file's to the byte (the demo's stock files, same quantizer)
    for quant in ("Q3_K_M", "Q2_K"):
        stock = recipes.plan(source, recipes.parse(quant))
        assert recipes.planned_bytes(stock, source.stat().st_size) == models[quant].stat().st_size
        assert {n: p.type for n, p in stock.items()} == tensor_types_of(models[quant])


def test_sweep_figures_and_reuse(qwen, monkeypatch):
    def request(chunks=N_CHUNKS):
        return api.recipe_request(ref="REF", source=str(qwen["source"]), recipes=["Q4_0"], chunks=chunks,
                                  runs_dir=qwen["runs"], threads=2)

    groups = ("ssm_out", "ffn_down_exps", "ffn_up_shexp", "token_embd")
    swept = sensitivity.sweep(request(), ("q8_0", "q4_0"), groups)
    assert {r.move.group.name for r in swept.rows} == set(groups)
    assert all(r.move.target == "q8_0" for r in swept.rows)  # -> q4_0 changes nothing in a Q4_0 base
    assert len(swept.skipped) == len(groups)
    assert not list((qwen["runs"] / "recipes").glob("*.gguf"))  # each variant deleted once measured
    base = swept.base
    for r in swept.rows:
        assert r.bytes_saved == base.bytes - r.variant.bytes
        assert abs(r.variant.bytes - r.move.bytes) <= 256  # planned from a source gguf-py wrote: within its metadata
        assert r.bytes_saved < 0  # q8_0 costs bytes
        a, b = r.variant.per_token, base.per_token
        assert np.array_equal(a["chunk"], b["chunk"]) and np.array_equal(a["position"], b["position"])
        d = np.array([np.mean(a["kld"][a["chunk"] == c].astype(np.float64) - b["kld"][b["chunk"] == c])
                      for c in np.unique(b["chunk"])])
        assert r.cost.diff == pytest.approx(d.mean(), rel=1e-9, abs=1e-15)
        assert r.cost.se == pytest.approx(d.std(ddof=1) / np.sqrt(len(d)), rel=1e-9, abs=1e-15)
        assert r.cost.n_chunks == N_CHUNKS

    def no_build(*args, **kwargs):
        raise AssertionError("a variant measured under the same identity was built again")

    monkeypatch.setattr(recipes, "build", no_build)
    again = sensitivity.sweep(request(), ("q8_0", "q4_0"), groups)
    assert {v.variant.status for v in again.rows} == {measured.REUSED} and again.base.status == measured.REUSED
    assert [r.cost.diff for r in again.rows] == [r.cost.diff for r in swept.rows]
    # fewer chunks is another request: measured again (built again, which the stub refuses)
    with pytest.raises(AssertionError, match="built again"):
        sensitivity.sweep(request(N_CHUNKS - 1), ("q8_0",), groups[:1])


def test_fit_builds_what_the_sweep_predicts(qwen):
    request = api.recipe_request(ref="REF", source=str(qwen["source"]), recipes=["Q4_0"], chunks=N_CHUNKS,
                                 runs_dir=qwen["runs"], threads=2)
    groups = ("ssm_out", "ffn_down_exps")
    swept = sensitivity.sweep(request, ("q8_0",), groups)
    budget = swept.base.bytes + min(-r.bytes_saved for r in swept.rows)  # room for the cheaper move only
    recipe, choice = sensitivity.fitted_recipe(swept, max_bytes=budget)
    assert choice.bytes <= budget and len(choice.moves()) == 1
    result, text = api.recipe_fit_report(request, ["q8_0"], max_mb=[budget / 1e6], stock=["Q4_0", "Q8_0"],
                                         only=groups)
    (fitted,) = result["budgets"]
    assert fitted["recipe"] == recipe.text() and fitted["predicted_bytes"] == choice.bytes
    assert fitted["measured"]["bytes"] == choice.bytes  # sizes add exactly
    assert fitted["stock"]["label"] == "Q4_0"  # the stock type nearest the budget in size
    rows = {r["label"]: r for r in result["rows"]}
    assert rows["Q4_0"]["kind"] == "stock" and rows[fitted["measured"]["label"]]["kind"] == "recipe"
    # the paired difference against the stock type: float64 over chunk means of the two saved per-token columns
    per = {label: np.load(Path(rows[label]["result"]).with_suffix(".npz")) for label in (fitted["measured"]["label"],
                                                                                          "Q4_0")}
    cand, stock = per[fitted["measured"]["label"]], per["Q4_0"]
    d = np.array([np.mean(cand["kld"][cand["chunk"] == c].astype(np.float64) - stock["kld"][stock["chunk"] == c])
                  for c in range(N_CHUNKS)])
    assert fitted["stock"]["diff"] == pytest.approx(d.mean(), rel=1e-9, abs=1e-15)
    assert fitted["stock"]["se"] == pytest.approx(d.std(ddof=1) / np.sqrt(N_CHUNKS), rel=1e-9, abs=1e-15)
    assert fitted["measured"]["label"] in text


def test_an_imatrix_reaches_the_quantizer(qwen, tmp_path):
    """A skewed importance on one tensor's columns changes that tensor's q4_0 blocks, and only that tensor's."""
    name, n_columns = "blk.0.ffn_up_shexp.weight", tinymodels.N_EMBD
    importance = np.where(np.arange(n_columns) % 2 == 0, 100.0, 0.01)[None, :]
    path = write_gguf_imatrix(tmp_path / "imatrix.gguf", {name: (importance, np.ones((1, 1)))})
    plain = recipes.build(qwen["source"], recipes.parse("Q4_0"), tmp_path / "plain.gguf", nthread=2)
    weighted = recipes.build(qwen["source"], recipes.parse(f"Q4_0 imatrix={path}"), tmp_path / "weighted.gguf",
                             nthread=2)
    a, b = ({t.name: f.tensor_bytes(t).tobytes() for t in f.tensors} for f in (read_gguf(plain), read_gguf(weighted)))
    assert a[name] != b[name]
    assert [n for n in a if a[n] != b[n]] == [name]


def test_a_pattern_llama_cpp_cannot_read_gets_its_message(qwen):
    # a Python named group: valid for re, not for llama.cpp's std::regex (ECMAScript)
    bad = recipes.Recipe("Q4_0", (("(?P<x>ffn_down)", "q8_0"),))
    with pytest.raises(QevalError, match="failed to quantize"):
        recipes.plan(qwen["source"], bad)


def test_the_command_measures_keeps_and_then_reuses(qwen):
    import json  # noqa: PLC0415

    args = ("recipe", "measure", "Q8_0 ^output\\.weight$=q4_0", "--ref", "REF", "--source", qwen["source"],
            "--chunks", N_CHUNKS, "--runs-dir", qwen["runs"], "--json")
    first = run_cli(*args, "--keep")
    assert first.returncode == 0, first.stderr
    row = json.loads(first.stdout)["rows"][0]
    assert row["status"] == measured.MEASURED and row["kind"] == "recipe"
    kept = qwen["runs"] / "recipes" / f"{row['label']}.gguf"
    assert kept.stat().st_size == row["bytes"] and tensor_types_of(kept)["output.weight"] == "q4_0"
    again = json.loads(run_cli(*args).stdout)["rows"][0]
    assert again["status"] == measured.REUSED and again["kld_mean"] == row["kld_mean"]


# --------------------------------------------------------------------------------------------------
# recipes decided early (--early: the matrix's rounds and rule over the variants)
# --------------------------------------------------------------------------------------------------
N_EARLY = 16  # chunks of the early board's reference: room to stop before the end
EARLY_RECIPES = ("Q4_0", "Q5_0", "Q4_0 ffn_down_exps=q8_0", "Q8_0 ssm_out=q4_0")


@pytest.fixture(scope="module")
def qwen_early(qwen, tmp_path_factory) -> dict:
    """The qwen35moe's reference over N_EARLY chunks, in its own runs directory."""
    runs = tmp_path_factory.mktemp("recipes-early")
    q8 = qwen["source"].parent / "qwen35moe-Q8_0.gguf"
    api.capture_store(str(q8), "REF", runs_dir=runs, n_ctx=N_CTX, chunks=N_EARLY,
                      settings=api.EngineSettings(flash_attn="off"))
    return {"source": qwen["source"], "runs": runs}


def early_request(setup: dict, runs: Path | None = None, early=True, recipes_=EARLY_RECIPES):
    settings = api.early_settings(min_chunks=3) if early else None
    return api.recipe_request(ref=str(setup["runs"] / "REF.qeval"), source=str(setup["source"]), recipes=recipes_,
                              runs_dir=runs or setup["runs"], threads=2, early=settings)


def per_chunk_kld(per_token: dict) -> dict[int, np.ndarray]:
    return {int(c): per_token["kld"][per_token["chunk"] == c] for c in np.unique(per_token["chunk"])}


def test_early_recipes_stop_on_the_matrix_rule_and_a_full_run_extends_them(qwen_early, tmp_path, monkeypatch):
    from qeval.compare import early  # noqa: PLC0415

    request = early_request(qwen_early)
    result, text = sensitivity.measure_report(request)
    rows = result["rows"]
    order = result["early"]["order"]
    assert sorted(order) == list(range(N_EARLY)) and result["early"]["chunks_full"] == N_EARLY * len(rows)
    assert result["early"]["chunks_held"] == sum(r["chunks"] for r in rows) < N_EARLY * len(rows)  # passes saved
    assert "Early: seed 0" in text and "| chunks | stopped |" in text
    assert not list((qwen_early["runs"] / "recipes").glob("*.gguf"))  # each deleted once stopped
    board = []
    for r in rows:
        assert r["status"] == measured.MEASURED and r["stopped"] in (early.SETTLED, early.PRECISION, early.ALL_CHUNKS)
        per = np.load(Path(r["result"]).with_suffix(".npz"))
        held = per_chunk_kld(per)
        assert list(held) == sorted(order[:r["chunks"]])  # a prefix of the board's order
        tokens = np.array([len(held[c]) for c in order[:r["chunks"]]])
        sums = np.array([held[c].astype(np.float64).sum() for c in order[:r["chunks"]]])
        assert r["kld_mean"] == pytest.approx(sums.sum() / tokens.sum(), rel=1e-9)
        size_gib = round(r["bytes"] / 2**30, 4)  # the board's axis: a GGUF's size as its facts hold it
        board.append(early.PairChunks(r["label"], np.array(order[:r["chunks"]]), sums, tokens, size_gib))
    # the reasons are early.decide()'s over what the rows hold, recomputed here from their saved per-token columns
    assert [d.reason for d in early.decide(board, N_EARLY, request.early.rule)] == [r["stopped"] for r in rows]
    assert all(d.stop for d in early.decide(board, N_EARLY, request.early.rule))

    # the same command again: every variant's saved early result answers it, nothing is built
    def no_build(*args, **kwargs):
        raise AssertionError("a variant decided early was built again")

    with monkeypatch.context() as m:
        m.setattr(recipes, "build", no_build)
        again, _ = sensitivity.measure_report(request)
    assert [r["status"] for r in again["rows"]] == [measured.REUSED] * len(rows)
    assert [r["kld_mean"] for r in again["rows"]] == [r["kld_mean"] for r in rows]

    # without --early: each variant runs on from its checkpoint over every chunk, the chunks held kept as they were,
    # and its result is the full run's of a fresh directory, bit for bit
    full, full_text = sensitivity.measure_report(early_request(qwen_early, early=False))
    fresh, _ = sensitivity.measure_report(early_request(qwen_early, tmp_path / "fresh", early=False))
    assert "stopped" not in full_text and "early" not in full
    for e, f, g in zip(rows, full["rows"], fresh["rows"]):
        assert "stopped" not in f and f["status"] == measured.MEASURED
        per_full = per_chunk_kld(np.load(Path(f["result"]).with_suffix(".npz")))
        per_early = per_chunk_kld(np.load(Path(e["result"]).with_suffix(".npz")))
        assert len(per_full) == N_EARLY
        assert all(np.array_equal(per_full[c], per_early[c]) for c in per_early)
        assert f["kld_mean"] == g["kld_mean"] and f["kld_mean_se"] == g["kld_mean_se"]

    # --early again after the full run: the full results answer it, nothing is built, each row holds every chunk
    with monkeypatch.context() as m:
        m.setattr(recipes, "build", no_build)
        after, _ = sensitivity.measure_report(request)
    assert [(r["status"], r["chunks"], r["stopped"]) for r in after["rows"]] == \
        [(measured.REUSED, N_EARLY, early.ALL_CHUNKS)] * len(rows)
    assert [r["kld_mean"] for r in after["rows"]] == [r["kld_mean"] for r in full["rows"]]


def test_a_cost_of_variants_decided_early_is_paired_on_their_common_chunks(qwen_early, tmp_path):
    """Two variants holding different prefixes of the order: the cost is over the chunks both hold, float64."""
    request = early_request(qwen_early, tmp_path, recipes_=EARLY_RECIPES[:2])
    a, b = measured.measure_recipes(dataclasses.replace(request, early=dataclasses.replace(
        request.early, rule=dataclasses.replace(request.early.rule, step=1))))
    if a.summary.chunks == b.summary.chunks:  # make them differ: the second runs on over every chunk
        b = measured.measure_recipes(dataclasses.replace(request, recipes=(b.recipe,), early=None))[0]
    cost = measured.kld_cost(a, b)
    pa, pb = per_chunk_kld(a.per_token), per_chunk_kld(b.per_token)
    common = sorted(set(pa) & set(pb))
    assert len(common) == min(a.summary.chunks, b.summary.chunks) < max(len(pa), len(pb))
    d = np.array([np.mean(pa[c].astype(np.float64) - pb[c]) for c in common])
    assert cost.n_chunks == len(common)
    assert cost.diff == pytest.approx(d.mean(), rel=1e-9, abs=1e-15)
    assert cost.se == pytest.approx(d.std(ddof=1) / np.sqrt(len(d)), rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("args, message", [(["--early-seed", "3"], "need --early"),
                                           (["--early", "--early-min-chunks", "1"], "--early-min-chunks")])
def test_early_options_of_recipes_are_the_matrix_s(qwen, args, message):
    assert_cli_error(run_cli("recipe", "measure", "Q4_0", "--ref", "REF", "--source", qwen["source"],
                             "--runs-dir", qwen["runs"], *args), message)


def test_a_sweep_decided_early_pairs_each_move_with_the_base_on_their_common_chunks(qwen_early, tmp_path):
    request = early_request(qwen_early, tmp_path, recipes_=("Q4_0",))
    result, text = sensitivity.sweep_report(request, ("q8_0",), ("ssm_out", "ffn_down_exps", "token_embd"))
    assert result["early"]["chunks_held"] < result["early"]["chunks_full"] == N_EARLY * (1 + len(result["rows"]))
    assert "| chunks | stopped |" in text and "Early: seed 0" in text
    base = per_chunk_kld(np.load(Path(result["base"]["result"]).with_suffix(".npz")))
    for r in result["rows"]:
        moved = per_chunk_kld(np.load((tmp_path / "recipes" / "results" / f"{r['label']}.vs.REF.npz")))
        common = sorted(set(moved) & set(base))
        assert r["chunks"] == len(common) and r["stopped"]
        d = np.array([np.mean(moved[c].astype(np.float64) - base[c]) for c in common])
        assert r["kld_cost"] == pytest.approx(d.mean(), rel=1e-9, abs=1e-15)
        assert r["kld_cost_se"] == pytest.approx(d.std(ddof=1) / np.sqrt(len(d)), rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("early", [False, True], ids=["every-chunk", "early"])
def test_spellings_of_one_variant_are_built_and_measured_once(qwen_early, tmp_path, monkeypatch, early):
    """Recipes that plan the same tensor types are one variant: built and measured once, in one call and across calls,
    each row showing its own spelling."""
    built = []
    build = recipes.build
    monkeypatch.setattr(recipes, "build", lambda source, recipe, *a, **k: built.append(recipe) or build(source, recipe,
                                                                                                          *a, **k))
    spellings = ("Q4_0 ssm_out=q8_0", r"Q4_0 ^blk\.[0-9]+\.ssm_out\.weight$=q8_0", "Q4_0 ssm_out=q8_0")
    request = early_request(qwen_early, tmp_path, early=early, recipes_=spellings)
    got = measured.measure_recipes(request)
    assert [v.recipe for v in got] == [recipes.parse(t) for t in spellings] and len(built) == 1
    assert got[0].label != got[1].label == recipes.parse(spellings[1]).label()
    assert [v.status for v in got] == [measured.MEASURED, measured.REUSED, measured.REUSED]
    assert len({v.result for v in got}) == 1 and len({v.summary.measured()["kld_mean"].value for v in got}) == 1
    assert len(list((tmp_path / "recipes" / "results").glob("*.json"))) == 1

    built.clear()  # the other spelling alone, later: its saved result answers it
    alone = measured.measure_recipes(dataclasses.replace(request, recipes=(recipes.parse(spellings[1]),)))[0]
    assert not built and alone.status == measured.REUSED and alone.result == got[0].result
    assert alone.recipe == recipes.parse(spellings[1])
    # another plan is another variant
    other = measured.measure_recipes(dataclasses.replace(request, recipes=(recipes.parse("Q4_0 ssm_out=q5_0"),)))[0]
    assert len(built) == 1 and other.status == measured.MEASURED and other.result != got[0].result


# --------------------------------------------------------------------------------------------------
# held-out chunks, measured refinement, layer-range groups (issue 35)
# --------------------------------------------------------------------------------------------------
def test_a_split_is_disjoint_seeded_and_recorded():
    split = chunk_split.draw_split(20, 8, seed=3)
    tuning, held = set(split.tuning.chunks), set(split.held_out.chunks)
    assert not tuning & held and tuning | held == set(range(20)) and (len(tuning), len(held)) == (12, 8)
    assert split == chunk_split.draw_split(20, 8, seed=3)  # the seed draws it again
    assert split.held_out != chunk_split.draw_split(20, 8, seed=4).held_out
    assert split.to_json() == {"seed": 3, "tuning": sorted(tuning), "held_out": sorted(held)}
    order = np.random.default_rng(3).permutation(20)  # the recorded rule: the permutation's first 8 held out
    assert sorted(held) == sorted(order[:8].tolist())
    per_token = {"chunk": np.repeat(np.arange(20), 3), "kld": np.arange(60.0)}
    cols = split.held_out.columns(per_token)
    assert set(cols["chunk"].tolist()) == held and len(cols["kld"]) == 24
    assert np.array_equal(cols["kld"], per_token["kld"][np.isin(per_token["chunk"], sorted(held))])


@pytest.mark.parametrize("n, held, numbers", [(15, 8, "15 chunks with --holdout 8 leave 7 for tuning"),
                                              (20, 7, "20 chunks with --holdout 7 leave 13 for tuning and 7"),
                                              (20, 13, "leave 7 for tuning and 13 held out")])
def test_a_split_with_too_few_chunks_is_refused(n, held, numbers):
    with pytest.raises(QevalError, match="at least 8 tuning and 8 held-out") as err:
        chunk_split.draw_split(n, held, seed=0)
    assert numbers in str(err.value)


@pytest.mark.parametrize("args, message", [(["--refine-builds", "0"], "--refine-builds 0: a refinement needs a "
                                                                       "budget of at least 1"),
                                           (["--split-seed", "2"], "needs --holdout"),
                                           (["--split-edges", "-1"], "--split-edges -1")])
def test_bad_search_settings_get_one_clear_message(tmp_path, args, message):
    assert_cli_error(run_cli("recipe", "fit", "Q4_K_M", "--to", "q8_0", "--max-mb", "100", "--ref", "REF",
                             "--source", tmp_path / "none.gguf", "--runs-dir", tmp_path, *args), message)


class FakeCache:
    """The recipes' cache as refine() uses it, over synthetic per-token KLD: a recipe's variant built once (status
    MEASURED), then reused. Its KLD on the tuning chunks is the base's plus its moves' costs plus an interaction (a
    and b both down compound); on the held-out chunks it is `held_out(truth)`, which no decision may read."""

    COST = {"a": 0.01, "b": 0.02, "c": 0.03}
    N_CHUNKS, TOKENS = 20, 4

    def __init__(self, split, held_out):
        self.split, self.held_out, self.variants, self.builds = split, held_out, {}, []

    def truth(self, recipe) -> float:
        moved = {p: t for p, t in recipe.overrides}
        kld = 0.1 + sum(self.COST[g] if t == "q4_0" else -0.005 for g, t in moved.items())
        return kld + (0.05 if moved.get("a") == moved.get("b") == "q4_0" else 0.0)

    def size(self, recipe) -> int:
        return 1000 + sum(-100 if t == "q4_0" else 50 for _, t in recipe.overrides)

    def measure(self, recipe):
        key = recipe.canonical()["overrides"]
        key = tuple(sorted(map(tuple, key)))
        if key in self.variants:
            return dataclasses.replace(self.variants[key], recipe=recipe, status=measured.REUSED)
        self.builds.append(key)
        chunk = np.repeat(np.arange(self.N_CHUNKS), self.TOKENS)
        noise = np.random.default_rng(len(self.builds)).normal(0.0, 1e-4, chunk.size)
        held = np.isin(chunk, self.split.held_out.chunks)
        kld = np.where(held, self.held_out(self.truth(recipe)), self.truth(recipe) + noise)
        per_token = {"chunk": chunk, "position": np.tile(np.arange(self.TOKENS), self.N_CHUNKS), "kld": kld}
        variant = measured.Variant(recipe, recipe.label(), self.size(recipe), None, per_token, Path("none"),
                                   measured.MEASURED)
        self.variants[key] = variant
        return variant


def fake_options() -> list[Option]:
    return [o for g, cost in FakeCache.COST.items()
            for o in (Option(g, "", 0, 0.0), Option(g, "q4_0", -100, cost), Option(g, "q8_0", 50, -0.005))]


def fake_recipe(options) -> recipes.Recipe:
    return recipes.Recipe("Q4_0", tuple((o.group, o.type) for o in options if o.type))


def refined_with(held_out, builds=1, cache=None):
    from qeval.orchestrate import refine  # noqa: PLC0415

    split = chunk_split.draw_split(FakeCache.N_CHUNKS, 8, seed=1)
    cache = cache or FakeCache(split, held_out)
    budget = recipe_choice.Budget(max_bytes=800)
    start = recipe_choice.choose(fake_options(), 1000, 0.1, max_bytes=800)
    return refine.refine(start.options, fake_options(), budget, builds, fake_recipe, cache.measure,
                         split.tuning), cache, start


def test_refinement_measures_a_swap_the_additive_choice_missed():
    # additively a and b down (800 bytes, predicted 0.13) is best; measured, they compound (0.18), and the swap to a
    # and c down (0.14) is the neighbour predicted best from that measurement: one build finds it
    result, cache, start = refined_with(lambda truth: 5.0 - truth)
    assert {o.group: o.type for o in start.options} == {"a": "q4_0", "b": "q4_0", "c": ""}
    assert result.start.recipe == fake_recipe(start.options)
    assert result.best.recipe.overrides == (("a", "q4_0"), ("c", "q4_0"))
    assert result.builds == 1 and len(result.tried) == 1 and result.tried[0].accepted
    assert result.tried[0].predicted_kld == pytest.approx(0.18 + 0.03 - 0.02, abs=1e-3)
    assert result.best.bytes <= 800


def test_refinement_keeps_its_build_budget_and_never_builds_a_variant_twice():
    result, cache, _ = refined_with(lambda truth: truth, builds=2)
    assert result.builds == 2 == len(cache.builds) - 1  # the start is the fit's own variant, not the budget's
    assert all(FakeCache.size(None, t.variant.recipe) <= 800 for t in result.tried)  # the size is known: kept
    # a larger budget over the same cache: what was built is reused (not counted), each variant built once, and the
    # search stops where no untried neighbour within the size is left, short of its budget
    more, cache, _ = refined_with(lambda truth: truth, builds=50, cache=cache)
    assert len(set(cache.builds)) == len(cache.builds) == 1 + 2 + more.builds < 1 + 2 + 50
    assert [t.variant.status for t in more.tried][:2] == [measured.REUSED] * 2
    assert [t.variant.recipe for t in more.tried][:2] == [t.variant.recipe for t in result.tried]
    accepted = [t for t in more.tried if t.accepted]
    assert more.best.recipe == (accepted[-1].variant.recipe if accepted else more.start.recipe)
    assert all(b.kld < a.kld for a, b in zip(accepted, accepted[1:]))  # each accepted step lowers the tuning KLD


def test_no_decision_reads_the_held_out_chunks():
    """The held-out chunks hold values that reverse every comparison, or NaN: the search is the same step for step,
    and its tuning figures are the tuning chunks' alone."""
    runs = [refined_with(held, builds=3)[0] for held in (lambda t: t, lambda t: 5.0 - t, lambda t: float("nan"))]
    for r in runs[1:]:
        assert [t.variant.recipe for t in r.tried] == [t.variant.recipe for t in runs[0].tried]
        assert [t.kld for t in r.tried] == [t.kld for t in runs[0].tried]
        assert r.best.recipe == runs[0].best.recipe
    tuning = chunk_split.draw_split(FakeCache.N_CHUNKS, 8, seed=1).tuning
    seen = measured.seen_on(runs[2].best, tuning)
    assert set(seen.per_token["chunk"].tolist()) == set(tuning.chunks) and np.isfinite(seen.kld_mean)
    assert not hasattr(seen, "summary")  # a decision's view holds nothing of the other chunks


def test_layer_range_groups_of_a_tiny_model(qwen):
    planned = recipes.plan(qwen["source"], recipes.parse("Q8_0"))
    assert recipes.block_count(planned) == 4
    whole = {g.name: g for g in recipes.tensor_groups(planned)}
    split = recipes.tensor_groups(planned, split_edges=1)
    names = [g.name for g in split]
    assert {"ffn_down_exps@0", "ffn_down_exps@1-2", "ffn_down_exps@3", "ssm_out@0", "ssm_out@1-2",
            "attn_q@3", "token_embd", "output"} <= set(names)
    assert "ssm_out@3" not in names and "attn_q@0" not in names  # layer 3 is attention, 0-2 recurrent
    for role, group in whole.items():  # a role's ranges are its group, split
        parts = [g for g in split if g.role == role]
        assert sorted(t for g in parts for t in g.tensors) == sorted(group.tensors), role
    for g in split:  # each pattern names exactly its tensors
        assert sorted(n for n in planned if re.search(g.pattern, n)) == sorted(g.tensors), g.name
    with pytest.raises(QevalError, match="--split-edges 2: .* a model of 4 blocks"):
        recipes.tensor_groups(planned, split_edges=2)
    # a sweep's --group names a role's ranges, or one range
    moves, _ = sensitivity.plan_moves(qwen["source"], recipes.parse("Q4_0"), ("q8_0",), ("ssm_out", "attn_q@3"),
                                      split_edges=1)
    assert [m.group.name for m in moves] == ["ssm_out@0", "ssm_out@1-2", "attn_q@3"]
    assert all(set(m.changed) == set(m.group.tensors) for m in moves)  # each move changes its range's tensors only


def chunk_differences(a: dict, b: dict, chunks) -> np.ndarray:
    """Per-chunk mean of a's KLD minus b's, float64, over `chunks`."""
    return np.array([np.mean(a["kld"][a["chunk"] == c].astype(np.float64) - b["kld"][b["chunk"] == c])
                     for c in chunks])


def test_fit_with_held_out_chunks_and_refinement(qwen_early, tmp_path, monkeypatch):
    """A fit on the tuning chunks, each choice reported against its stock type on both sets (float64 over the saved
    per-token columns), the split recorded; and the same fit with every held-out KLD changed chooses the same."""
    request = early_request(qwen_early, tmp_path, early=False, recipes_=("Q4_0",))
    search = api.recipe_search(holdout=8, split_seed=5, refine_builds=1)
    groups = ("ssm_out", "ffn_down_exps")
    swept = sensitivity.sweep(request, ("q8_0",), groups, search=search)
    budget = swept.base.bytes + max(-r.bytes_saved for r in swept.rows)  # room for the larger move alone
    result, text = api.recipe_fit_report(request, ["q8_0"], max_mb=[budget / 1e6], stock=["Q4_0"], only=groups,
                                         search=search)
    split = chunk_split.draw_split(N_EARLY, 8, 5)
    assert result["split"] == split.to_json() and "Chunks split by seed 5: 8 tuning" in text
    (row,) = result["budgets"]
    rows = {r["label"]: r for r in result["rows"]}
    per = {label: np.load(Path(r["result"]).with_suffix(".npz")) for label, r in rows.items()}
    stock = row["stock"]
    for subset, name in ((split.tuning, "tuning"), (split.held_out, "held_out")):
        d = chunk_differences(per[row["measured"]["label"]], per["Q4_0"], subset.chunks)
        assert stock[name]["diff"] == pytest.approx(d.mean(), rel=1e-9, abs=1e-15)
        assert stock[name]["se"] == pytest.approx(d.std(ddof=1) / np.sqrt(8), rel=1e-9, abs=1e-15)
        assert stock[name]["chunks"] == 8
    assert stock["optimism"] == pytest.approx(stock["tuning"]["diff"] - stock["held_out"]["diff"], rel=1e-12)
    refined = row["refined"]
    assert refined["builds"] <= 1 and len(refined["tried"]) >= refined["builds"]
    assert {"tuning", "held_out", "optimism"} <= set(refined["gain"]) and "| refined " in text

    # every held-out KLD changed (each variant its own way): the same sweep ranking, choice and refinement
    load = measured._variant
    held = np.array(split.held_out.chunks)

    def scrambled(recipe, facts, path, status):
        v = load(recipe, facts, path, status)
        per_token = dict(v.per_token)
        at = np.isin(per_token["chunk"], held)
        scale = 1 + (sum(map(ord, v.label)) % 7)
        per_token["kld"] = np.where(at, per_token["kld"] * 100 * scale + scale, per_token["kld"])
        return dataclasses.replace(v, per_token=per_token)

    monkeypatch.setattr(measured, "_variant", scrambled)
    again, _ = api.recipe_fit_report(request, ["q8_0"], max_mb=[budget / 1e6], stock=["Q4_0"], only=groups,
                                     search=search)
    (other,) = again["budgets"]
    assert other["recipe"] == row["recipe"] and other["refined"]["recipe"] == refined["recipe"]
    assert [t["recipe"] for t in other["refined"]["tried"]] == [t["recipe"] for t in refined["tried"]]
    assert other["stock"]["tuning"] == stock["tuning"] and other["stock"]["held_out"] != stock["held_out"]
    swept_again = sensitivity.sweep(request, ("q8_0",), groups, search=search)
    assert [r.cost.diff for r in swept_again.rows] == [r.cost.diff for r in swept.rows]
    sweep_result, sweep_text = api.recipe_sweep_report(request, ["q8_0"], groups, search=search)
    assert "held-out KLD cost" in sweep_text and all("held_out" in r for r in sweep_result["rows"])


def test_a_split_too_small_for_the_reference_is_refused(qwen):
    assert_cli_error(run_cli("recipe", "fit", "Q4_0", "--to", "q8_0", "--max-mb", "1", "--ref", "REF", "--source",
                             qwen["source"], "--runs-dir", qwen["runs"], "--holdout", "8"),
                     f"{N_CHUNKS} chunks with --holdout 8 leave 0 for tuning and 8 held out")
