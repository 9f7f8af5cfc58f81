"""Which tokens of a rendered conversation the assistant wrote, and in which segment (`--score assistant`).

A conversation is rendered with a chat template and tokenized whole; only the assistant's tokens are scored,
each labelled with its segment: 0 = not scored, k = SEGMENTS.index(segment) + 1.

The rule, in two steps:

1. Characters (assistant_spans). The rendered text is searched for every message's text pieces, in message
   order, each from a cursor just after the last piece found: system, user and tool content (so the cursor
   moves past them; never labelled), and of an assistant message its `reasoning_content` (thinking), its
   content (answer: the string, or each part's text) and each tool call, from the start of the function's
   name to the end of its arguments (tool_call). This needs nothing of the template's markup, only that a
   template writes the pieces in message order and, at most, trims them: a piece is searched stripped, and
   a tool call's arguments as given, else re-serialised as `tojson` writes them (default or compact
   separators), at most MARKUP_CHARS after the name. A piece the template leaves out (reasoning with
   enable_thinking false, or an earlier turn's reasoning, which Qwen3's template drops) is not found, and
   skipped; so is an empty one.
2. Tokens (label_tokens). A token is labelled k when its bytes (as llama.cpp detokenizes it) lie wholly inside
   a span of label k. A token that straddles a span's border, holding template text or another piece as well
   (Gemma-3 merges "}" + "}" into one token at the end of a tool call), is not scored: its prediction is not
   the assistant's alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from qeval.engine.engine import LlamaModel
from qeval.errors import QevalError
from qeval.inputs.chat import ChatTemplate, Conversation, shipped_dir

SEGMENTS = ("thinking", "answer", "tool_call")
THINKING, ANSWER, TOOL_CALL = range(1, len(SEGMENTS) + 1)  # a token's label: its segment's index + 1
NOT_SCORED = 0
PLAIN = "plain"  # the plain-text rendering's name, beside a chat template's
PLAIN_TEMPLATE_FILE = "plain-text.jinja"
# The most markup a template writes between a tool call's name and its arguments: `", "arguments": ` (Gemma's
# here, Qwen3's, Hermes'), `[ARGS]` (Mistral), "\n```json\n" (DeepSeek-V3), `<|channel|>commentary json<|message|>`
# (gpt-oss). The bound keeps arguments the template wrote in a form not searched for (a JSON string of them) from
# being found in a later message, such as a tool result repeating them: the span would swallow that message.
MARKUP_CHARS = 64

Span = tuple[int, int, int]  # (start, stop, label): characters [start, stop) of the rendered text


@dataclass(frozen=True)
class Piece:
    """A message's text as a template may render it: `parts` found one after another, each within MARKUP_CHARS
    of the one before (a tool call: its name, then its arguments), each in any of its `forms` (arguments as given
    or re-serialised); it spans from the start of its first part to the end of its last."""

    message: int  # index in conversation.messages
    label: int  # NOT_SCORED for system, user and tool text
    parts: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Located:
    piece: Piece
    start: int | None  # None: the rendered text does not hold it
    stop: int | None

    @property
    def found(self) -> bool:
        return self.start is not None


# --------------------------------------------------------------------------------------------------
# pieces of a conversation
# --------------------------------------------------------------------------------------------------
def content_texts(content: object) -> list[str]:
    """A message's content: a string, or each part's text (none for null)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    return [part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)]


def argument_forms(arguments: object) -> tuple[str, ...]:
    """A tool call's arguments as templates write them: the JSON text as given (the OpenAI shape), or the parsed
    value through tojson, with its default separators and with compact ones."""
    given = (arguments.strip(),) if isinstance(arguments, str) else ()
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return given  # not JSON: a template can only have written it as it is
    dumped = tuple(json.dumps(value, ensure_ascii=False, separators=separators) for separators in (None, (",", ":")))
    return tuple(dict.fromkeys(given + dumped))  # each form once, the given text first


def message_pieces(index: int, message: dict) -> Iterator[Piece]:
    """The pieces of one message, in the order templates write them."""
    assistant = message["role"] == "assistant"
    if assistant and isinstance(message.get("reasoning_content"), str):
        yield Piece(index, THINKING, ((message["reasoning_content"].strip(),),))
    for text in content_texts(message.get("content")):
        yield Piece(index, ANSWER if assistant else NOT_SCORED, ((text.strip(),),))
    for call in (message.get("tool_calls") or ()) if assistant else ():
        function = call.get("function", call)
        yield Piece(index, TOOL_CALL, ((function["name"].strip(),), argument_forms(function.get("arguments"))))


def conversation_pieces(conversation: Conversation) -> list[Piece]:
    """Every non-empty piece of every message, in message order."""
    pieces = (p for i, m in enumerate(conversation.messages) for p in message_pieces(i, m))
    return [p for p in pieces if all(any(forms) for forms in p.parts)]


# --------------------------------------------------------------------------------------------------
# characters
# --------------------------------------------------------------------------------------------------
def find_first(text: str, forms: tuple[str, ...], at: int, within: int | None = None) -> tuple[int, int] | None:
    """(start, stop) of the earliest of `forms` in text from `at` (at one place, the longest), starting at most
    `within` characters after `at` when given; None if none is."""
    found = [(start, -len(form)) for form in forms
             if form and (start := text.find(form, at, None if within is None else at + within + len(form))) >= 0]
    if not found:
        return None
    start, minus_length = min(found)
    return start, start - minus_length


def locate_piece(text: str, piece: Piece, at: int) -> Located:
    """The piece at the first place from `at` where its first part is followed by the others, each at most
    MARKUP_CHARS after the one before; not found when there is none."""
    first, *rest = piece.parts
    while (where := find_first(text, first, at)) is not None:
        stop = locate_parts(text, rest, where[1])
        if stop is not None:
            return Located(piece, where[0], stop)
        at = where[0] + 1  # e.g. a function's name mentioned before the call: try its next occurrence
    return Located(piece, None, None)


def locate_parts(text: str, parts: list[tuple[str, ...]], at: int) -> int | None:
    """Where the parts end when each follows the one before within MARKUP_CHARS, else None."""
    for forms in parts:
        where = find_first(text, forms, at, within=MARKUP_CHARS)
        if where is None:
            return None
        at = where[1]
    return at


def locate_pieces(text: str, conversation: Conversation) -> list[Located]:
    """Every piece of the conversation in the rendered text, each searched after the last one found."""
    out, at = [], 0
    for piece in conversation_pieces(conversation):
        located = locate_piece(text, piece, at)
        out.append(located)
        at = located.stop if located.found else at
    return out


def assistant_spans(text: str, conversation: Conversation) -> list[Span]:
    """(start, stop, label) of each assistant piece the rendered text holds, in order; see the module's rule."""
    return [(p.start, p.stop, p.piece.label) for p in locate_pieces(text, conversation)
            if p.found and p.piece.label != NOT_SCORED]


# --------------------------------------------------------------------------------------------------
# tokens
# --------------------------------------------------------------------------------------------------
def token_byte_bounds(text: str, tokens: np.ndarray, piece_bytes: Callable[[int], bytes],
                      what: str = "the text") -> tuple[np.ndarray, np.ndarray]:
    """(starts, stops): each token's bytes in text.encode(); QevalError when the tokens do not spell the text
    (the tokenizer changed it: normalised, dropped or added something), as a token then has no place."""
    pieces = [piece_bytes(int(t)) for t in tokens]
    spelled, data = b"".join(pieces), text.encode("utf-8")
    if spelled != data:
        differ = next((i for i, (a, b) in enumerate(zip(spelled, data)) if a != b), min(len(spelled), len(data)))
        raise QevalError(f"the tokenizer changed {what}: its tokens spell it differently from byte {differ} on "
                         f"({data[differ:differ + 40]!r} became {spelled[differ:differ + 40]!r})")
    lengths = np.array([len(p) for p in pieces], dtype=np.int64)
    stops = np.cumsum(lengths)
    return stops - lengths, stops


def label_tokens(text: str, tokens: np.ndarray, piece_bytes: Callable[[int], bytes], spans: list[Span],
                 what: str = "the text") -> np.ndarray:
    """uint8 label per token: k for a non-empty token whose bytes lie wholly inside a span of label k, else 0
    (a token that straddles a span's border is not scored). piece_bytes(token) is its detokenized bytes."""
    starts, stops = token_byte_bounds(text, tokens, piece_bytes, what)
    labels = np.zeros(len(tokens), dtype=np.uint8)
    for start, stop, label in spans:
        lo, hi = byte_offset(text, start), byte_offset(text, stop)
        # tokens are in text order, so those inside [lo, hi) are one run: first start >= lo, last stop <= hi
        first, last = np.searchsorted(starts, lo, "left"), np.searchsorted(stops, hi, "right")
        run = slice(first, max(first, last))
        labels[run] = np.where(stops[run] > starts[run], label, NOT_SCORED)
    return labels


def byte_offset(text: str, char: int) -> int:
    return len(text[:char].encode("utf-8"))


def rendered_tokens(conversation: Conversation, template: ChatTemplate, model: LlamaModel,
                    template_kwargs: dict | None = None) -> tuple[str, np.ndarray]:
    """(text, tokens) of the whole conversation as the template renders it. Special tokens in the rendering are
    parsed, and none is added: the template writes the BOS."""
    text = template.render(conversation, add_generation_prompt=False, **(template_kwargs or {}))
    return text, model.tokenize(text, add_special=False, parse_special=True)


def scored_conversation(conversation: Conversation, template: ChatTemplate, model: LlamaModel,
                        template_kwargs: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(int32 tokens, uint8 labels) of the whole conversation as the template renders it (rendered_tokens)."""
    text, tokens = rendered_tokens(conversation, template, model, template_kwargs)
    spans = assistant_spans(text, conversation)
    labels = label_tokens(text, tokens, model.token_bytes, spans, what=f"conversation {conversation.id!r}")
    return tokens.astype(np.int32), labels


# --------------------------------------------------------------------------------------------------
# the plain-text rendering
# --------------------------------------------------------------------------------------------------
def plain_template_path() -> Path:
    return shipped_dir() / PLAIN_TEMPLATE_FILE


def plain_template(bos_token: str, eos_token: str) -> ChatTemplate:
    """The conversation as plain text (BOS, then the pieces a blank line apart, no role markers or special
    tokens): what its damage is compared with, to see whether rendering as a chat changes it."""
    path = plain_template_path()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise QevalError(f"cannot read the plain-text template {path}: {exc.strerror} (a broken install?)") \
            from None
    return ChatTemplate(text=text, source=PLAIN, bos_token=bos_token, eos_token=eos_token)
