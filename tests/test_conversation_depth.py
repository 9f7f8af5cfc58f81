"""Conversations at depth (--score assistant@D1,D2): each conversation after a history of exactly D tokens, its own
tokens unchanged and shifted by D, only they scored, labelled segment@D; refusals naming the limit. Fast: a
tokenizer of words and characters with Gemma-3's special tokens, the shipped Gemma-3 template; the slow test with
Gemma-3-270M is in tests/test_conversation_capture.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli

from qeval import api
from qeval.capture.capture import CaptureSpec, corpus_windows
from qeval.errors import QevalError
from qeval.inputs import chat
from qeval.inputs.chat_spans import SEGMENTS, scored_conversation
from qeval.inputs.conversation_windows import (
    HISTORY_REPLY,
    History,
    chat_template_for,
    conversation_windows,
    insertion_point,
    parse_history_depths,
)
from qeval.orchestrate import matrix

TEMPLATE = str(Path(__file__).resolve().parents[1] / "corpora" / "conversations" / "gemma3-tokenizer_config.json")
N_CTX = 1024
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CONVERSATIONS = [
    {"id": "tool", "category": "tool_calls", "tools": [WEATHER], "messages": [
        {"role": "system", "content": "You are a travel helper."},
        {"role": "user", "content": "Do I need rain gear in Utrecht tomorrow?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Utrecht"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"rain_mm": 6.5}'},
        {"role": "assistant", "content": "Yes: 6.5 mm of rain is forecast, so pack it."}]},
    {"id": "chat", "category": "chat", "messages": [
        {"role": "user", "content": "Name a prime above ten."},
        {"role": "assistant", "reasoning_content": "11 is prime.", "content": "Eleven."}]},
]


class WordModel:
    """What conversation windows need of a model: Gemma-3's special tokens, then words, then single characters."""

    def __init__(self):
        self.pieces = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
        self.ids = {p: i for i, p in enumerate(self.pieces)}
        self.bos, self.eos = 0, 1
        self.pattern = re.compile(r"<bos>|<eos>|<start_of_turn>|<end_of_turn>|\w+|(?s:.)")

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> np.ndarray:
        assert not add_special
        for piece in self.pattern.findall(text):
            if piece not in self.ids:
                self.ids[piece] = len(self.pieces)
                self.pieces.append(piece)
        return np.array([self.ids[piece] for piece in self.pattern.findall(text)], np.int32)

    def token_bytes(self, token: int) -> bytes:
        return self.pieces[token].encode()

    def token_text(self, token: int) -> str:
        return self.pieces[token]

    def text(self, tokens) -> str:
        return "".join(self.pieces[t] for t in tokens)


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("depth") / "two.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    return str(path)


@pytest.fixture(scope="module")
def model() -> WordModel:
    return WordModel()


def windows(suite, model, depths, n_ctx=N_CTX):
    return conversation_windows(suite, model, n_ctx, None, TEMPLATE, {}, depths)


def test_depths_are_parsed_sorted_and_checked():
    assert parse_history_depths(None) is None
    assert parse_history_depths("4096, 0,512,512") == (0, 512, 4096)
    for bad, message in (("-5,0", "0 or more tokens, not -5"), ("0,x", "comma-separated"), ("", "comma-separated"),
                         (",".join(map(str, range(86))), "at most 85 depths")):
        with pytest.raises(QevalError, match=message):
            parse_history_depths(bad)


def test_each_conversation_sits_after_a_history_of_exactly_each_depth(suite, model):
    """One window per conversation and depth, in corpus order; the conversation's tokens are today's, shifted by D,
    and exactly its assistant tokens are scored, labelled segment@D."""
    today, deep = windows(suite, model, None), windows(suite, model, "0,37,300")
    depths = (0, 37, 300)
    assert deep.labels.segments == tuple(f"{s}@{d}" for s in SEGMENTS for d in depths)
    assert len(deep.windows) == len(depths) * len(today.windows) == 6
    assert deep.labels.category_of == (0, 0, 0, 1, 1, 1)
    assert deep.identity["history"] == {"depths": list(depths), "text": "austen-northanger-abbey",
                                        "reply": HISTORY_REPLY}
    for c in range(len(today.windows)):
        base, base_labels = today.windows[c], today.labels.labels(c, N_CTX)
        length = int(np.flatnonzero(base != model.eos)[-1]) + 1
        scored = np.flatnonzero(base_labels)
        for i, depth in enumerate(depths):
            w = c * len(depths) + i
            window, labels = deep.windows[w], deep.labels.labels(w, N_CTX)
            assert (window[length + depth:] == model.eos).all()  # padded after the conversation's end
            np.testing.assert_array_equal(np.flatnonzero(labels), scored + depth)  # positions shifted by the depth
            np.testing.assert_array_equal(window[scored + depth], base[scored])
            # the history is inserted where the two first differ (after the system text), the rest is unchanged
            same = int(np.flatnonzero(window[:length] != base[:length])[0]) if depth else 0
            assert same <= scored[0]
            np.testing.assert_array_equal(window[same + depth:length + depth], base[same:length])
            names = [deep.labels.segments[k - 1] for k in labels[scored + depth]]
            assert names == [f"{today.labels.segments[k - 1]}@{depth}" for k in base_labels[scored]]
            np.testing.assert_array_equal(deep.labels.positions(w, N_CTX), today.labels.positions(c, N_CTX) + depth)
        assert np.array_equal(deep.windows[c * len(depths)], base)  # depth 0: today's window


def test_the_history_is_an_earlier_exchange_the_template_renders(suite, model):
    """After the system text and the tools (which the template puts first), a user turn with the novel, the
    assistant's reply, then the conversation's first turn."""
    deep = windows(suite, model, "0,300")
    text = model.text(deep.windows[1])
    assert text.startswith("<bos><start_of_turn>user\nYou are a travel helper.\n\nYou can call the functions")
    head, _, rest = text.partition("NORTHANGER ABBEY")
    assert '"get_weather"' in head and "Jane Austen" in rest
    assert (f"<start_of_turn>model\n{HISTORY_REPLY}<end_of_turn>\n<start_of_turn>user\n"
            "Do I need rain gear in Utrecht tomorrow?<end_of_turn>") in rest
    assert model.text(deep.windows[3]).startswith("<bos><start_of_turn>user\nNORTHANGER ABBEY")  # no system text


def test_every_depth_past_the_history_markup_is_met_exactly(suite, model):
    """A passage that would end in white space is trimmed, a length skipped: it then starts a token later."""
    template = chat_template_for(model, TEMPLATE)
    conversation = chat.load_conversations(suite)[1]
    tokens, labels = scored_conversation(conversation, template, model, {})
    history = History.of((0,), template, model, {}, N_CTX)
    for depth in range(20, 200):
        placed, placed_labels = history.placed(conversation, tokens, labels, depth)
        assert len(placed) == len(tokens) + depth and placed_labels.sum() == labels.sum()


def test_a_depth_that_does_not_fit_or_cannot_be_built_is_refused(suite, model):
    longest = max(int(np.flatnonzero(w != model.eos)[-1]) + 1 for w in windows(suite, model, None).windows)
    with pytest.raises(QevalError, match=rf"conversation 'tool' holds {longest} tokens, so after a history of 900 "
                                         rf"it needs {longest + 900}, more than -c {N_CTX}: the deepest history that "
                                         rf"fits it is {N_CTX - longest} tokens"):
        windows(suite, model, "0,900")
    with pytest.raises(QevalError, match="does not fit even at depth 0"):
        windows(suite, model, "0", n_ctx=longest - 2)
    with pytest.raises(QevalError, match="no history of exactly 3 tokens"):  # its turns alone take more
        windows(suite, model, "3")
    with pytest.raises(QevalError, match="0 or more tokens"):
        windows(suite, model, "-1")
    assert len(windows(suite, model, f"0,{N_CTX - longest}").windows) == 4  # the deepest that fits


def test_depths_are_refused_for_a_text_corpus():
    spec = CaptureSpec(model="m.gguf", out="x.qeval", label="x", corpus="austen-northanger-abbey",
                       conversation_depths="0,512")
    with pytest.raises(QevalError, match=r"conversation depths \(--score assistant@D\) render conversations"):
        corpus_windows(spec, engine=None)


def test_only_an_insertion_has_an_insertion_point():
    tokens = np.array([1, 2, 3, 4])
    assert insertion_point(tokens, np.array([1, 2, 9, 9, 3, 4])) == 2
    assert insertion_point(tokens, np.array([9, 1, 2, 3, 4])) == 0
    assert insertion_point(tokens, np.array([1, 2, 9, 3, 5])) is None


def test_depth_0_alone_gives_todays_windows_labelled_at_0(suite, model):
    alone, today = windows(suite, model, "0"), windows(suite, model, None)
    np.testing.assert_array_equal(alone.windows, today.windows)
    assert alone.labels.runs == today.labels.runs and alone.labels.segments == tuple(f"{s}@0" for s in SEGMENTS)


def test_the_option_reaches_capture_and_matrix(monkeypatch):
    """--score assistant@D1,D2 gives the rule and the depths: capture and matrix pass both on; plain --score gives no
    depths."""
    seen = {}

    def record(name):
        def called(*args, **kwargs):
            seen[name] = kwargs["scoring"], kwargs["conversation_depths"]
            return {}, ""
        return called

    monkeypatch.setattr(api, "capture_store", record("capture"))
    monkeypatch.setattr(api, "matrix_report", record("matrix"))
    for score, expected in (("assistant@0,4096", ("assistant", "0,4096")), ("assistant", ("assistant", None)),
                            ("every:16", ("every:16", None))):
        common = ("--corpus", "c.jsonl", "--score", score)
        assert run_cli("capture", "m.gguf", "-l", "x", *common).returncode == 0
        assert run_cli("matrix", "--ref", "m.gguf", "-m", "n.gguf", *common).returncode == 0
        assert seen == {"capture": expected, "matrix": expected}
    request = matrix.MatrixRequest(ref_label="R", ref_path="r.gguf", pairs=(("A", "a.gguf", "f16"),),
                                   directory=Path("runs"), corpus="c.jsonl", scoring="assistant",
                                   conversation_depths="0,4096")
    assert matrix.plan_matrix(request).reference.conversation_depths == "0,4096"  # the reference's capture
