"""What a store holds and what a result measured: the one definition of identity in qeval.

Whatever qeval would reuse from disk (a store to resume or skip, shards to merge, a saved result that
`matrix`, `compare`, `check` or a leaderboard would show) is reused only when its identity equals the
request's; otherwise the caller refuses, naming what differs, or recomputes and says so. Names (labels,
file names, paths) are not identities: a renamed model file is the same model, a model swapped in under
an old label is not.

  producer(header)          how a store's logits were made: the model (its content fingerprint), KV
                            cache types, their rotation and flash attention, the decode mode, n_ctx,
                            the batch sizes (llama.cpp's batch shape can move logits), the stored form
                            (form(): the code and whether it records its error at capture), and
                            llama.cpp's numerics (qeval.engine.numerics: build, environment, layers
                            offloaded). Not threads or decode-ahead: those do not choose what is
                            computed. A store from before numerics were recorded holds NOT_RECORDED:
                            a request, which always knows its numerics, never equals it.
  capture_identity(header)  a store: its producer plus vocab, tokenizer, top-k and its token windows.
  task_store_identity(...)  a task store (qeval.capture.tasks): the task set and the tasks selected, the
                            model (its content fingerprint), its tokenizer and vocab, the task settings
                            and the version of the scoring code.
  needle_row_identity(...)  a row of `qeval needle` (qeval.storage.needle_trials): the reference's run and the
                            candidate's (each its model and what llama.cpp computes with, as a producer,
                            and the batch sizes its prefix is decoded in), the trial design (needles,
                            corpus, depths, seed, jitter, n_ctx) and NEEDLE_SCORES_VERSION.
  ComparisonRequest         a candidate measured against a reference: the reference's producer,
                            vocab, tokenizer and the tokens of the chunks compared; the candidate's
                            producer; the chunk count; METRICS_VERSION; the samplers computed too
                            (their canonical settings, in any order: a preset and its settings string
                            are one sampler). Its key is a hash of all that.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import numpy as np

# The formulas behind a saved result (metrics.py, kernels.py, stats.py, metric_registry.py). Bump it
# whenever a change there moves a number: results of another version are then recomputed or refused,
# never shown. 2: results hold the "metrics" block of qeval.compare.metric_registry.
# 3: per-token "position" is the logit position; summaries hold "by_depth".
# 4: every metric holds its certified bound (docs/error-bound.md); live candidates in float64 (their NLL exact).
# 5: the bound also covers the float64 evaluation of the KLD; a format-6 hidden reference is read uncoded live.
METRICS_VERSION = 5
# A reference read uncoded (a format-6 hidden store) is one version ahead: it is read uncoded against a stored
# candidate too (metrics.row_plane_sums), which moved only its comparisons' figures, so every other result saved at
# METRICS_VERSION stays current. The next change that moves every comparison bumps METRICS_VERSION past it.
UNCODED_REFERENCE_VERSION = METRICS_VERSION + 1

# How identity fields read in messages (anything else reads as its own name).
_NAMES = {"kv": "KV", "tokens_sha256": "token ids sha256", "tokenizer_sha256": "tokenizer",
          "metrics_version": "metrics version", "numerics": "llama.cpp numerics", "rotation": "rotation",
          "system_info": "build (llama_print_system_info)", "env": "environment", "gpu_layers": "layers offloaded"}
NOT_RECORDED = "not recorded"  # an identity field a store or result made by an older qeval cannot say
# Fields older identities lack: such an identity reads NOT_RECORDED. The build's own identity (llama_version, ggml
# version and commit, type table: qeval.engine.build_check) is recorded since issue 43: a store or result made before
# lacks it, so it is not reused (a request always has it), and the message says "not recorded".
RECORDED_SINCE = ("numerics", "rotation", "llama_version", "ggml_version", "ggml_commit", "type_table")


def tokens_sha256(tokens: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(tokens, dtype="<i4").tobytes()).hexdigest()


def digest(value: object) -> str:
    """sha256 of canonical JSON: equal values, equal digests, whatever their key order."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def model_identity(facts: dict, source: str, label: str) -> dict:
    """A model file is its content fingerprint, whatever its name. A store without one (imported from
    llama.cpp, or built by hand) is known only by what its header says: origin, label and facts."""
    if facts.get("fingerprint"):
        return {"fingerprint": facts["fingerprint"]}
    return {"source": source, "label": label, "facts": facts}


def form(header) -> dict:
    """A store's stored form: its code and, for a store that records its error (format version 4), the record's
    bands. A store made before error records holds its code alone, so its identity is what it was; a result made
    against one form is never reused for another."""
    if header.head:  # the hidden form: the form asked for, the head its pieces are replayed through, and whether a
        # live comparison reads them uncoded (format 6: other figures than the coded read of format 5)
        head = {"form": header.head["form"], "fingerprint": header.head["fingerprint"]}
        return {**header.codec, "error": header.error,
                "head": {**head, "read_uncoded": True} if header.replay_record else head}
    return {**header.codec, "error": header.error} if header.error else header.codec


def producer(header) -> dict:
    """How the logits of a store (StoreHeader) were made."""
    n_batch = header.capture.get("n_batch")
    return {"model": model_identity(header.model, header.source, header.label), "kv": header.kv,
            "n_ctx": header.n_ctx, "n_batch": n_batch,
            # stores from before n_ubatch was recorded decoded one physical batch per call
            "n_ubatch": header.capture.get("n_ubatch", n_batch), "codec": form(header), "scoring": header.scoring,
            "numerics": header.capture.get("numerics", NOT_RECORDED)}


def planned_producer(model_facts: dict, planned: dict, n_ctx: int, codec: dict, scoring: str = "half") -> dict:
    """producer() of the store a run of the GGUF model whose facts (qeval.engine.modelinfo.model_facts) are
    `model_facts` would write, `planned` being what its settings make of the KV block, numerics and batch sizes
    (qeval.engine.engine.planned_fields); `codec`: the form it stores (form(), SqrtLogCode.form())."""
    planned = {"model": model_identity(model_facts, "qeval", ""), "kv": planned["kv"], "n_ctx": n_ctx,
               "n_batch": planned["n_batch"], "n_ubatch": planned["n_ubatch"], "codec": codec, "scoring": scoring,
               "numerics": planned["numerics"]}
    return json.loads(json.dumps(planned))  # as a header read back from its file holds it (no tuples)


def capture_identity(header) -> dict:
    """What a capture is, whichever chunk range of it a file holds (shards of one capture share it). The
    per-token labels of a conversation capture (which tokens are scored, their segments) belong to its windows."""
    return {**producer(header), "n_vocab": header.n_vocab, "tokenizer_sha256": header.tokenizer_sha256,
            "top_k": header.top_k, "n_chunks": header.n_chunks, "tokens_sha256": header.tokens_sha256,
            **window_labels_identity(header, header.n_chunks)}


def window_labels_identity(header, n_chunks: int) -> dict:
    """The labels of the first n_chunks windows of a conversation capture, as a digest ({} for text windows, so
    the identities of text captures are what they were before labels existed)."""
    labels = header.window_labels
    return {} if labels is None else {"window_labels_sha256": digest(labels.head(n_chunks).to_json())}


# The formulas of qeval.compare.needle_scores and the trial planting of qeval.inputs.needles: bump it when a change
# there moves a recorded trial's numbers, so that recorded trials are measured again, never mixed with new ones.
NEEDLE_SCORES_VERSION = 1


def needle_row_identity(reference: dict, candidate: dict | None, design: dict) -> dict:
    """A needle row: the candidate run's answers scored against the reference run's over the trials of `design`;
    candidate None: the reference's own row (its accuracy), apart from a candidate run as the reference is, which
    is decoded on its own (a check that decoding is deterministic)."""
    return {"reference": reference, "candidate": candidate, "design": design,
            "needle_scores_version": NEEDLE_SCORES_VERSION}


def task_store_identity(tasks, limit: int | None, model, facts: dict, label: str, settings,
                        scoring_version: int) -> dict:
    """What a task store of `model` (qeval.capture.taskscore.TaskModel, with model facts `facts`) over the task
    set `tasks` (qeval.inputs.taskfiles.TaskSet) is, `limit` of its tasks scored with TaskSettings `settings`.
    A limit that takes every task is no limit: such a store is the store of the whole set."""
    selection = {"limit": limit if limit is not None and limit < len(tasks.items) else None}
    return {"task": tasks.identity(), "selection": selection, "model": model_identity(facts, "qeval", label),
            "tokenizer_sha256": model.tokenizer_fingerprint(), "n_vocab": model.n_vocab,
            "settings": settings.as_json(), "scoring_version": scoring_version,
            # what llama.cpp computed with (qeval.engine.numerics): stores from before lack it and are rescored
            "numerics": {**model.numerics, "kv_rotation": model.kv_rotation}}


_WINDOW_FIELDS = ("n_chunks", "tokens_sha256", "window_labels_sha256")


def holds_windows(header, tokens: np.ndarray, wanted: range, wanted_tokens: np.ndarray, wanted_header) -> bool:
    """Whether a complete store holds the chunks `wanted` of the token windows `wanted_tokens` (labelled as
    `wanted_header`'s): the same windows, though it may hold more of them (a reference of 80 chunks answers
    for 20)."""
    n = len(wanted_tokens)
    return (header.chunk_start <= wanted.start and wanted.stop <= header.chunk_stop and n <= header.n_chunks
            and np.array_equal(tokens[:n], wanted_tokens)
            and window_labels_identity(header, n) == window_labels_identity(wanted_header, n))


def extends(old, old_tokens: np.ndarray, new, new_tokens: np.ndarray) -> bool:
    """Whether the capture `new` is the capture of the complete store `old` over more windows: the same producer,
    vocab and tokenizer, a whole capture (no shard) either, and the old windows (and their labels) the first of the
    new. Such a store grows: its chunks are kept and only the new windows are run (qeval.storage.store)."""
    a, b = capture_identity(old), capture_identity(new)
    n = old.n_chunks
    return (all(a.get(name) == b.get(name) for name in {**a, **b} if name not in _WINDOW_FIELDS)
            and old.chunk_range == range(0, n) and new.chunk_range == range(0, new.n_chunks) and new.n_chunks > n
            and np.array_equal(old_tokens, new_tokens[:n])
            and window_labels_identity(old, n) == window_labels_identity(new, n))


def capture_conflicts(old, old_tokens: np.ndarray, old_complete: bool, new, new_tokens: np.ndarray) -> list[str]:
    """Why the store with header `old` cannot stand for the capture `new` ([] when it can).

    A complete store can when it is of the same kind and holds every requested window; an incomplete
    one only when it is the very same capture (same windows and chunk range), so that resuming it
    finishes exactly what was asked for.
    """
    a, b = capture_identity(old), capture_identity(new)
    out = [_conflict(name, old, new) for name in {**a, **b} if name not in _WINDOW_FIELDS and a.get(name) != b.get(name)]
    if old_complete:
        if not holds_windows(old, old_tokens, new.chunk_range, new_tokens, new):
            out.append(f"token windows differ: it holds chunks {_span(old)} of {old.n_chunks} "
                       f"(tokens {short(old.tokens_sha256)}), chunks {_span(new)} of {new.n_chunks} "
                       f"(tokens {short(new.tokens_sha256)}) were asked for")
        return out
    out += [_conflict(name, old, new) for name in _WINDOW_FIELDS if a.get(name) != b.get(name)]
    if old.chunk_range != new.chunk_range:
        out.append(f"chunk range differs: stored {_span(old)}, requested {_span(new)}")
    return out


def _span(header) -> str:
    return f"{header.chunk_start}:{header.chunk_stop}"


def _conflict(name: str, old, new) -> str:
    a, b = capture_identity(old).get(name), capture_identity(new).get(name)
    if name != "model" and isinstance(a, dict) and isinstance(b, dict):  # the leaves that differ, stored vs requested
        return "; ".join(changes(a, b, _NAMES.get(name, name))) + " (stored vs requested)"
    return f"{_NAMES.get(name, name)} differs: stored {_shown(name, old)}, requested {_shown(name, new)}"


def _shown(name: str, header) -> str:
    """A field of a store's identity for a message; a model as a person recognises it: its file name
    and the start of its fingerprint."""
    if name == "model" and header.model.get("fingerprint"):
        return f"{header.model.get('file_name') or '?'} ({short(header.model['fingerprint'])})"
    return short(capture_identity(header)[name])


def short(value: object) -> str:
    """A value for a message: long hashes cut to 12 digits, objects to 80 characters."""
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return "{" + "; ".join(value) + "}"  # a set of names (samplers), each whole
    if isinstance(value, str) and len(value) >= 32 and all(c in "0123456789abcdef" for c in value):
        return value[:12] + "…"
    s = json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else str(value)
    return s if len(s) <= 80 else s[:77] + "..."


def changes(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Every leaf where two identity values differ, as 'what: old vs new'."""
    out = []
    for key in dict.fromkeys([*old, *new]):
        a, b = old.get(key), new.get(key)
        name = f"{prefix} {_NAMES.get(key, key)}".strip()
        if isinstance(a, dict) and isinstance(b, dict):
            out += changes(a, b, name)
        elif a != b:  # a field one side lacks was not recorded when it was made (others are left out when empty)
            shown = [NOT_RECORDED if key in RECORDED_SINCE and key not in side else short(v)
                     for v, side in ((a, old), (b, new))]
            out.append(f"{name}: {shown[0]} vs {shown[1]}")
    return out


def metrics_version_of(reference: dict) -> int:
    """The formulas' version a comparison against `reference` (reference_identity) is computed with."""
    head = (reference.get("codec") or {}).get("head") or {}
    return UNCODED_REFERENCE_VERSION if head.get("read_uncoded") else METRICS_VERSION


def reference_identity(source, n_chunks: int) -> dict:
    """The reference side of a comparison over its first n_chunks windows (a store or anything read like one)."""
    h = source.header
    return {**producer(h), "n_vocab": h.n_vocab, "tokenizer_sha256": h.tokenizer_sha256,
            "tokens_sha256": tokens_sha256(source.tokens[:n_chunks]), **window_labels_identity(h, n_chunks)}


@dataclass(frozen=True, kw_only=True)
class ComparisonRequest:
    """One candidate measured against one reference, as one value; `key` is its hash."""

    reference: dict  # reference_identity()
    candidate: dict  # producer() of the candidate (its tokens are the reference's, its vocab too)
    chunks: int  # the first `chunks` chunks of the reference
    metrics_version: int | None = None  # None: this qeval's for the reference (metrics_version_of)
    samplers: tuple[str, ...] = ()  # canonical settings strings (qeval.compare.sampler.settings_names), a set
    # a board decided early: the chunk order, rule and chunks visited (qeval.compare.early.EarlySettings.record);
    # None for a run over every chunk. Not in a pair's checkpoint's identity: a full run extends an early one
    early: dict | None = None

    def __post_init__(self):
        object.__setattr__(self, "samplers", tuple(sorted(set(self.samplers))))
        if self.metrics_version is None:
            object.__setattr__(self, "metrics_version", metrics_version_of(self.reference))

    def identity(self) -> dict:
        """What the key hashes. Without samplers the field is left out, so a request that asks for none is
        the request of a result saved before samplers were part of it; the same for `early`."""
        d = asdict(self)
        d["samplers"] = list(self.samplers)
        for name in ("samplers", "early"):
            if not d[name]:
                del d[name]
        return d

    @property
    def key(self) -> str:
        return digest(self.identity())

    def to_json(self) -> dict:
        return {"key": self.key, **self.identity()}

    @classmethod
    def from_summary(cls, summary: dict) -> "ComparisonRequest | None":
        """The request a comparison summary answers; None when it records none (an older qeval)."""
        d = summary.get("request")
        try:
            return cls(reference=d["reference"], candidate=d["candidate"], chunks=int(d["chunks"]),
                       metrics_version=int(d["metrics_version"]), samplers=tuple(d.get("samplers") or ()),
                       early=d.get("early"))
        except (KeyError, TypeError, ValueError):
            return None

    def changes_from(self, old: "ComparisonRequest") -> list[str]:
        return changes(old.identity(), self.identity())


# What a control may change in the reference's producer: only the batch shapes, which move llama.cpp's logits
# slightly and choose nothing about the model: what they move is the noise floor of every comparison; and the stored
# form ("codec": a live control is never stored, and a reference made before error records is still its reference).
CONTROL_FREE = ("n_batch", "n_ubatch", "codec")
# What the floor row may change besides: the kernel path llama.cpp takes for the same cache (flash attention, one token
# per call or prompt batches). Its KLD is what llama.cpp's own numerics cost, the floor a KV quant's cost stands on.
FLOOR_KV_FREE = ("flash_attn", "decode")


def _candidate_is_reference_but(request: ComparisonRequest | None, kv_free: tuple[str, ...]) -> bool:
    """Whether the candidate's producer is the reference's but for CONTROL_FREE and the KV fields kv_free."""
    if request is None:
        return False
    ref = request.reference
    for key, value in request.candidate.items():
        if key in CONTROL_FREE:
            continue
        if key == "kv" and isinstance(value, dict) and isinstance(ref.get(key), dict):
            value, held = ({k: v for k, v in d.items() if k not in kv_free} for d in (value, ref[key]))
            if value != held:
                return False
        elif ref.get(key) != value:
            return False
    return True


def is_control(request: ComparisonRequest | None) -> bool:
    """Whether a comparison measures the reference against itself recomputed (a control): the candidate's producer
    is the reference's but for CONTROL_FREE. Whatever it is labelled, its KLD is a floor, not a quantization's."""
    return _candidate_is_reference_but(request, ())


def is_floor(request: ComparisonRequest | None) -> bool:
    """Whether a comparison measures the reference model on another of llama.cpp's kernel paths (the numerics floor):
    the candidate's producer is the reference's but for CONTROL_FREE and FLOOR_KV_FREE, and is no control."""
    return _candidate_is_reference_but(request, FLOOR_KV_FREE) and not is_control(request)


def comparison_request(ref, cand, n_chunks: int, samplers=(), early: dict | None = None) -> ComparisonRequest:
    """What comparing `cand` with `ref` over their first n_chunks chunks measures (sources read like stores),
    with the samplers of canonical settings strings `samplers` computed too; `early`: over the sample of them a
    board decided early visited (ComparisonRequest.early)."""
    return ComparisonRequest(reference=reference_identity(ref, n_chunks), candidate=producer(cand.header),
                             chunks=n_chunks, samplers=tuple(samplers), early=early)
