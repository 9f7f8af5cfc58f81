"""Conversation captures on the real Gemma-3-270M (--score assistant): windows, padding, scored tokens, live
candidates, and the refusals a user meets."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import assert_cli_error, run_cli

from qeval import api
from qeval.engine.engine import LlamaModel
from qeval.errors import QevalError
from qeval.inputs import chat
from qeval.inputs.chat_spans import scored_conversation
from qeval.inputs.conversation_windows import chat_template_for
from qeval.storage.store import StoreReader

N_CTX = 256
TEMPLATE = chat.shipped_dir() / "gemma3-chat-template.jinja"
# one of each kind: a tool call with its result, a thinking trace, a multi-turn chat, other languages; two of them
# longer than N_CTX, so they are cut into windows
IDS = ("tool_calls-001", "thinking-007", "chat-002", "multilingual-de-001")


def shipped_rows(ids) -> list[dict]:
    rows = [json.loads(line) for f in sorted(chat.shipped_dir().glob("*.jsonl"))
            for line in f.read_text().splitlines()]
    return [r for r in rows if r["id"] in ids]


def written(rows: list[dict], path):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    return written(shipped_rows(IDS), tmp_path_factory.mktemp("conv") / "few.jsonl")


@pytest.fixture(scope="module")
def captured(models, conversations, tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    # the reference in the default form; the candidate coded, as a live one saved with --save is (the same codes)
    for label, form in (("Q8_0", "auto"), ("Q4_K_M", "logits")):
        api.capture_store(str(models[label]), label, runs_dir=runs, corpus=str(conversations), n_ctx=N_CTX,
                          scoring="assistant", chat_template=str(TEMPLATE), reference_form=form)
    return runs


def test_windows_hold_one_conversation_each_padded_and_cut(models, conversations, captured):
    with LlamaModel(models["Q8_0"]) as model:
        template = chat_template_for(model, str(TEMPLATE))
        rendered = [scored_conversation(c, template, model, {}) for c in chat.load_conversations(str(conversations))]
        eos = model.eos
    with StoreReader(captured / "Q8_0.qeval") as store:
        h, windows = store.header, store.tokens
        w = 0
        for tokens, labels in rendered:
            starts = range(0, len(tokens), N_CTX)
            assert any(len(tokens) > N_CTX for tokens, _ in rendered)
            for start in starts:
                piece, piece_labels = tokens[start:start + N_CTX], labels[start:start + N_CTX].copy()
                piece_labels[0] = 0  # a window's first token is never scored
                if not piece_labels.any():
                    continue
                np.testing.assert_array_equal(windows[w, :len(piece)], piece)
                assert (windows[w, len(piece):] == eos).all()  # padding: EOS after the conversation's end
                positions = h.positions_of(w)
                # exactly the labelled tokens are scored, and no padding
                np.testing.assert_array_equal(positions + 1, np.flatnonzero(piece_labels))
                assert positions.max() + 1 < len(piece)
                w += 1
        assert w == h.n_chunks
        assert h.corpus["kind"] == "conversations" and h.corpus["chat_template"]["sha256"] == template.sha256


def test_a_live_candidate_gives_the_numbers_of_its_capture(models, captured):
    stored, _ = api.kld_report("Q8_0", "Q4_K_M", runs_dir=captured, threads=1)
    live, _ = api.kld_report("Q8_0", str(models["Q4_K_M"]), runs_dir=captured, threads=1, save="live")  # coded
    for key in ("scored_tokens", "kld", "same_top1", "by_segment", "by_category"):
        assert json.dumps(live[key], sort_keys=True) == json.dumps(stored[key], sort_keys=True), key
    assert {g["segment"] for g in stored["by_segment"]} == {"thinking", "answer", "tool_call"}
    assert 0 < stored["kld"]["mean"] < 0.1


def test_plain_rendering_scores_the_same_texts(models, conversations, tmp_path):
    api.capture_store(str(models["Q8_0"]), "plain", runs_dir=tmp_path, corpus=str(conversations), n_ctx=N_CTX,
                      scoring="assistant", chat_template="plain")
    with StoreReader(tmp_path / "plain.qeval") as store, LlamaModel(models["Q8_0"]) as model:
        assert store.header.corpus["chat_template"]["source"] == "plain"
        text = b"".join(model.token_bytes(int(t)) for t in store.tokens.ravel() if t != model.eos)
    assert b"<start_of_turn>" not in text and b"get_weather" in text


def test_refusals(models, conversations, tmp_path):
    gguf = str(models["Q8_0"])
    assert_cli_error(run_cli("capture", gguf, "-l", "x", "--corpus", conversations, "--score", "assistant",
                             "--runs-dir", tmp_path), "carries no chat template", "--chat-template")
    assert_cli_error(run_cli("capture", gguf, "-l", "x", "--score", "assistant", "--runs-dir", tmp_path),
                     "--score assistant scores conversations")
    assert_cli_error(run_cli("capture", gguf, "-l", "x", "--corpus", conversations, "--runs-dir", tmp_path),
                     "holds conversations", "--score assistant")
    assert_cli_error(run_cli("capture", gguf, "-l", "x", "--chat-template", TEMPLATE, "--runs-dir", tmp_path),
                     "--chat-template")
    assert_cli_error(run_cli("capture", gguf, "-l", "x", "--corpus", conversations, "--score", "assistant",
                             "--chat-template", TEMPLATE, "--chat-template-kwargs", "[1]", "--runs-dir", tmp_path),
                     "must be a JSON object")
    assert_cli_error(run_cli("capture", gguf, "-l", "x", "--corpus", conversations, "--score", "assistant",
                             "--chat-template", TEMPLATE, "-c", "7", "--runs-dir", tmp_path), "even number")
    assert not list(tmp_path.glob("*.qeval"))


def test_a_matrix_over_conversations_with_its_control(models, conversations, captured):
    """The matrix reuses the conversation reference and runs a candidate and the control live over its windows."""
    result, text = api.matrix_report(f"Q8_0={models['Q8_0']}", [f"Q2_K={models['Q2_K']}"], ["f16"], n_ctx=N_CTX,
                                     corpus=str(conversations), runs_dir=captured, scoring="assistant",
                                     chat_template=str(TEMPLATE), control=True, progress=False)
    by_label = {r["candidate"]["label"]: r for r in result["results"]}
    assert set(by_label) == {"Q2_K", "control"}
    assert by_label["control"]["kld"]["mean"] < 0.01 * by_label["Q2_K"]["kld"]["mean"]
    assert {g["segment"] for g in by_label["Q2_K"]["by_segment"]} == {"thinking", "answer", "tool_call"}
    assert {g["category"] for g in by_label["Q2_K"]["by_category"]} == {"tool_calls", "thinking", "chat",
                                                                        "multilingual"}


def test_tool_calls_at_depth_are_scored_by_segment_and_depth_and_depth_0_is_todays(models, tmp_path):
    """--score assistant@0,448 at -c 1024: by segment and depth, and the figures at depth 0 are those of the same
    conversation captured without depths, exactly. A shipped tool call, its answer cut to its first sentence (564
    tokens, 25 of them scored: a capture codes each scored token's 262K logits)."""
    (row,) = shipped_rows(("tool_calls-001",))
    row["messages"][-1]["content"] = row["messages"][-1]["content"].split(". ")[0] + "."
    corpus = str(written([row], tmp_path / "tool.jsonl"))
    common = {"runs_dir": tmp_path, "corpus": corpus, "n_ctx": 1024, "scoring": "assistant",
              "chat_template": str(TEMPLATE)}
    for label, depths in (("today", None), ("deep", "0,448")):
        api.capture_store(str(models["Q8_0"]), label, conversation_depths=depths, **common)
    today, _ = api.kld_report("today", str(models["Q4_K_M"]), runs_dir=tmp_path)
    deep, text = api.kld_report("deep", str(models["Q4_K_M"]), runs_dir=tmp_path)
    groups = {g["segment"]: g for g in deep["by_segment"]}
    assert set(groups) == {"answer@0", "answer@448", "tool_call@0", "tool_call@448"}
    assert "tool_call@448" in text and "answer@448" in text
    for group in today["by_segment"]:
        at_0 = groups[f"{group['segment']}@0"]
        for key in set(group) - {"segment", "kld_share"}:  # the share is of another total
            assert json.dumps(at_0[key], sort_keys=True) == json.dumps(group[key], sort_keys=True), key
        assert groups[f"{group['segment']}@448"]["n"] == group["n"]  # the same tokens, after the history
    assert deep["scored_tokens"] == 2 * today["scored_tokens"]
    with pytest.raises(QevalError, match="token windows differ"):  # a store at other depths is never reused
        api.capture_store(str(models["Q8_0"]), "deep", conversation_depths="0,128", **common)
