"""Needles at depth (docs/needles.md): planting, needle files, the answers' scores against plain float64 numpy,
Wilson intervals; with Gemma-3-270M (slow), the prefix decoded once against a fresh pass per question."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, kld64, log_softmax64

from qeval.compare.needle_scores import ANSWER_FIELDS, answer_of, score_answer, summarize_answers
from qeval.compare.stats import wilson_interval
from qeval.errors import QevalError
from qeval.inputs import needles as nd


def fake_tokenize(text: str) -> np.ndarray:
    """One token per character (ids 1000+), so lengths are known."""
    return np.array([1000 + ord(c) for c in text], np.int32)


NEEDLES = [nd.Needle(fact=f"Fact {i} is {i}.", question=f"Fact {i}?", answer=str(i)) for i in range(10, 17)]
HAY = np.arange(5000, dtype=np.int32) % 900


def test_facts_are_planted_at_their_depths_and_questions_fit_the_window():
    trials = nd.plant_trials(HAY, fake_tokenize, 2, NEEDLES, depths=nd.DEFAULT_DEPTHS, n_ctx=1024, trials=3,
                             seed=7, jitter=0)
    for trial in trials:
        assert trial.prefix[0] == 2
        for p in trial.planted:
            fact = fake_tokenize(nd.FACT.format(fact=p.needle.fact))
            assert np.array_equal(trial.prefix[p.position:p.position + len(fact)], fact)
            assert abs(p.position - p.depth / 100 * (len(trial.prefix) - len(fact))) <= 1
            assert np.array_equal(p.answer, fake_tokenize(" " + p.needle.answer))
            assert len(trial.prefix) + len(p.continuation) <= 1024
            assert p.first_scored == len(p.question) - 1
        assert max(len(trial.prefix) + len(p.continuation) for p in trial.planted) == 1024
        facts = sum(len(fake_tokenize(nd.FACT.format(fact=p.needle.fact))) for p in trial.planted)
        hay = np.concatenate([np.delete(trial.prefix, np.r_[0:1, *[np.arange(p.position, p.position + len(
            fake_tokenize(nd.FACT.format(fact=p.needle.fact)))) for p in trial.planted]])])
        assert np.array_equal(hay, HAY[trial.offset:trial.offset + len(trial.prefix) - 1 - facts])
        tails = sum(len(p.continuation) for p in trial.planted)
        assert trial.forward_tokens() == (len(trial.prefix) + tails, 5 * len(trial.prefix) + tails)
    again = nd.plant_trials(HAY, fake_tokenize, 2, NEEDLES, depths=nd.DEFAULT_DEPTHS, n_ctx=1024, trials=3,
                            seed=7, jitter=0)
    assert all(np.array_equal(a.prefix, b.prefix) for a, b in zip(trials, again))  # seeded
    assert len({t.offset for t in trials}) == 3


def test_jitter_moves_facts_within_its_spread():
    trial, = nd.plant_trials(HAY, fake_tokenize, None, NEEDLES, depths=(50.0,), n_ctx=2048, trials=1, jitter=2)
    p = trial.planted[0]
    assert abs(p.position - 0.5 * len(trial.prefix)) <= 0.02 * len(trial.prefix) + 20


@pytest.mark.parametrize("kwargs, message", [
    ({"n_ctx": 150}, "too small"), ({"trials": 0}, "--trials"), ({"depths": tuple(range(8))}, "needles"),
])
def test_bad_requests_are_refused(kwargs, message):
    args = {"depths": nd.DEFAULT_DEPTHS, "n_ctx": 1024, "trials": 1, **kwargs}
    with pytest.raises(QevalError, match=message):
        nd.plant_trials(HAY, fake_tokenize, 2, NEEDLES, **args)


@pytest.mark.parametrize("text, message", [("5,101", "0 to 100"), ("-1", "0 to 100"), ("a", "percentages"),
                                           (",", "0 to 100")])
def test_bad_depths_are_refused(text, message):
    with pytest.raises(QevalError, match=message):
        nd.parse_depths(text)


def test_depths_parse_sorted():
    assert nd.parse_depths("50,5,50") == (5.0, 50.0)


@pytest.mark.parametrize("text, message", [
    ("{bad", "line 1: not JSON"), ('\n["a"]', "line 2: expected an object"),
    ('{"fact": "x", "question": "y"}', "line 1: answer must be"), ("", "holds no needle"),
])
def test_bad_needle_files_are_refused(tmp_path, text, message):
    path = tmp_path / "n.jsonl"
    path.write_text(text)
    with pytest.raises(QevalError, match=message):
        nd.load_needles(str(path))


def test_a_missing_needle_file_is_refused(tmp_path):
    with pytest.raises(QevalError, match="does not exist"):
        nd.load_needles(str(tmp_path / "none.jsonl"))


def test_the_shipped_suite_parses():
    needles = nd.parse_needles((REPO / "corpora" / "needles.jsonl").read_text(), "shipped")
    assert len(needles) >= 20 and len({n.answer for n in needles}) == len(needles)
    assert all(n.answer in n.fact for n in needles)
    user = json.dumps({"fact": "A is 1.", "question": "A?", "answer": "1", "id": 3})
    assert nd.parse_needles(user, "u") == [nd.Needle(fact="A is 1.", question="A?", answer="1")]


def test_answer_scores_match_plain_float64():
    rng = np.random.default_rng(0)
    ref = rng.normal(0, 3, (4, 50)).astype(np.float32)
    cand = (ref + rng.normal(0, 0.5, ref.shape)).astype(np.float32)
    answer = ref.argmax(axis=1)
    answer[3] = (answer[3] + 1) % 50
    s = score_answer(ref, cand, answer)
    p, q = log_softmax64(ref), log_softmax64(cand)
    assert s.kld == pytest.approx(kld64(p, q).mean(), rel=1e-12)
    assert s.ref_logprob == pytest.approx(p[np.arange(4), answer].sum(), rel=1e-12)
    assert s.cand_logprob == pytest.approx(q[np.arange(4), answer].sum(), rel=1e-12)
    same = ref.argmax(1) == cand.argmax(1)
    assert s.same_top1 == same.sum() and s.flip == (not same.all())
    assert not s.ref_correct
    same_run = score_answer(ref, ref, ref.argmax(axis=1))
    assert same_run.kld == 0 and not same_run.flip and same_run.ref_correct and same_run.cand_correct
    flipped = score_answer(ref, -ref, answer)
    assert flipped.flip and flipped.same_top1 == 0
    summary = summarize_answers([same_run, flipped])
    assert summary["agreement"]["hits"] == 1 and summary["same_top1"]["n"] == 8
    assert summary["kld"]["mean"] == pytest.approx(flipped.kld / 2)


def test_wilson_interval_values():
    # 95 % Wilson intervals, from the formula by hand: 8/10 -> (0.4902, 0.9433); 0/20 -> (0, z²/(n + z²) = 0.161125)
    assert wilson_interval(8, 10) == pytest.approx((0.490162, 0.943318), abs=1e-6)
    assert wilson_interval(0, 20) == pytest.approx((0.0, 1.959963984540054 ** 2 / (20 + 1.959963984540054 ** 2)), abs=1e-6)
    assert wilson_interval(20, 20)[1] == 1.0
    assert wilson_interval(0, 0) == (0.0, 1.0)


@pytest.fixture()
def shipped_here(monkeypatch):
    """The worktree's corpora/ as the shipped folder (an editable install may point qeval.corpora elsewhere)."""
    monkeypatch.setattr(nd, "shipped_dir", lambda: REPO / "corpora")


def test_a_prefix_decoded_once_gives_a_fresh_pass_logits(models, shipped_here):
    from qeval.engine.engine import EngineSettings
    from qeval.engine.prefix import PrefixModel
    from qeval.inputs.corpus import load_corpus

    with PrefixModel(models["Q8_0"], EngineSettings(flash_attn="off"), 768) as model:
        hay = model.tokenize(load_corpus(None).text[:40000], add_special=False)
        _, needles = nd.load_needles(None)
        trial, = nd.plant_trials(hay, lambda t: model.tokenize(t, False), model.bos, needles,
                                 depths=(10.0, 90.0), n_ctx=768, trials=1)
        state = model.decode_prefix(trial.prefix)
        kept = [model.continue_from(state, len(trial.prefix), p.continuation, p.first_scored) for p in trial.planted]
        for p, kept in zip(trial.planted, kept):
            fresh = model.fresh(np.concatenate([trial.prefix, p.continuation]), len(trial.prefix) + p.first_scored)
            # the tail cut leaves the prefix's cells as decoded: bit-identical here (-fa off, pieces of 128)
            assert kept.shape == (len(p.answer), model.n_vocab) and np.array_equal(kept, fresh)
        assert model.decoded == (len(trial.prefix) + sum(len(p.continuation) for p in trial.planted)
                                 + sum(len(trial.prefix) + len(p.continuation) for p in trial.planted))


def test_needles_f16_against_itself_and_a_q4_0_cache_then_resumed_and_extended(models, shipped_here, tmp_path):
    from qeval.engine.engine import EngineSettings
    from qeval.engine.modelinfo import model_facts
    from qeval.orchestrate.matrix import pair_settings
    from qeval.orchestrate.needles import NeedleRequest, Run, run_needles

    path = str(models["Q8_0"])
    f16, q4_0 = Run(label="f16", model=path, settings=EngineSettings()), \
        Run(label="q4_0", model=path, settings=pair_settings("q4_0"))
    request = NeedleRequest(reference=Run(label="ref", model=path, settings=EngineSettings()),
                            candidates=(f16, q4_0), contexts=(512,), depths=(5.0, 95.0), trials=2,
                            directory=tmp_path)
    block, = run_needles(request)["contexts"]
    same, q4 = block["candidates"]
    assert same["all"]["kld"]["mean"] == 0 and same["all"]["agreement"]["p"] == 1
    assert same["all"]["same_top1"]["p"] == 1
    assert q4["kv_allocated"]["type_k"] == "q4_0" and q4["kv_allocated"]["type_v"] == "q4_0"
    # the model as results record it, so a cache board joins needles of the same reference only
    assert block["reference"]["fingerprint"] == q4["fingerprint"] == model_facts(path)["fingerprint"]
    assert q4["all"]["kld"]["mean"] > 0 and q4["all"]["answers"] == 4
    cost = block["forward_tokens_per_trial"]
    assert cost["naive"] > cost["prefix_once"] > block["prefix_tokens"]
    assert [r["trials_read_back"] for r in (block["reference"], same, q4)] == [0, 0, 0]

    # a third trial and a new row: the trials recorded are read back, only the missing ones decoded
    q8_0 = Run(label="q8_0", model=path, settings=pair_settings("q8_0"))
    more = dataclasses.replace(request, candidates=(f16, q4_0, q8_0), trials=3)
    said = []
    extended, = run_needles(more, say=said.append)["contexts"]
    assert said == [f"n_ctx 512: trial {t}/3" for t in (1, 2, 3)]  # every trial lacks the new row
    assert [r["trials_read_back"] for r in (extended["reference"], *extended["candidates"])] == [2, 2, 2, 0]
    assert extended["candidates"][2]["all"]["answers"] == extended["candidates"][1]["all"]["answers"] == 6
    lines = {c["label"]: Path(c["trials_file"]).read_text().splitlines() for c in extended["candidates"]}
    assert [len(v) for v in lines.values()] == [4, 4, 4]  # a header and one line per trial, none twice
    # the same request again decodes nothing, and gives the same numbers
    again, = run_needles(more, say=said.append)["contexts"]
    assert len(said) == 3 and again == {**extended, "reference": {
        **extended["reference"], "trials_read_back": 3}, "candidates": [
        {**c, "trials_read_back": 3} for c in extended["candidates"]]}
    # the first two trials of the extended q4_0 row are the first run's
    first_two = dataclasses.replace(request, candidates=(q4_0,))
    assert run_needles(first_two)["contexts"][0]["candidates"][0]["all"] == q4["all"]


def test_a_hybrid_model_puts_the_prefix_state_back(gemma_tokenizer, tmp_path):
    """A recurrent state cannot be cut back: the prefix's state is saved and put back, and each question still
    gets the logits of a fresh pass over prefix + question (a tiny random-weight qwen35moe; its float logits are
    compared with a tolerance, since the continuation's ubatches differ from the fresh pass's)."""
    import tinymodels

    from qeval.engine.engine import EngineSettings
    from qeval.engine.prefix import PrefixModel

    path = tinymodels.build_qwen35moe(tmp_path / "qwen35moe-F16.gguf", gemma_tokenizer)
    rng = np.random.default_rng(3)
    prefix = rng.integers(10, 1000, 60)
    questions = [rng.integers(10, 1000, 9), rng.integers(10, 1000, 5)]
    with PrefixModel(path, EngineSettings(flash_attn="off"), 96) as model:
        state = model.decode_prefix(prefix)
        assert state is not None  # a hybrid: its state is saved
        kept = [model.continue_from(state, len(prefix), q, 2) for q in questions]
        # without the saved state put back, this one would follow the second question's recurrent state
        first_again = model.continue_from(state, len(prefix), questions[0], 2)
        np.testing.assert_array_equal(first_again, kept[0])
        for q, rows in zip(questions, kept):  # fresh passes last: each one leaves prefix + question in the cache
            fresh = model.fresh(np.concatenate([prefix, q]), len(prefix) + 2)
            assert rows.shape == fresh.shape == (len(q) - 2, model.n_vocab)
            np.testing.assert_allclose(rows, fresh, rtol=0, atol=1e-3 * np.abs(fresh).max())


# --------------------------------------------------------------------------------------------------
# the trials file (qeval.storage.needle_trials)
# --------------------------------------------------------------------------------------------------
IDENTITY = {"reference": {"model": {"fingerprint": "ab"}}, "candidate": None, "design": {"n_ctx": 512}}
KV = {"type_k": "f16", "type_v": "f16", "flash_attn": True}


def _record(trial: int):
    from qeval.compare.needle_scores import answer_json
    from qeval.storage.needle_trials import TrialRecord

    score = score_answer(np.array([[0.0, 1.0, 2.0]]), np.array([[0.5, 1.0, 2.5]]), np.array([2]))
    return TrialRecord(trial=trial, seconds=1.5, forward_tokens=600,
                       answers=(answer_json(5.0, score), answer_json(95.0, score)))


def _trials_file(tmp_path, trials=(0, 1)):
    from qeval.storage.needle_trials import NeedleTrials, trials_path

    row = NeedleTrials(trials_path(tmp_path, IDENTITY), IDENTITY, ANSWER_FIELDS)
    row.start(KV)
    for t in trials:
        row.append(_record(t))
    return row.path


def test_trials_are_read_back_as_written(tmp_path):
    from qeval.storage.needle_trials import NeedleTrials

    path = _trials_file(tmp_path, trials=(1, 0))
    again = NeedleTrials(path, IDENTITY, ANSWER_FIELDS)
    assert again.recorded == {0: _record(0), 1: _record(1)} and again.read_back == {0, 1}
    assert again.kv_allocated == KV
    score = score_answer(np.array([[0.0, 1.0, 2.0]]), np.array([[0.5, 1.0, 2.5]]), np.array([2]))
    assert [answer_of(a) for a in again.recorded[0].answers] == [(5.0, score), (95.0, score)]
    again.start(KV)  # the same cache: nothing written
    again.append(_record(2))
    assert sorted(NeedleTrials(path, IDENTITY, ANSWER_FIELDS).recorded) == [0, 1, 2]
    assert len(path.read_text().splitlines()) == 4


def test_a_torn_last_line_is_dropped_and_its_trial_run_again(tmp_path):
    from qeval.storage.needle_trials import NeedleTrials

    path = _trials_file(tmp_path)
    whole = path.read_bytes()
    path.write_bytes(whole[:-20])  # killed while writing trial 1's line
    row = NeedleTrials(path, IDENTITY, ANSWER_FIELDS)
    assert sorted(row.recorded) == [0] and path.read_bytes() == whole[:whole.rfind(b"\n", 0, -1) + 1]
    row.start(KV)
    row.append(_record(1))
    assert path.read_bytes() == whole
    path.write_bytes(whole[:30])  # killed while writing the header: the file starts again
    row = NeedleTrials(path, IDENTITY, ANSWER_FIELDS)
    assert row.recorded == {} and path.read_bytes() == b""
    row.start(KV)
    assert path.read_bytes() == whole[:whole.find(b"\n") + 1]


@pytest.mark.parametrize("damage, message", [
    (lambda text: text.replace('"n_ctx": 512', '"n_ctx": 1024'), "another row than its name says"),
    (lambda text: text.replace('"trial": 1', '"trial": 0'), "records trial 0 twice"),
    (lambda text: text.replace('"forward_tokens": 600', '"forward_tokens": "600"'), "line 2 is no trial record"),
    (lambda text: text.replace('"trial": 1', '"trial": -1'), "line 3 is no trial record"),
    (lambda text: text.replace('"flip": false', '"flip": 0'), "line 2 is no trial record"),
    (lambda text: text.replace('"kld": ', '"kl": '), "line 2 is no trial record"),
    (lambda text: text.replace("qeval-needle-trials", "something-else"), "no qeval needle-trials file"),
    (lambda text: text.split("\n", 1)[1], "no qeval needle-trials file"),
    (lambda text: "# notes\n", "no qeval needle-trials file"),
    (lambda text: "# notes", "no qeval needle-trials file"),  # not even a torn header: never cut
])
def test_a_damaged_trials_file_is_refused_and_left_as_it_is(tmp_path, damage, message):
    from qeval.storage.needle_trials import NeedleTrials

    path = _trials_file(tmp_path)
    path.write_text(damage(path.read_text()))
    before = path.read_bytes()
    with pytest.raises(QevalError, match=message):
        NeedleTrials(path, IDENTITY, ANSWER_FIELDS)
    assert path.read_bytes() == before


def test_another_allocated_cache_is_refused(tmp_path):
    from qeval.storage.needle_trials import NeedleTrials

    row = NeedleTrials(_trials_file(tmp_path), IDENTITY, ANSWER_FIELDS)
    with pytest.raises(QevalError, match="allocated the KV cache"):
        row.start({**KV, "type_k": "q8_0"})


def test_a_missing_or_bad_model_is_one_message(tmp_path):
    from conftest import run_cli

    (tmp_path / "junk.gguf").write_bytes(b"junk")
    for model, message in ((tmp_path / "none.gguf", "does not exist"), (tmp_path / "junk.gguf", "not a GGUF")):
        done = run_cli("needle", str(model), "-c", "1024", "--trials", "1", "--runs-dir", str(tmp_path / "runs"))
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "runs").exists()


def test_early_rows_stop_where_the_rule_says_and_hold_only_those_trials(models, shipped_here, tmp_path):
    """--early: trials are the chunks; each row's decision is early.decide() over its trials as recorded, and no row
    decodes a trial past its stop. A later run without --early extends every row; with it again, nothing runs."""
    from qeval.compare import early
    from qeval.engine.engine import EngineSettings
    from qeval.engine.modelinfo import kv_cache_gib, model_facts
    from qeval.orchestrate.matrix import pair_settings
    from qeval.orchestrate.needles import NeedleRequest, Run, run_needles

    path = str(models["Q8_0"])
    rows = (Run(label="f16", model=path, settings=EngineSettings()),
            Run(label="q8_0", model=path, settings=pair_settings("q8_0")),
            Run(label="q4_0", model=path, settings=pair_settings("q4_0")),
            Run(label="q8_0", model=path, settings=pair_settings("q8_0")))  # given twice: one row of the board
    rule = early.StopRule(min_chunks=2, step=2, rel_precision=0.5)
    request = NeedleRequest(reference=Run(label="ref", model=path, settings=EngineSettings()), candidates=rows,
                            contexts=(512,), depths=(5.0, 95.0), trials=4, directory=tmp_path,
                            early=early.EarlySettings(rule=rule))
    said = []
    block, = run_needles(request, say=said.append)["contexts"]
    control, *others = block["candidates"]
    assert control["early"]["reason"] == early.SETTLED and control["early"]["n_chunks"] == 2  # the control
    recorded = {}
    for cand in block["candidates"]:
        lines = [json.loads(x) for x in Path(cand["trials_file"]).read_text().splitlines()[1:]]
        assert sorted(x["trial"] for x in lines) == list(range(cand["early"]["n_chunks"]))  # no trial past the stop
        assert cand["all"]["answers"] == 2 * cand["early"]["n_chunks"]
        recorded[cand["label"]] = {x["trial"]: [a["kld"] for a in x["answers"]] for x in lines}
    # the decisions, recomputed from the files with plain sums
    facts = model_facts(path)
    memory = [facts["size_gib"] + kv_cache_gib(facts, r.settings.type_k, r.settings.type_v, 512) for r in rows[:3]]
    pairs = [early.PairChunks(label=label, chunks=np.array(sorted(t)), sums=np.array([sum(t[i]) for i in sorted(t)]),
                              tokens=np.array([len(t[i]) for i in sorted(t)]), memory_gib=memory[k],
                              kv_quant=k > 0, control=k == 0) for k, (label, t) in enumerate(recorded.items())]
    again = {d.label: d for d in early.decide(pairs, 4, rule)}
    assert block["candidates"][3] == block["candidates"][1]
    for cand in block["candidates"]:
        d = again[cand["label"]]
        assert (d.stop, d.reason, d.n_chunks) == (cand["early"]["stop"], cand["early"]["reason"],
                                                  cand["early"]["n_chunks"])
        assert cand["early"]["estimate"]["mean"] == pytest.approx(d.estimate.mean, rel=1e-12)
        assert cand["all"]["kld"]["mean"] == pytest.approx(d.estimate.mean, rel=1e-12, abs=0)
    assert len(said) == max(c["early"]["n_chunks"] for c in block["candidates"])  # the reference once per trial
    # the same request decodes nothing; without --early, every row runs on to all four trials
    said.clear()
    rerun = run_needles(request, say=said.append)["contexts"][0]["candidates"]
    assert said == [] and [c["trials_read_back"] for c in rerun] == [c["early"]["n_chunks"] for c in rerun]
    assert rerun == [{**c, "trials_read_back": r["trials_read_back"]} for c, r in zip(block["candidates"], rerun)]
    full, = run_needles(dataclasses.replace(request, early=None))["contexts"]
    assert [c["all"]["answers"] for c in full["candidates"]] == [8] * 4 and "early" not in full["candidates"][0]
    assert full["candidates"][0]["trials_read_back"] == 2


def test_needle_early_seed_is_refused(tmp_path):
    from qeval.compare import early
    from qeval.engine.engine import EngineSettings
    from qeval.orchestrate.needles import NeedleRequest, Run, run_needles

    run = Run(label="x", model=str(tmp_path / "none.gguf"), settings=EngineSettings())
    request = NeedleRequest(reference=run, candidates=(run,), contexts=(512,), depths=(50.0,), trials=4,
                            directory=tmp_path, early=early.EarlySettings(seed=3))
    with pytest.raises(QevalError, match="--early-seed"):
        run_needles(request)
