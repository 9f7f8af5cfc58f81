"""`qeval template`: does a GGUF's chat template write conversations as the model's original template does?

The reference (a GGUF, a .jinja file or the original model's tokenizer_config.json) and each candidate render
the same sample conversations (the shipped suite by default: multi-turn chat, thinking, tool calls, code,
math, other languages), each with thinking on and off, whole and as the prompt before its last assistant turn
(add_generation_prompt). Equal templates pass at once; others pass when every rendering is equal. Renderings
are compared as token ids under the first GGUF's vocabulary (special tokens parsed, as llama.cpp tokenizes a
rendered chat), or as text when no GGUF is given; the first difference is located and shown. One command
answers "is this quant's template broken?" for every file of a release.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from qeval.engine.engine import LlamaModel
from qeval.engine.modelinfo import is_model_file
from qeval.errors import QevalError
from qeval.inputs.chat import ChatTemplate, Conversation, load_conversations, load_template, special_token_texts
from qeval.present import templates_text

VARIANTS = ({"enable_thinking": True}, {"enable_thinking": False})
CONTEXT_CHARS = 60  # of each rendering shown around a first difference


@dataclass(frozen=True)
class Sample:
    """One rendering asked of every template: a conversation, its keyword arguments, whole or as a prompt."""

    conversation: Conversation
    kwargs: dict
    prompt: bool  # the messages before the last assistant turn, with add_generation_prompt

    @property
    def name(self) -> str:
        args = ", ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.kwargs.items())
        return f"{self.conversation.id} ({'prompt' if self.prompt else 'whole'}{', ' + args if args else ''})"

    def render(self, template: ChatTemplate) -> str:
        """The template's text for this sample; a template that fails here renders as its error message."""
        try:
            if self.prompt:
                return template.render(self.conversation, add_generation_prompt=True,
                                       upto=self.conversation.last_assistant, **self.kwargs)
            return template.render(self.conversation, **self.kwargs)
        except QevalError as exc:
            return f"<error: {exc}>"


def samples(conversations: list[Conversation], kwargs: dict) -> list[Sample]:
    out = []
    for conversation in conversations:
        for variant in VARIANTS:
            merged = {**variant, **kwargs}
            out.append(Sample(conversation, merged, prompt=False))
            if conversation.last_assistant:
                out.append(Sample(conversation, merged, prompt=True))
    return out


def check_templates(reference: str, candidates: list[str], corpus: str = "conversations", kwargs: dict | None = None,
                    vocab: str | None = None) -> dict:
    """Each candidate's template against the reference's over the sample renderings (see the module)."""
    if not candidates:
        raise QevalError("give a reference template and at least one to check against it: qeval template A B")
    asked = samples(load_conversations(corpus), kwargs or {})
    vocab = vocab or next((s for s in (reference, *candidates) if is_model_file(s)), None)
    with contextlib.ExitStack() as stack:
        tokenizer = stack.enter_context(LlamaModel(vocab)) if vocab else None
        ref_template = load_template(reference)
        if tokenizer is not None:
            bos, eos = special_token_texts(tokenizer)
            ref_template = ref_template.with_special_tokens_of(
                ChatTemplate(text="", source=vocab, bos_token=bos, eos_token=eos))
        ref_renderings = [s.render(ref_template) for s in asked]
        checked = [_check_one(spec, ref_template, ref_renderings, asked, tokenizer) for spec in candidates]
    return {"reference": {"source": reference, "template_sha256": ref_template.sha256},
            "corpus": corpus, "samples": len(asked), "compared_as": "tokens" if vocab else "text", "vocab": vocab,
            "candidates": checked, "passed": all(c["passed"] for c in checked)}


def _check_one(spec: str, ref_template: ChatTemplate, ref_renderings: list[str], asked: list[Sample],
               tokenizer: LlamaModel | None) -> dict:
    template = load_template(spec).with_special_tokens_of(ref_template)
    out = {"source": spec, "template_sha256": template.sha256, "same_text": template.text == ref_template.text,
           "differing": 0, "first_difference": None}
    if not out["same_text"]:
        for sample, ref_text in zip(asked, ref_renderings):
            text = sample.render(template)
            if text == ref_text:
                continue
            out["differing"] += 1
            if out["first_difference"] is None:
                out["first_difference"] = first_difference(sample, ref_text, text, tokenizer)
    out["passed"] = out["differing"] == 0
    return out


def first_difference(sample: Sample, ref_text: str, text: str, tokenizer: LlamaModel | None) -> dict:
    """Where two renderings part: the character, the token (under `tokenizer`), and both texts around it."""
    at = next((i for i, (a, b) in enumerate(zip(ref_text, text)) if a != b), min(len(ref_text), len(text)))
    lo = max(at - CONTEXT_CHARS, 0)
    out = {"sample": sample.name, "conversation": sample.conversation.id, "char": at,
           "reference": ref_text[lo:at + CONTEXT_CHARS], "candidate": text[lo:at + CONTEXT_CHARS]}
    if tokenizer is not None:
        a, b = (tokenizer.tokenize(t, add_special=False, parse_special=True) for t in (ref_text, text))
        n = min(len(a), len(b))
        unequal = np.flatnonzero(a[:n] != b[:n])
        out.update(token=int(unequal[0]) if len(unequal) else n, reference_tokens=len(a), candidate_tokens=len(b))
    return out


def template_report(reference: str, candidates: list[str], corpus: str = "conversations", kwargs: dict | None = None,
                    vocab: str | None = None) -> tuple[dict, str, bool]:
    result = check_templates(reference, candidates, corpus, kwargs, vocab)
    return result, templates_text.template_check_text(result), result["passed"]
