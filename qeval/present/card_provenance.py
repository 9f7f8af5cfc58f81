"""Where a model card's numbers come from (`qeval card`): what the saved results and the reference's store record,
and nothing else.

    provenance = of_board(board)          # a dict: the card's JSON sidecar holds it as is
    lines(provenance)                     # (name, text) pairs: the card's provenance list

The results record the reference (model file, quant, fingerprint, KV settings), its corpus (name, source, sha256),
n_ctx, chunks, the scoring rule, the batch sizes (qeval.identity's request) and the qeval version that computed
them. The reference store's header adds its capture block (llama-cpp-python version, n_gpu_layers, when it was
captured, the CPU model and llama.cpp's own report of its build: instruction sets, GPU backend), read when that
store is still where the result says, or beside the results directory. qeval records no GPU model and no llama.cpp
commit (the llama-cpp-python version pins one): the card says so instead of guessing; a store captured before these
were recorded shows them as not recorded.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from qeval import __version__
from qeval.compare import sampler
from qeval.compare.metric_registry import METRICS
from qeval.compare.summary import Side
from qeval.errors import QevalError
from qeval.identity import changes
from qeval.present import results
from qeval.storage.scoring import Scoring
from qeval.storage.store import StoreReader

NOT_RECORDED = "not recorded"


def check_same_corpus(loaded: list[results.Result]) -> None:
    """Refuse results whose references read different corpora. leaderboard.build already refuses other references,
    tokens, n_ctx, scoring and chunk counts; equal token ids from two differently named or hashed texts would pass
    it, and a card states one corpus."""
    first = loaded[0]
    for other in loaded[1:]:
        diffs = changes(first.summary.reference.corpus or {}, other.summary.reference.corpus or {}, "corpus")
        if diffs:
            raise QevalError(f"{first.path} and {other.path} were measured on different corpora ({'; '.join(diffs)}); "
                             "a card needs one corpus: make one card per corpus")


def of_board(board) -> dict:
    """The provenance of a board's results (qeval.present.leaderboard.Leaderboard): strict JSON."""
    settings, first = board.settings, board.results[0]
    capture = reference_capture(first)
    ref = first.summary.reference
    reference_request = (first.summary.request or {}).get("reference") or {}
    return {
        "qeval_version": __version__,
        "results_qeval_versions": sorted({r.summary.qeval_version or NOT_RECORDED for r in board.results}),
        "reference": {**{k: v for k, v in settings["reference"].items() if k not in ("kv", "store")},
                      "kv": ref.kv_types, "n_vocab": ref.n_vocab},
        "corpus": ref.corpus or {},
        "n_ctx": settings["n_ctx"],
        "chunks": settings["chunks"],
        "scored_tokens": settings["scored_tokens"],
        "scoring": settings["scoring"],
        "tokens_sha256": settings["tokens_sha256"],
        "batch": {"n_batch": reference_request.get("n_batch"), "n_ubatch": reference_request.get("n_ubatch")},
        "samplers": settings["samplers"],
        "candidate_settings": {r.label: candidate_settings(r) for r in board.results},
        "reference_capture": capture,
        # from the reference's capture block; None where it does not record them (the GPU model: never)
        "cpu": (capture or {}).get("cpu"), "gpu": None,
        "llama_cpp_build": (capture or {}).get("llama_cpp_system_info"),
    }


def candidate_settings(res: results.Result) -> dict:
    """How a candidate's logits were made beyond its KV types (the table's KV column): attention and RoPE flags,
    batch sizes, as its result's request records them."""
    producer = (res.summary.request or {}).get("candidate") or {}
    # the types and the rotation are the table's KV column ("q4_0/q4_0 rot")
    flags = {k: v for k, v in res.summary.candidate.kv_types.items() if k not in ("type_k", "type_v", "rotation")}
    return {**flags, "n_batch": producer.get("n_batch"), "n_ubatch": producer.get("n_ubatch")}


def reference_capture(res: results.Result) -> dict | None:
    """The capture block of the reference's store header; None when the store is gone or holds another capture
    now (a store replaced since would describe a run these numbers do not come from)."""
    ref = res.summary.reference
    for path in _store_candidates(ref, res.path):
        with contextlib.suppress(OSError, QevalError), contextlib.closing(StoreReader(path)) as store:
            h = store.header
            if h.tokens_sha256 == ref.tokens_sha256 and h.model == ref.facts:
                return h.capture
    return None


def _store_candidates(ref: Side, result_path: Path | None) -> list[Path]:
    """Where the reference store may be: the path the result records (relative to where it was computed), then
    the same file name in the runs directory that holds the result's results/ directory (a moved runs dir)."""
    if not ref.path:
        return []
    recorded = Path(ref.path)
    beside = [result_path.parent.parent / recorded.name] if result_path is not None else []
    return [recorded, *beside]


# --------------------------------------------------------------------------------------------------
# the card's provenance list
# --------------------------------------------------------------------------------------------------
def lines(p: dict) -> list[tuple[str, str]]:
    """(name, text) of the provenance list, in reading order."""
    ref, corpus = p["reference"], p["corpus"]
    out = [("Reference", _reference_text(ref)),
           ("Reference model fingerprint", _code(ref["fingerprint"])),
           ("Corpus", _corpus_text(corpus)),
           ("Context", _context_text(p)),
           ("Reference PPL", METRICS["ppl_ref"].cell(ref["ppl"], ref["ppl_se"])),
           ("Reference settings", _settings_text(ref["kv"], p["batch"], p["reference_capture"])),
           ("Quant settings", _candidates_text(p["candidate_settings"])),
           ("Hardware and build", _hardware_text(p["reference_capture"]))]
    out += [(f"Sampler {name}", sampler.parse(name).describe()) for name in p["samplers"]]
    versions = ", ".join(p["results_qeval_versions"])
    out.append(("Generated by", f"qeval {p['qeval_version']} (results computed by qeval {versions})"))
    return out


def _code(value) -> str:
    return f"`{value}`" if value else NOT_RECORDED


def _context_text(p: dict) -> str:
    return (f"n_ctx {p['n_ctx']}, {p['chunks']} chunks, {p['scored_tokens']:,} scored tokens (scoring "
            f"`{p['scoring']}`: {Scoring.parse(p['scoring']).describe()}), token ids sha256 {_code(p['tokens_sha256'])}")


def _reference_text(ref: dict) -> str:
    facts = ", ".join(str(v) for v in (ref["model_file"], ref["quant"]) if v)
    return f"{ref['label']} ({facts})" if facts else str(ref["label"])


def _corpus_text(corpus: dict) -> str:
    if not corpus:
        return NOT_RECORDED
    source = f" from {corpus['source']}" if corpus.get("source") else ""
    return f"{corpus.get('name') or '?'}{source}, sha256 {_code(corpus.get('sha256'))}"


def _settings_text(kv: dict, batch: dict, capture: dict | None) -> str:
    """KV cache and attention flags, batch sizes, and the capture's flags that change what is decoded."""
    parts = [f"KV {kv.get('type_k', '?')}/{kv.get('type_v', '?')}",
             *(f"{k} {v}" for k, v in kv.items() if k not in ("type_k", "type_v")),
             _flags_text(batch)]
    if capture and "bos_substituted" in capture:
        parts.append(f"BOS substituted {'yes' if capture['bos_substituted'] else 'no'}")
    return ", ".join(parts)


def _flags_text(flags: dict) -> str:
    return ", ".join(f"{k} {NOT_RECORDED if v is None else v}" for k, v in flags.items())


def _candidates_text(by_label: dict[str, dict]) -> str:
    """One line when every quant ran alike (the usual case), else each quant's own."""
    texts = {label: _flags_text(flags) for label, flags in by_label.items()}
    if len(set(texts.values())) == 1:
        return f"{next(iter(texts.values()))} (every quant; KV types in the table)"
    return "; ".join(f"{label}: {text}" for label, text in texts.items())


UNRECORDED_HARDWARE = f"GPU model and llama.cpp commit {NOT_RECORDED} by qeval (the llama-cpp-python version pins the commit)"


def _environment_text(numerics: dict | None) -> str:
    """The GGML_/LLAMA_ variables the capture ran under (qeval.engine.numerics), "none set" when none."""
    if not isinstance(numerics, dict):
        return NOT_RECORDED
    env = numerics.get("env") or {}
    return ", ".join(f"{k}={v}" for k, v in env.items()) or "none set"


def _hardware_text(capture: dict | None) -> str:
    if capture is None:
        return f"the reference store is not readable here, so its capture block is not shown; {UNRECORDED_HARDWARE}"
    layers = capture.get("n_gpu_layers")
    parts = [f"GPU offload {NOT_RECORDED}" if layers is None else
             "CPU only (n_gpu_layers 0)" if layers == 0 else f"GPU offload (n_gpu_layers {layers})",
             f"llama-cpp-python {capture.get('llama_cpp_python', NOT_RECORDED)}",
             f"CPU {capture.get('cpu') or NOT_RECORDED}",
             f"llama.cpp build: {capture.get('llama_cpp_system_info') or NOT_RECORDED}",
             f"llama.cpp environment: {_environment_text(capture.get('numerics'))}"]
    if "created" in capture:
        parts.append(f"reference captured {capture['created']}")
    return ", ".join(parts) + f"; {UNRECORDED_HARDWARE}"
