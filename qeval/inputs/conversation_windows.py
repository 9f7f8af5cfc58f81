"""Conversation corpora as scored windows (`--score assistant`): what a conversation capture decodes.

Each conversation is rendered with a chat template (the model's own, `--chat-template FILE`, or `plain`: the
same texts without any turn markup), tokenized with its special tokens parsed, and its tokens labelled by the
segment the assistant wrote them in (qeval.inputs.chat_spans). A conversation is a document: a window never
holds two. One shorter than n_ctx is one window, padded after its end with EOS tokens that are never scored
(attention is causal: nothing after a token can move its logits, and the engine does not even decode them);
a longer one is cut into windows of n_ctx tokens, each starting afresh. A window in which the assistant wrote
nothing is left out. Windows keep the corpus order; `--chunks N` takes the first N.
"""

from __future__ import annotations

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
from qeval.inputs.chat_spans import PLAIN, SEGMENTS, plain_template, scored_conversation
from qeval.inputs.corpus import check_ctx
from qeval.storage.scoring import WindowLabels


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
                         template_kwargs: dict) -> ConversationWindows:
    """The scored windows of the conversation corpus `spec`, rendered for `model` (a qeval.engine.engine
    LlamaModel: tokenizer, template, EOS)."""
    check_ctx(n_ctx)
    conversations = load_conversations(spec)
    template = chat_template_for(model, chat_template)
    categories = list(dict.fromkeys(c.category for c in conversations))
    rows, labels, category_of, n_tokens = [], [], [], 0
    for conversation in conversations:
        tokens, token_labels = scored_conversation(conversation, template, model, template_kwargs)
        n_tokens += len(tokens)
        for window, window_labels in cut(tokens, token_labels, n_ctx, model.eos):
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
    window_labels = WindowLabels.from_arrays(np.stack(labels), SEGMENTS, categories, category_of)
    used = sorted({categories[c] for c in category_of}, key=categories.index)
    identity = {"name": spec if spec in (SHIPPED,) or spec.startswith("hf:") else Path(spec).stem, "source": spec,
                "kind": "conversations",
                "conversations": len(conversations), "sha256": conversations_sha256(conversations),
                "categories": used, "chat_template": {"source": template.source, "sha256": template.sha256,
                                                      "kwargs": template_kwargs},
                "n_tokens": n_tokens, "chunks_available": available}
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
