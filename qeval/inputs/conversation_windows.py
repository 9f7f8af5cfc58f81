"""Conversation corpora as scored windows (`--score assistant`): what a conversation capture decodes.

Each conversation is rendered with a chat template (the model's own, `--chat-template FILE`, or `plain`: the
same texts without any turn markup), tokenized with its special tokens parsed, and its tokens labelled by the
segment the assistant wrote them in (qeval.inputs.chat_spans). A conversation is a document: a window never
holds two. One shorter than n_ctx is one window, padded after its end with EOS tokens that are never scored
(attention is causal: nothing after a token can move its logits, and the engine does not even decode them);
a longer one is cut into windows of n_ctx tokens, each starting afresh. A window in which the assistant wrote
nothing is left out. Windows keep the corpus order; `--chunks N` takes the first N.

At depth (`--score assistant@0,4096,...`), each conversation is placed after a history of exactly D tokens, one
window per conversation and depth (in corpus order, its depths together): an earlier exchange inserted before its
first turn (after its system message, if any) — a user turn holding a passage of the shipped novel
(HISTORY_CORPUS) and the assistant's reply HISTORY_REPLY — rendered by the same template, so the window is the
valid chat a user would have after that exchange, and the conversation's own tokens are unchanged, shifted by D.
The history is never scored; each scored token is labelled `segment@D` (tool_call@4096), so every by-segment
figure splits by depth. Every conversation must fit whole after the deepest history: none is cut.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qeval.errors import QevalError
from qeval.identity import digest
from qeval.inputs.chat import (
    SHIPPED,
    ChatTemplate,
    Conversation,
    load_conversations,
    load_template,
    special_token_texts,
    template_of_model,
)
from qeval.inputs.chat_spans import PLAIN, SEGMENTS, plain_template, rendered_tokens, scored_conversation
from qeval.inputs.corpus import DEFAULT_CORPUS, check_ctx, load_corpus
from qeval.storage.scoring import WindowLabels

HISTORY_CORPUS = DEFAULT_CORPUS  # the text of the history before a conversation at depth: Northanger Abbey
HISTORY_REPLY = "Noted."  # the assistant's reply that closes the history (not scored)
MAX_DEPTHS = 255 // len(SEGMENTS)  # a window's labels are one byte: segment x depth
HISTORY_STARTS = 8  # where in the novel a history's passage may start (History.placed)

@dataclass(frozen=True)
class ConversationWindows:
    windows: np.ndarray  # int32 [n, n_ctx]
    labels: WindowLabels
    identity: dict  # the corpus block of the store's header


def is_conversation_corpus(spec: str | None) -> bool:
    """The shipped suite, a .jsonl file, or a folder of them (a folder of *.txt is a text corpus). An hf: dataset
    may hold either: --score assistant reads it as conversations."""
    if spec == SHIPPED:
        return True
    path = Path(spec or "")
    if path.is_file():
        return path.suffix.lower() == ".jsonl"
    return path.is_dir() and any(path.glob("*.jsonl")) and not any(path.glob("*.txt"))


def chat_template_for(model, chat_template: str | None) -> ChatTemplate:
    """The template conversations are rendered with: `plain`, a file (.jinja, tokenizer_config.json, GGUF), or
    the model's own (refused, with one message, when it carries none). A bare .jinja file takes the model's BOS
    and EOS text."""
    bos, eos = special_token_texts(model)
    if chat_template == PLAIN:
        return plain_template(bos, eos)
    if chat_template:
        return load_template(chat_template).with_special_tokens_of(ChatTemplate(text="", source="", bos_token=bos,
                                                                                eos_token=eos))
    return template_of_model(model)


def conversation_windows(spec: str, model, n_ctx: int, max_chunks: int | None, chat_template: str | None,
                         template_kwargs: dict, depths: str | None = None) -> ConversationWindows:
    """The scored windows of the conversation corpus `spec`, rendered for `model` (a qeval.engine.engine
    LlamaModel: tokenizer, template, EOS); `depths` (--score assistant@D1,D2): each conversation after histories of
    those many tokens (the module's docstring), None: at the start of its windows."""
    check_ctx(n_ctx)
    placed = parse_history_depths(depths)
    conversations = load_conversations(spec)
    template = chat_template_for(model, chat_template)
    categories = list(dict.fromkeys(c.category for c in conversations))
    rendered = [scored_conversation(c, template, model, template_kwargs) for c in conversations]
    if placed is None:
        segments, windows_of = SEGMENTS, lambda conversation, tokens, labels: cut(tokens, labels, n_ctx, model.eos)
    else:
        history = History.of(placed, template, model, template_kwargs, n_ctx)
        history.check_fit(conversations, rendered)
        segments, windows_of = history.segments(), history.windows
    rows, labels, category_of = [], [], []
    n_tokens = sum(len(tokens) for tokens, _ in rendered)
    for conversation, (tokens, token_labels) in zip(conversations, rendered):
        for window, window_labels in windows_of(conversation, tokens, token_labels):
            rows.append(window)
            labels.append(window_labels)
            category_of.append(categories.index(conversation.category))
    if not rows:
        raise QevalError(f"no conversation of {spec} has an assistant token the template {template.source} "
                         "writes: nothing to score")
    available = len(rows)
    if max_chunks is not None:
        if max_chunks < 1:
            raise QevalError("--chunks must be at least 1")
        if max_chunks > len(rows):
            raise QevalError(f"{spec} gives {len(rows)} conversation windows of up to {n_ctx} tokens; --chunks "
                             f"{max_chunks} asks for more")
        rows, labels, category_of = rows[:max_chunks], labels[:max_chunks], category_of[:max_chunks]
    windows = np.stack(rows).astype(np.int32)
    window_labels = WindowLabels.from_arrays(np.stack(labels), segments, categories, category_of)
    used = sorted({categories[c] for c in category_of}, key=categories.index)
    identity = {"name": spec if spec in (SHIPPED,) or spec.startswith("hf:") else Path(spec).stem, "source": spec,
                "kind": "conversations",
                "conversations": len(conversations), "sha256": conversations_sha256(conversations),
                "categories": used, "chat_template": {"source": template.source, "sha256": template.sha256,
                                                      "kwargs": template_kwargs},
                "n_tokens": n_tokens, "chunks_available": available}
    if placed is not None:
        identity["history"] = {"depths": list(placed), "text": HISTORY_CORPUS, "reply": HISTORY_REPLY}
    return ConversationWindows(windows, window_labels, identity)


def cut(tokens: np.ndarray, labels: np.ndarray, n_ctx: int, pad: int):
    """(window, labels) of one conversation: n_ctx tokens each, the last padded with `pad` (labelled 0); a
    window without a labelled token after its first is left out."""
    for start in range(0, len(tokens), n_ctx):
        window = np.full(n_ctx, pad, dtype=np.int32)
        window_labels = np.zeros(n_ctx, dtype=np.uint8)
        piece = tokens[start:start + n_ctx]
        window[:len(piece)] = piece
        window_labels[:len(piece)] = labels[start:start + n_ctx]
        window_labels[0] = 0  # token 0 of a window is never scored
        if window_labels.any():
            yield window, window_labels


def conversations_sha256(conversations: list[Conversation]) -> str:
    return digest([{"id": c.id, "category": c.category, "messages": c.messages, "tools": c.tools}
                   for c in conversations])


# --------------------------------------------------------------------------------------------------
# conversations at depth
# --------------------------------------------------------------------------------------------------
def parse_history_depths(text: str | None) -> tuple[int, ...] | None:
    """--score assistant@D1,D2: distinct depths in tokens, ascending; None without the option."""
    if text is None:
        return None
    try:
        depths = tuple(sorted({int(d) for d in text.split(",")}))
    except ValueError:
        raise QevalError(f"--score assistant@{text}: expected history lengths in tokens, comma-separated "
                         "(e.g. 0,4096,16384)") from None
    if depths[0] < 0:
        raise QevalError(f"--score assistant@{text}: a depth is a history of 0 or more tokens, not {depths[0]}")
    if len(depths) > MAX_DEPTHS:
        raise QevalError(f"--score assistant@ takes at most {MAX_DEPTHS} depths, not {len(depths)}")
    return depths


def with_history(conversation: Conversation, passage: str) -> Conversation:
    """The conversation after an earlier exchange: a user turn holding `passage`, answered HISTORY_REPLY, before its
    first turn but after its system message (which every template puts first, with the tools)."""
    messages = conversation.messages
    at = 1 if messages and messages[0]["role"] == "system" else 0
    earlier = [{"role": "user", "content": passage}, {"role": "assistant", "content": HISTORY_REPLY}]
    return dataclasses.replace(conversation, messages=[*messages[:at], *earlier, *messages[at:]])


def insertion_point(tokens: np.ndarray, longer: np.ndarray) -> int | None:
    """s where longer == tokens[:s] + (tokens inserted) + tokens[s:], None when `longer` is no such insertion."""
    extra = len(longer) - len(tokens)
    differ = np.flatnonzero(tokens != longer[extra:])
    split = int(differ[-1]) + 1 if len(differ) else 0
    return split if np.array_equal(tokens[:split], longer[:split]) else None


@dataclass(frozen=True, kw_only=True)
class History:
    """The history conversations are placed after: passages of HISTORY_CORPUS, as many tokens long as needed."""

    depths: tuple[int, ...]
    template: ChatTemplate
    model: object  # tokenize, token_bytes
    template_kwargs: dict
    n_ctx: int
    text: bytes  # the novel's text, as its tokens spell it
    ends: np.ndarray  # the byte offset after each of its tokens

    @classmethod
    def of(cls, depths, template: ChatTemplate, model, template_kwargs: dict, n_ctx: int) -> History:
        tokens = model.tokenize(load_corpus(HISTORY_CORPUS).text, add_special=False, parse_special=False)
        pieces = [model.token_bytes(int(t)) for t in tokens]
        return cls(depths=depths, template=template, model=model, template_kwargs=template_kwargs, n_ctx=n_ctx,
                   text=b"".join(pieces), ends=np.cumsum([len(p) for p in pieces]))

    def segments(self) -> tuple[str, ...]:
        """segment@depth for every segment and depth, segment-major: tool_call@0 beside tool_call@4096."""
        return tuple(f"{segment}@{depth}" for segment in SEGMENTS for depth in self.depths)

    def check_fit(self, conversations: list[Conversation], rendered) -> None:
        """Refused, naming the limit, unless every conversation fits n_ctx after the deepest history."""
        longest = max(range(len(rendered)), key=lambda i: len(rendered[i][0]))
        n, deepest = len(rendered[longest][0]), self.depths[-1]
        if n + deepest > self.n_ctx:
            room = (f"the deepest history that fits it is {self.n_ctx - n} tokens" if n <= self.n_ctx
                    else "it does not fit even at depth 0")
            raise QevalError(f"--score assistant@{deepest}: conversation {conversations[longest].id!r} holds {n} "
                             f"tokens, so after a history of {deepest} it needs {n + deepest}, more than -c "
                             f"{self.n_ctx}: {room} (raise -c to at least {n + deepest}; a conversation at depth is "
                             "never cut)")

    def passage(self, start: int, n_tokens: int) -> str:
        """About n_tokens tokens of the novel from its token `start` on (read again from its beginning when it is
        shorter), white space at its ends trimmed as templates trim it."""
        return self._upto(start + n_tokens)[len(self._upto(start)):].decode("utf-8", errors="ignore").strip()

    def _upto(self, n_tokens: int) -> bytes:
        whole, part = divmod(n_tokens, len(self.ends))
        return self.text * whole + (self.text[:self.ends[part - 1]] if part else b"")

    def placed(self, conversation: Conversation, tokens: np.ndarray, labels: np.ndarray,
               depth: int) -> tuple[np.ndarray, np.ndarray]:
        """The conversation's tokens after a history of exactly `depth` tokens, and its labels, shifted past it.
        The passage's length is found by Newton's steps on its token count (a passage of k tokens renders to about
        k tokens plus its turns' markup). A passage that would end in white space is trimmed, one token shorter, so
        that some lengths are skipped: then it starts a token later, which moves its end."""
        if depth == 0:
            return tokens, labels
        nearest = 0
        for start in range(HISTORY_STARTS):
            k, tried = depth, set()
            while k not in tried:
                tried.add(k)
                _, longer = rendered_tokens(with_history(conversation, self.passage(start, k)), self.template,
                                            self.model, self.template_kwargs)
                shift = len(longer) - len(tokens)
                if shift == depth:
                    return self._spliced(conversation, tokens, labels, longer, depth)
                nearest = min(nearest or shift, shift, key=lambda n: abs(n - depth))
                k = max(0, k + depth - shift)
        raise QevalError(f"conversation {conversation.id!r}: no history of exactly {depth} tokens (the nearest held "
                         f"{nearest}; the history's own turns take some tokens, so a depth must be 0 or more than them)")

    def _spliced(self, conversation: Conversation, tokens: np.ndarray, labels: np.ndarray, longer: np.ndarray,
                 depth: int) -> tuple[np.ndarray, np.ndarray]:
        split = insertion_point(tokens, longer)
        if split is None:
            raise QevalError(f"the chat template of {self.template.source} renders conversation {conversation.id!r} "
                             "otherwise after a history: its own tokens change, so it cannot be scored at depth")
        return longer.astype(np.int32), np.insert(labels, split, np.zeros(depth, np.uint8))

    def windows(self, conversation: Conversation, tokens: np.ndarray, labels: np.ndarray):
        """(window, labels) of the conversation at every depth, each label naming its segment at that depth."""
        for index, depth in enumerate(self.depths):
            placed, placed_labels = self.placed(conversation, tokens, labels, depth)
            at_depth = np.where(placed_labels > 0, (placed_labels.astype(np.int64) - 1) * len(self.depths) + index + 1,
                                0).astype(np.uint8)
            yield from cut(placed, at_depth, self.n_ctx, self.model.eos)
