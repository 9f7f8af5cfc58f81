"""Assistant tokens of a rendered conversation and their segments (qeval.inputs.chat_spans).

The rule under test (the module docstring): a token is labelled with a segment when its bytes lie wholly inside
a span of that segment, the span being what the assistant wrote (reasoning, answer text, a tool call from the
start of its function's name to the end of its arguments). A token that straddles a span's border is not scored.
Gemma-3's tokenizer straddles in one place on the shipped suite, under both renderings: the last one or two
characters of a tool call's arguments (`}` or `"}`) merge with the `}` that closes the call's JSON object
({"name": ..., "arguments": ...}) into one token (`}}` or `"}}`), so that token is not scored.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from qeval.engine.engine import LlamaModel
from qeval.errors import QevalError
from qeval.inputs import chat, chat_spans
from qeval.inputs.chat_spans import ANSWER, NOT_SCORED, SEGMENTS, THINKING, TOOL_CALL

REPO = Path(__file__).resolve().parents[1]
CHECKOUT_SUITE = REPO / "corpora" / "conversations"
GEMMA = CHECKOUT_SUITE / "gemma3-tokenizer_config.json"  # the template, with "<bos>" and "<eos>"
NO_THINKING = {"enable_thinking": False}


@pytest.fixture(autouse=True)
def this_checkouts_suite(monkeypatch):
    """The plain-text template of this checkout: an editable install made from another checkout maps the package
    data qeval.corpora to that checkout's files."""
    monkeypatch.setattr(chat_spans, "shipped_dir", lambda: CHECKOUT_SUITE)


@pytest.fixture(scope="module")
def suite() -> list[chat.Conversation]:
    return chat.load_conversations(str(CHECKOUT_SUITE))


# --------------------------------------------------------------------------------------------------
# helpers: a character tokenizer, and expectations written from the messages alone
# --------------------------------------------------------------------------------------------------
class FakeModel:
    """What scored_conversation needs of a model, splitting text at `pattern` (default: every character)."""

    def __init__(self, pattern: str = r"(?s)."):
        self.pattern = re.compile(pattern)
        self.vocab: dict[str, int] = {}

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> np.ndarray:
        assert (add_special, parse_special) == (False, True)
        return np.array([self.vocab.setdefault(m, len(self.vocab)) for m in self.pattern.findall(text)], np.int32)

    def token_bytes(self, token: int) -> bytes:
        return next(text for text, t in self.vocab.items() if t == token).encode()


def conversation(messages: list[dict]) -> chat.Conversation:
    return chat.parse_conversation({"id": "synthetic", "messages": messages}, "test", "synthetic", "x")


def call(name: str, arguments, call_id: str = "c1") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def expected_pieces(conversation: chat.Conversation, thinking: bool) -> list[tuple[int, str]]:
    """(label, text) of what the assistant wrote, as the shipped templates write it: a tool call from its name to
    the end of its arguments, `{"name": "NAME", "arguments": ARGS}` minus the head and the closing brace."""
    out = []
    for m in conversation.messages:
        if m["role"] != "assistant":
            continue
        if thinking and m.get("reasoning_content"):
            out.append((THINKING, m["reasoning_content"].strip()))
        if m.get("content"):
            out.append((ANSWER, m["content"].strip()))
        out += [(TOOL_CALL, f'{c["function"]["name"]}", "arguments": {c["function"]["arguments"]}')
                for c in m.get("tool_calls") or ()]
    return out


def spanned(text: str, spans) -> list[tuple[int, str]]:
    return [(label, text[start:stop]) for start, stop, label in spans]


# --------------------------------------------------------------------------------------------------
# the real Gemma-3 tokenizer on the shipped suite
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma(models):
    with LlamaModel(models["Q8_0"]) as model:
        yield model


RENDERINGS = [("gemma", {}), ("gemma", NO_THINKING), ("plain", {}), ("plain", NO_THINKING)]


def template_named(name: str) -> chat.ChatTemplate:
    return chat.load_template(GEMMA) if name == "gemma" else chat_spans.plain_template("<bos>", "<eos>")


@pytest.mark.parametrize("name, kwargs", RENDERINGS, ids=["gemma", "gemma-no-thinking", "plain", "plain-no-thinking"])
def test_every_labelled_token_of_the_suite_spells_the_assistants_text(suite, gemma, name, kwargs):
    """Per assistant piece (written here from the messages): the tokens over it that are inside it carry its
    segment, those straddling its border none, and its labelled tokens spell it exactly, but for a tool call's
    last `}` or `"}`, which Gemma-3 merges with the call's closing brace. No other token is labelled (no user,
    system or tool text is scored), and without thinking nothing is labelled thinking."""
    template, thinking = template_named(name), kwargs != NO_THINKING
    straddled = []
    for conv in suite:
        text = template.render(conv, **kwargs)
        tokens, labels = chat_spans.scored_conversation(conv, template, gemma, kwargs)
        assert tokens.dtype == np.int32 and labels.dtype == np.uint8
        assert np.array_equal(tokens, gemma.tokenize(text, add_special=False, parse_special=True))
        pieces = [gemma.token_bytes(int(t)) for t in tokens]
        data = b"".join(pieces)
        assert data == text.encode()
        stops = np.cumsum([len(p) for p in pieces])
        starts = stops - [len(p) for p in pieces]
        claimed = np.zeros(len(tokens), bool)
        spelled_all, at = [], 0
        for label, piece in expected_pieces(conv, thinking):
            start = text.index(piece, at)
            at = start + len(piece)
            lo, hi = len(text[:start].encode()), len(text[:at].encode())
            over = (starts < hi) & (stops > lo)
            inside = over & (starts >= lo) & (stops <= hi)
            assert (labels[inside] == label).all() and (labels[over & ~inside] == NOT_SCORED).all(), conv.id
            claimed |= inside
            spelled = b"".join(p for p, keep in zip(pieces, inside) if keep)
            spelled_all.append(spelled)
            if spelled != data[lo:hi]:
                (crossing,) = np.flatnonzero(over & ~inside)
                straddled.append((conv.id, label, data[lo:hi], spelled, pieces[crossing], starts[crossing] - lo))
        assert not labels[~claimed].any(), conv.id
        assert b"".join(p for p, k in zip(pieces, labels) if k) == b"".join(spelled_all)
        assert thinking or THINKING not in labels
    # the one place Gemma-3 merges across a border: the end of every tool call, with the call's closing brace
    calls = [c for conv in suite for m in conv.messages for c in m.get("tool_calls") or ()]
    assert len(straddled) == len(calls) == 19
    for conv_id, label, piece, spelled, token, token_offset in straddled:
        tail = piece[len(spelled):]  # what of the call its labelled tokens leave out
        assert label == TOOL_CALL and piece.startswith(spelled) and tail in (b"}", b'"}'), conv_id
        assert token == tail + b"}" and token_offset == len(spelled), conv_id  # tail + closing brace, one token


def test_the_chat_and_the_plain_rendering_score_the_same_tokens(suite, gemma):
    """What makes the two comparable token by token: on the shipped suite, Gemma-3 splits the assistant's text
    alike whether it is rendered as a chat or as plain text."""
    chat_template, plain = template_named("gemma"), template_named("plain")
    for conv in suite:
        tokens, labels = chat_spans.scored_conversation(conv, chat_template, gemma)
        plain_tokens, plain_labels = chat_spans.scored_conversation(conv, plain, gemma)
        assert np.array_equal(tokens[labels > 0], plain_tokens[plain_labels > 0]), conv.id
        assert np.array_equal(labels[labels > 0], plain_labels[plain_labels > 0]), conv.id


def test_token_bytes_spell_special_tokens_and_pieces_longer_than_its_first_buffer(gemma):
    text = "<start_of_turn>model\n পাকিস্তানের<end_of_turn>"  # " পাকিস্তানের" (Bengali) is one 34-byte token
    pieces = [gemma.token_bytes(int(t)) for t in gemma.tokenize(text, add_special=False, parse_special=True)]
    assert b"".join(pieces) == text.encode() and pieces[0] == b"<start_of_turn>" and max(map(len, pieces)) > 32


def test_the_suite_is_found_whole_and_only_reasoning_is_left_out_without_thinking(suite):
    gemma_template = chat.load_template(GEMMA)
    for conv in suite:
        for template in (gemma_template, chat_spans.plain_template("<bos>", "<eos>")):
            for thinking in (True, False):
                text = template.render(conv, enable_thinking=thinking)
                missing = [p.piece for p in chat_spans.locate_pieces(text, conv) if not p.found]
                assert [p.label for p in missing] == ([] if thinking else [THINKING] * len(missing))
                assert spanned(text, chat_spans.assistant_spans(text, conv)) == expected_pieces(conv, thinking)


# --------------------------------------------------------------------------------------------------
# other templates: no model
# --------------------------------------------------------------------------------------------------
QWEN_LIKE = """
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages if m.role == 'user' -%}{%- set ns.last_user = messages.index(m) -%}{%- endfor -%}
{%- for m in messages -%}
  {{- '<|im_start|>' ~ m.role ~ '\\n' -}}
  {%- if m.role == 'assistant' -%}
    {%- if loop.index0 > ns.last_user and m.reasoning_content -%}
      {{- '<think>\\n' ~ (m.reasoning_content | trim) ~ '\\n</think>\\n\\n' -}}
    {%- endif -%}
    {{- (m.content or '') | trim -}}
    {%- for tc in m.tool_calls or [] -%}
      {{- '\\n<tool_call>\\n{"name": "' ~ tc.function.name ~ '", "arguments": ' -}}
      {{- tc.function.arguments | tojson(separators=(',', ':')) -}}
      {{- '}\\n</tool_call>' -}}
    {%- endfor -%}
  {%- else -%}
    {{- m.content | trim -}}
  {%- endif -%}
  {{- '<|im_end|>\\n' -}}
{%- endfor -%}
"""


def qwen_like() -> chat.ChatTemplate:
    """Qwen3's habits: reasoning before the last user message is dropped, object arguments are re-serialised
    (here compactly)."""
    return chat.ChatTemplate(text=QWEN_LIKE, source="qwen-like")


def tool_conversation(arguments, follow_up: bool = False) -> chat.Conversation:
    """A tool call and its answer, each with reasoning; `follow_up` adds a user turn and an answer after them."""
    messages = [
        {"role": "system", "content": "You can call get_weather."},
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": None, "reasoning_content": "  Call the tool.  ",
         "tool_calls": [call("get_weather", arguments)]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"city": "Zürich", "temp": 4}'},
        {"role": "assistant", "content": " Cold: 4 °C. ", "reasoning_content": "It is 4 degrees."},
    ]
    if follow_up:
        messages += [{"role": "user", "content": "And tomorrow?"},
                     {"role": "assistant", "content": "Ask me tomorrow.", "reasoning_content": "No forecast."}]
    return conversation(messages)


def test_dropped_reasoning_and_compact_arguments_still_give_the_assistants_spans():
    template = qwen_like()
    conv = tool_conversation({"city": "Zürich", "days": 2}, follow_up=True)
    text = template.render(conv)
    # the habits this test is about
    assert "Call the tool." not in text and "It is 4 degrees." not in text and "No forecast." in text
    assert '{"city":"Zürich","days":2}' in text
    expected = [(TOOL_CALL, 'get_weather", "arguments": {"city":"Zürich","days":2}'), (ANSWER, "Cold: 4 °C."),
                (THINKING, "No forecast."), (ANSWER, "Ask me tomorrow.")]
    assert spanned(text, chat_spans.assistant_spans(text, conv)) == expected
    tokens, labels = chat_spans.scored_conversation(conv, template, FakeModel(), {})
    # one token per character: the labelled characters are exactly the spans', in order
    assert [(k, c) for c, k in zip(text, labels) if k] == [(k, c) for k, piece in expected for c in piece]


DEFAULT_SEPARATORS = QWEN_LIKE.replace("tojson(separators=(',', ':'))", "tojson")


@pytest.mark.parametrize("template, arguments, written", [
    (None, '{"city":  "Zürich"}', '{"city":  "Zürich"}'),  # Gemma's: a string as given, spacing and all
    (DEFAULT_SEPARATORS, {"city": "Zürich"}, '{"city": "Zürich"}'),  # an object, by tojson's default separators
    (QWEN_LIKE, {"city": "Zürich"}, '{"city":"Zürich"}'),  # an object, compact
])
def test_tool_arguments_are_found_as_given_or_as_tojson_writes_them(template, arguments, written):
    template = chat.ChatTemplate(text=template, source="test") if template else chat.load_template(GEMMA)
    conv = tool_conversation(arguments)
    text = template.render(conv)
    assert written in text
    calls = [piece for piece in spanned(text, chat_spans.assistant_spans(text, conv)) if piece[0] == TOOL_CALL]
    assert calls == [(TOOL_CALL, f'get_weather", "arguments": {written}')]


def test_no_user_system_or_tool_text_is_labelled_even_where_it_repeats_the_assistants():
    """The user quotes the answer, the system names the tool, the tool result repeats the arguments: only the
    assistant's own occurrences are labelled."""
    conv = conversation([
        {"role": "system", "content": 'Use lookup with {"q": "ant"} when asked.'},
        {"role": "user", "content": "Say exactly: Ants are insects."},
        {"role": "assistant", "content": "Ants are insects.", "tool_calls": [call("lookup", '{"q": "ant"}')]},
        {"role": "tool", "tool_call_id": "c1", "content": 'lookup {"q": "ant"}: Ants are insects.'},
        {"role": "user", "content": [{"type": "text", "text": "Again: "},
                                     {"type": "text", "text": "Ants are insects."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Ants are insects."}]},
    ])
    for template in (chat.load_template(GEMMA), chat_spans.plain_template("<bos>", "<eos>")):
        text = template.render(conv)
        tokens, labels = chat_spans.scored_conversation(conv, template, FakeModel(), {})
        labelled = [i for i, k in enumerate(labels) if k]
        others = [p for p in chat_spans.locate_pieces(text, conv) if p.piece.label == NOT_SCORED]
        assert all(p.found for p in others) and len(others) == 5
        assert not any(p.start <= i < p.stop for p in others for i in labelled), template.source
        assert spanned(text, chat_spans.assistant_spans(text, conv)) == [
            (ANSWER, "Ants are insects."), (TOOL_CALL, 'lookup", "arguments": {"q": "ant"}'),
            (ANSWER, "Ants are insects.")]


def test_a_tool_call_whose_arguments_are_not_written_as_searched_is_skipped_not_stretched_to_a_later_copy():
    """The qwen-like template writes string arguments as a JSON string ("{\\"q\\": ...}"), which is not searched
    for; the tool result repeats them as they are. The call is not found: its span must not reach into the
    result."""
    conv = conversation([
        {"role": "user", "content": "Look up ants."},
        {"role": "assistant", "content": None, "tool_calls": [call("lookup", '{"q": "ant"}')]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"q": "ant"} found: Ants are insects.'},
        {"role": "user", "content": "Now bees, with lookup."},
        {"role": "assistant", "content": None, "tool_calls": [call("lookup", {"q": "bee"}, "c2")]},
        {"role": "tool", "tool_call_id": "c2", "content": "Bees make honey."},
        {"role": "assistant", "content": "Ants are insects; bees make honey."},
    ])
    text = qwen_like().render(conv)
    assert '"{\\"q\\": \\"ant\\"}"' in text
    missing = [p.piece for p in chat_spans.locate_pieces(text, conv) if not p.found]
    assert [(p.message, p.label) for p in missing] == [(1, TOOL_CALL)]
    assert spanned(text, chat_spans.assistant_spans(text, conv)) == [
        (TOOL_CALL, 'lookup", "arguments": {"q":"bee"}'), (ANSWER, "Ants are insects; bees make honey.")]


def test_a_function_name_mentioned_before_its_call_is_passed_over_for_the_one_its_arguments_follow():
    """Reasoning a template changed (here: its lines joined) is not found, so the cursor stays before it; the
    function's name in it is not the call's, as the arguments do not follow it."""
    conv = conversation([
        {"role": "user", "content": "Look up ants."},
        {"role": "assistant", "content": None, "reasoning_content": "The lookup tool knows insects.\nCall it.",
         "tool_calls": [call("lookup", '{"q": "ant"}')]},
    ])
    text = ('Look up ants.\nThe lookup tool knows insects. Call it. Then give the answer in one short sentence.\n'
            '{"name": "lookup", "arguments": {"q": "ant"}}')
    assert [p.found for p in chat_spans.locate_pieces(text, conv)] == [True, False, True]
    assert spanned(text, chat_spans.assistant_spans(text, conv)) == [(TOOL_CALL, 'lookup", "arguments": {"q": "ant"}')]


def test_a_token_straddling_a_span_border_is_not_scored():
    text, spans = "ab}}cd", [(0, 3, TOOL_CALL), (4, 6, ANSWER)]  # "ab}" and "cd"; "}}" is one token
    model = FakeModel(r"ab|}}|c|d")
    tokens = model.tokenize(text, False, True)
    labels = chat_spans.label_tokens(text, tokens, model.token_bytes, spans)
    assert labels.tolist() == [TOOL_CALL, NOT_SCORED, ANSWER, ANSWER]


def test_a_token_that_splits_a_character_is_placed_by_its_bytes():
    """Byte-fallback tokens hold part of a character: they are inside a span when all their bytes are."""
    text = "x€y"  # € is three bytes: one token of two bytes and one of one
    raw = text.encode()
    parts = [raw[:1], raw[1:3], raw[3:4], raw[4:]]
    labels = chat_spans.label_tokens(text, np.arange(4), lambda t: parts[t], [(1, 3, ANSWER)])
    assert labels.tolist() == [NOT_SCORED, ANSWER, ANSWER, ANSWER]
    labels = chat_spans.label_tokens(text, np.arange(4), lambda t: parts[t], [(0, 2, ANSWER)])
    assert labels.tolist() == [ANSWER, ANSWER, ANSWER, NOT_SCORED]


def test_tokens_that_do_not_spell_the_text_are_refused_naming_the_conversation():
    class Normalising(FakeModel):
        def token_bytes(self, token: int) -> bytes:
            return super().token_bytes(token).replace("ü".encode(), b"u")

    conv = tool_conversation('{"city": "Zürich"}')
    with pytest.raises(QevalError, match="tokenizer changed conversation 'synthetic'"):
        chat_spans.scored_conversation(conv, chat.load_template(GEMMA), Normalising(), {})


def test_the_plain_rendering_is_the_pieces_a_blank_line_apart():
    conv = tool_conversation('{"city": "Zürich"}')
    template = chat_spans.plain_template("<bos>", "<eos>")
    assert template.bos_token == "<bos>" and template.source == chat_spans.PLAIN
    assert template.render(conv) == "<bos>" + "\n\n".join([
        "You can call get_weather.", "Weather in Zürich?", "Call the tool.",
        '{"name": "get_weather", "arguments": {"city": "Zürich"}}', '{"city": "Zürich", "temp": 4}',
        "It is 4 degrees.", "Cold: 4 °C."])
    assert template.render(conv, enable_thinking=False) == "<bos>" + "\n\n".join([
        "You can call get_weather.", "Weather in Zürich?",
        '{"name": "get_weather", "arguments": {"city": "Zürich"}}', '{"city": "Zürich", "temp": 4}', "Cold: 4 °C."])


def test_empty_pieces_are_skipped():
    conv = conversation([{"role": "user", "content": "  "},
                         {"role": "assistant", "content": "", "reasoning_content": ""},
                         {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
    text = chat.load_template(GEMMA).render(conv)
    assert [p.piece.label for p in chat_spans.locate_pieces(text, conv)] == [NOT_SCORED, ANSWER]
    assert spanned(text, chat_spans.assistant_spans(text, conv)) == [(ANSWER, "Hello")]


def test_labels_are_the_segments_index_plus_one():
    assert [SEGMENTS[k - 1] for k in (THINKING, ANSWER, TOOL_CALL)] == ["thinking", "answer", "tool_call"]
    assert NOT_SCORED == 0


def test_arguments_that_are_not_json_text_are_searched_as_given():
    assert chat_spans.argument_forms(" not json ") == ("not json",)
    assert chat_spans.argument_forms('{"a": [1, 2]}') == ('{"a": [1, 2]}', '{"a":[1,2]}')
    assert chat_spans.argument_forms({"é": 1}) == (json.dumps({"é": 1}, ensure_ascii=False), '{"é":1}')
