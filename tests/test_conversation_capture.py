"""Conversation captures on the real Gemma-3-270M (--score assistant): windows, padding, scored tokens, live
candidates, and the refusals a user meets."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import assert_cli_error, run_cli

from qeval import api
from qeval.engine.engine import LlamaModel
from qeval.inputs import chat
from qeval.inputs.chat_spans import scored_conversation
from qeval.inputs.conversation_windows import chat_template_for
from qeval.storage.store import StoreReader

N_CTX = 256
TEMPLATE = chat.shipped_dir() / "gemma3-chat-template.jinja"
# one of each kind: a tool call with its result, a thinking trace, a multi-turn chat, other languages; two of them
# longer than N_CTX, so they are cut into windows
IDS = ("tool_calls-001", "thinking-007", "chat-002", "multilingual-de-001")


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    rows = [json.loads(line) for f in sorted(chat.shipped_dir().glob("*.jsonl"))
            for line in f.read_text().splitlines()]
    path = tmp_path_factory.mktemp("conv") / "few.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows if r["id"] in IDS))
    return path


@pytest.fixture(scope="module")
def captured(models, conversations, tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    for label in ("Q8_0", "Q4_K_M"):
        api.capture_store(str(models[label]), label, runs_dir=runs, corpus=str(conversations), n_ctx=N_CTX,
                          scoring="assistant", chat_template=str(TEMPLATE))
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
