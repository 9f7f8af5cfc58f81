"""A comparison's summary as one value: what `qeval kld --json` prints and a saved result file holds.

    summary = ComparisonSummary.from_json(json.loads(path.read_text()))   # also a file of an older qeval
    summary.candidate.label, summary.metrics["kld_mean"].value, summary.by_depth[-1].kld["mean"]
    summary.to_json()                                                       # the same JSON, key for key

Its JSON, in this order: "reference" and "candidate" (Side: who each store is), "chunks", then the figures of
the scored tokens (Figures: "scored_tokens", llama-perplexity's statistics blocks, the "metrics" block of
qeval.compare.metric_registry, the "samplers" block of qeval.compare.sampler), "by_depth", "by_confidence", and for
conversations "by_segment" and "by_category" (TokenGroup: the same figures per band of logit positions, per bucket of
the reference's top-1 probability, per segment, per category, each with its share of the KLD), "request" (qeval.identity.ComparisonRequest as recorded), "qeval_version", "per_token_file" (a saved
result's npz), "depth" and "selection" (a comparison cut to one band, segment or category) and "labels" (the
segment and category names the per-token codes index). A field a summary lacks (a file saved before it existed, a
comparison cut to fewer chunks, a text corpus) is left out of its JSON again.
"""

from __future__ import annotations

from dataclasses import dataclass

from qeval import __version__
from qeval.compare import sampler
from qeval.compare.metric_registry import MetricValue, known
from qeval.errors import QevalError
from qeval.identity import ComparisonRequest, comparison_request
from qeval.identity import form as form_of

# Side fields, in the order describe() writes them
_SIDE_FIELDS = ("label", "path", "source", "model", "kv", "corpus", "n_vocab", "n_ctx", "tokens_sha256", "chunks",
                "complete", "form")
LIVE_FORM = {"name": "live", "note": "llama.cpp's float32 logits, never stored"}  # a live candidate read uncoded


def kv_text(kv: dict | None, same_once: bool = False) -> str:
    """A KV cache's types as "type_k/type_v" ("?" for one not recorded); same_once: one type when V has none of
    its own or the same (a baseline file's "kv": "q8_0"). Then what else makes it another computation: a quantized
    cache's rotation (rotation_text) and " gen" when decoded a token per call (qeval.engine.engine.GENERATE)."""
    kv = kv or {}
    k, v = kv.get("type_k", "?"), kv.get("type_v", "?")
    text = k if same_once and kv.get("type_v") in (None, k) else f"{k}/{v}"
    return text + rotation_text(kv) + (" gen" if kv.get("decode") == "generate" else "")


_UNQUANTIZED = ("f32", "f16", "bf16", "?")


def rotation_text(kv: dict) -> str:
    """" rot" (K and V rotated), " rot K", " rot V", " norot", or " rot?" for a quantized cache recorded before
    qeval recorded the rotation; "" for an unquantized cache, which llama.cpp never rotates."""
    types = {c: kv.get(f"type_{c}", "?") for c in "kv"}
    if all(t in _UNQUANTIZED for t in types.values()):
        return ""
    rotation = kv.get("rotation")
    if not isinstance(rotation, dict):
        return " rot?"
    rotated = [c.upper() for c in "kv" if rotation.get(c)]
    return " norot" if not rotated else " rot" if len(rotated) == 2 else f" rot {rotated[0]}"


@dataclass
class Side:
    """A store as a comparison describes it: the facts a reader needs to trust the comparison."""

    label: str | None
    path: str | None = None
    source: str | None = None
    model: dict | None = None  # qeval.engine.modelinfo facts (file_name, quant, size_gib, fingerprint ...)
    kv: dict | None = None  # the KV cache settings (type_k, type_v, flash_attn)
    corpus: dict | None = None
    n_vocab: int | None = None
    n_ctx: int | None = None
    tokens_sha256: str | None = None
    chunks: int | None = None
    complete: bool | None = None
    form: dict | None = None  # its stored form (qeval.identity.form: the code, and "error" when it records it)
    absent: frozenset = frozenset()  # fields its JSON did not hold (a hand-made or older summary)

    @classmethod
    def of_source(cls, source) -> "Side":
        """A store, or anything read like one."""
        h = source.header
        live = getattr(source, "live", False) and not getattr(source, "coded", True)
        return cls(h.label, str(source.path), h.source, h.model, h.kv, h.corpus, h.n_vocab, h.n_ctx, h.tokens_sha256,
                   len(source.chunk_indices), bool(source.complete), LIVE_FORM if live else form_of(h))

    @property
    def records_error(self) -> bool | None:
        """Whether its form records its error at capture (a live candidate's is computed as it runs); None: a summary
        from before forms were recorded."""
        return None if self.form is None else self.form == LIVE_FORM or "error" in self.form

    @classmethod
    def from_json(cls, d: dict) -> "Side":
        return cls(**{k: d.get(k) for k in _SIDE_FIELDS}, absent=frozenset(k for k in _SIDE_FIELDS if k not in d))

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in _SIDE_FIELDS if k not in self.absent}

    @property
    def facts(self) -> dict:
        """The model's facts ({} when none are recorded)."""
        return self.model or {}

    @property
    def kv_types(self) -> dict:
        return self.kv or {}

    def kv_text(self, same_once: bool = False) -> str:
        return kv_text(self.kv, same_once)


@dataclass
class Figures:
    """Every figure of a set of scored tokens (qeval.compare.metrics.summarize_tokens)."""

    scored_tokens: int | None
    blocks: dict[str, dict]  # llama-perplexity's statistics blocks (perplexity, kld, delta_p, ...), in order
    metrics: dict[str, MetricValue] | None  # None: saved by a qeval from before the "metrics" block
    samplers: dict[str, dict] | None  # sampler name -> its figures; None: measured without samplers

    _TYPED = ("scored_tokens", "metrics", "samplers")

    @classmethod
    def from_json(cls, d: dict, skip: tuple[str, ...] = ()) -> "Figures":
        """The figures of `d`; its keys in `skip` belong to whatever holds them."""
        blocks = {k: v for k, v in d.items() if k not in cls._TYPED and k not in skip}
        held = d.get("metrics")
        metrics = {k: MetricValue(value=v["value"], se=v.get("se"), bound=v.get("bound")) for k, v in held.items()} \
            if isinstance(held, dict) else None
        return cls(d.get("scored_tokens"), blocks, metrics, d.get("samplers"))

    def to_json(self) -> dict:
        out = {} if self.scored_tokens is None else {"scored_tokens": self.scored_tokens}
        out.update(self.blocks)
        if self.metrics is not None:
            out["metrics"] = {k: {"value": v.value, "se": v.se, **({} if v.bound is None else {"bound": v.bound})}
                              for k, v in self.metrics.items()}
        if self.samplers is not None:
            out["samplers"] = self.samplers
        return out

    @property
    def perplexity(self) -> dict:
        return self.blocks["perplexity"]

    @property
    def kld(self) -> dict:
        return self.blocks["kld"]


@dataclass
class TokenGroup:
    """The figures of one group of scored tokens (qeval.compare.depth): a band of logit positions [lo, hi)
    (key {"lo", "hi"}), a bucket of the reference's top-1 probability [lo, hi) (the same key, in by_confidence), a
    segment ({"segment": name}) or a category ({"category": name})."""

    key: dict
    n: int
    figures: Figures
    se_method: str | None = None
    kld_share: float | None = None  # its share of the whole comparison's KLD; None: saved before qeval wrote it
    grouping: str = "by_depth"

    KEYS = {"by_depth": ("lo", "hi"), "by_confidence": ("lo", "hi"), "by_segment": ("segment",),
            "by_category": ("category",)}

    @classmethod
    def from_json(cls, d: dict, grouping: str = "by_depth") -> "TokenGroup":
        fields = cls.KEYS[grouping]
        return cls({k: d[k] for k in fields}, d["n"],
                   Figures.from_json(d, skip=(*fields, "n", "se_method", "kld_share")), d.get("se_method"),
                   d.get("kld_share"), grouping)

    def to_json(self) -> dict:
        out = {**self.key, "n": self.n, **({} if self.kld_share is None else {"kld_share": self.kld_share}),
               **self.figures.to_json()}
        if self.se_method is not None:
            out["se_method"] = self.se_method
        return out

    @property
    def kld(self) -> dict:
        return self.figures.kld

    @property
    def lo(self) -> int:
        return self.key["lo"]

    @property
    def hi(self) -> int:
        return self.key["hi"]

    @property
    def name(self) -> str:
        """"0-512" for a depth band, "0.9-0.99" for a confidence bucket, else the segment's or category's name."""
        if self.grouping == "by_confidence":
            return f"{self.lo:g}-{self.hi:g}"
        return f"{self.lo}-{self.hi}" if "lo" in self.key else next(iter(self.key.values()))


DepthBand = TokenGroup  # a group by depth


@dataclass
class ComparisonSummary:
    """One candidate measured against one reference: the summary of a comparison, computed or saved."""

    reference: Side
    candidate: Side
    chunks: int | None
    figures: Figures
    by_depth: list[TokenGroup] | None = None  # None: saved before by-depth figures existed
    request: dict | None = None  # ComparisonRequest.to_json() as recorded (an older qeval's may not parse)
    qeval_version: str | None = None
    per_token_file: str | None = None  # a saved result's per-token arrays, beside it
    depth: dict | None = None  # {"lo", "hi"}: cut to the scored tokens of one band
    by_segment: list[TokenGroup] | None = None  # conversations (--score assistant) only
    by_category: list[TokenGroup] | None = None
    selection: dict | None = None  # {"segment": name} and/or {"category": name}: cut to those tokens
    labels: dict | None = None  # conversations: {"segments", "categories"}, the names per-token codes index
    by_confidence: list[TokenGroup] | None = None  # None: saved before qeval kept the reference's top-1 probability

    _OWN = ("reference", "candidate", "chunks", "by_depth", "request", "qeval_version", "per_token_file", "depth",
            "by_segment", "by_category", "selection", "labels", "by_confidence")

    @classmethod
    def from_json(cls, d: dict) -> "ComparisonSummary":
        groups = {k: None if d.get(k) is None else [TokenGroup.from_json(g, k) for g in d[k]] for k in TokenGroup.KEYS}
        return cls(Side.from_json(d["reference"]), Side.from_json(d["candidate"]), d.get("chunks"),
                   Figures.from_json(d, skip=cls._OWN), groups["by_depth"], d.get("request"), d.get("qeval_version"),
                   d.get("per_token_file"), d.get("depth"), groups["by_segment"], groups["by_category"],
                   d.get("selection"), d.get("labels"), groups["by_confidence"])

    def to_json(self) -> dict:
        out = {"reference": self.reference.to_json(), "candidate": self.candidate.to_json()}
        if self.chunks is not None:
            out["chunks"] = self.chunks
        out.update(self.figures.to_json())
        optional = {**{k: None if getattr(self, k) is None else [g.to_json() for g in getattr(self, k)]
                       for k in TokenGroup.KEYS},
                    "request": self.request, "qeval_version": self.qeval_version,
                    "per_token_file": self.per_token_file, "depth": self.depth, "selection": self.selection,
                    "labels": self.labels}
        out.update((k, v) for k, v in optional.items() if v is not None)
        return out

    @property
    def scored_tokens(self) -> int | None:
        return self.figures.scored_tokens

    @property
    def perplexity(self) -> dict:
        return self.figures.perplexity

    @property
    def samplers(self) -> dict[str, dict]:
        """Sampler name -> its figures ({} when measured without samplers)."""
        return self.figures.samplers or {}

    @property
    def deepest(self) -> DepthBand | None:
        """The band of the deepest scored positions."""
        return self.by_depth[-1] if self.by_depth else None

    def comparison_request(self) -> ComparisonRequest | None:
        """The request it answers; None when it records none (an older qeval)."""
        return ComparisonRequest.from_summary({"request": self.request})

    def measured(self) -> dict[str, MetricValue]:
        """The metrics it holds that this qeval knows, by key (a result saved before a metric existed lacks it)."""
        if self.metrics is None:
            raise QevalError(f"the comparison of {self.candidate.label!r} was saved by an older qeval and holds no "
                             "\"metrics\" block: recompute it (qeval kld ... --save-result)")
        return known(self.metrics)

    @property
    def metrics(self) -> dict[str, MetricValue] | None:
        return self.figures.metrics


def summarize(cmp, bands: list[tuple[int, int]] | None = None,
              buckets: list[tuple[float, float]] | None = None) -> ComparisonSummary:
    """The summary of a comparison just computed (qeval.compare.metrics.Comparison), with the request it answers
    (qeval.identity: whether a saved copy may stand for a later request) and this qeval's version.
    bands: of the by-depth figures (default: powers of 4 from 512); buckets: of the by-confidence ones (default:
    qeval.compare.depth.DEFAULT_CONFIDENCE_EDGES)."""
    # an early run's chunks are a sample of the whole order's: its request is over all of them, and says so
    n_chunks = len(cmp.early["order"]) if cmp.early else len(cmp.chunks)
    request = comparison_request(cmp.ref, cmp.cand, n_chunks, sampler.settings_names(sampler.names_in(cmp.per_token)),
                                 cmp.early)
    return of_figures(Side.of_source(cmp.ref), Side.of_source(cmp.cand), cmp.summary(bands, buckets),
                      request=request.to_json(), qeval_version=__version__)


def of_figures(reference: Side, candidate: Side, body: dict, **recorded) -> ComparisonSummary:
    """A summary from Comparison.summary()'s figures (chunks, figures, by_depth) and what else it records."""
    return ComparisonSummary.from_json({"reference": reference.to_json(), "candidate": candidate.to_json(), **body,
                                        **recorded})
