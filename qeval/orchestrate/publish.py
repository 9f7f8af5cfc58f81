"""`qeval publish`: a complete reference store, its manifest (qeval.storage.reference_pack) and, optionally, the
results measured against it and a card, uploaded to a Hugging Face Hub repository in one commit, through
huggingface_hub (HF_TOKEN, HF_ENDPOINT are its settings). Anyone may then score a quant against it without the
original model: `qeval kld --ref hf:USER/REPO:LABEL --cand MODEL.gguf`.

The commit is atomic: a pull never meets a manifest without its store. An interrupted publish is resumed by running
it again: huggingface_hub uploads through Xet (hf_xet), whose already-uploaded chunks are not sent again; without
hf_xet, a large file the Hub already holds (by sha256, git LFS) is skipped.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

from qeval.engine.machine import build_backend
from qeval.errors import QevalError
from qeval.identity import FLOOR_KV_FREE, NOT_RECORDED, is_floor
from qeval.orchestrate.certify import certify_store
from qeval.orchestrate.measured import check_reference
from qeval.present import report, results
from qeval.storage.results import find_results
from qeval.storage import hub_files, reference_pack, runs
from qeval.storage.hub_files import is_hub_spec, split_spec
from qeval.storage.store import StoreReader

RESULTS_FOLDER = "results"  # in the repository: results/<LABEL>/<cand>.vs.<LABEL>.json and their per-token files
CARD = "README.md"  # the repository's card: what the Hub shows on its page


def publish_report(store: str, target: str, results_dir: Path | None = None, card: Path | None = None,
                   runs_dir=None, private: bool = False) -> tuple[dict, str]:
    """Publish the store `store` (a path or a label) to `target` (hf:USER/REPO, or hf:USER/REPO:LABEL with the
    store's own label); `results_dir`: a runs directory (or its results/) whose results against this store go
    with it; `card`: a markdown file, the repository's README.md; `private`: a repository created now is private."""
    repo, named = _target(target)
    if is_hub_spec(store):
        raise QevalError(f"{store} is already published; publish a local store (a path or a label)")
    path = runs.resolve_path(store, runs.runs_dir(runs_dir))
    with StoreReader(path) as source:
        label, header = source.header.label, source.header
        reference_pack.require_complete(source, path)  # before certifying it
    runs.check_label(label)
    _refuse_private(path, header)
    certified = certify_store(path)  # a published store is read on every machine: no lean piece goes up
    if named and named != label:
        raise QevalError(f"{path} holds reference {label!r}: it is published under its own label, hf:{repo}:{label}")
    with tempfile.TemporaryDirectory(prefix="qeval-publish-") as staging:
        staging = Path(staging)
        files = [(runs.store_path(label, Path()).as_posix(), path, "store")]
        published, floors = _results(path, label, results_dir, staging) if results_dir is not None else ([], [])
        files += published
        if card is not None:
            if not Path(card).is_file():
                raise QevalError(f"--card {card} is not a file")
            files.append((CARD, Path(card), "card"))
        manifest = reference_pack.build_manifest(path, _backend(header), files, floors)
        manifest_file = staging / reference_pack.manifest_name(label)
        manifest_file.write_bytes(reference_pack.manifest_bytes(manifest))
        files.append((manifest_file.name, manifest_file, "manifest"))
        commit = hub_files.upload(repo, [(path, local) for path, local, _ in files], f"qeval reference {label}",
                                  private)
        return _report(repo, label, commit, _uploaded(files, manifest), certified.lean_pieces)


def _refuse_private(path: Path, header) -> None:
    """The store goes up byte for byte (its checksums and identity are its bytes): refused when its header names
    this machine's user or a local path (a corpus captured from /home/NAME/...), which the upload would make public."""
    reference_pack.refuse_private(dataclasses.asdict(header), "header", str(path),
                                  "capture the reference with --corpus as a path relative to the folder you run in, a "
                                  "shipped corpus or an hf: dataset, then publish that store")


def _backend(header) -> str:
    """What the store's llama.cpp build computed on beyond the CPU (CUDA, Metal, ...; "CPU"), from the system info
    its numerics record."""
    numerics = header.capture.get("numerics")
    system_info = numerics.get("build", {}).get("system_info") if isinstance(numerics, dict) else None
    return build_backend(system_info) if system_info else NOT_RECORDED


def _target(target: str) -> tuple[str, str]:
    """(USER/REPO, LABEL or "") of where to publish."""
    if not is_hub_spec(target):
        raise QevalError(f"publish to a Hub repository, hf:USER/REPO (not {target!r})")
    return split_spec(target, "repository", "LABEL", "hf:USER/gemma-3-270m-qeval")


def _results(store: Path, label: str, results_dir: Path,
             staging: Path) -> tuple[list[tuple[str, Path, str]], list[dict]]:
    """The results in `results_dir` measured against `store` (labelled .vs.LABEL; one measured against another
    capture under this label is refused), each as a public copy of its JSON (no local paths) and its per-token
    file, under results/LABEL/; and the numerics-floor rows among them (_floor_row)."""
    found = [p for p in find_results([results_dir]) if p.name.endswith(f"{runs.RESULT_SEPARATOR}{label}.json")]
    if not found:
        raise QevalError(f"--results {results_dir} holds no result against {label} (*{runs.RESULT_SEPARATOR}{label}.json)")
    folder = staging / RESULTS_FOLDER
    folder.mkdir()
    files, floors = [], []
    for result in found:
        saved = check_reference(str(store), results.load_result(result, with_per_token=False), None).summary
        summary = json.loads(result.read_text())
        copy = folder / result.name
        copy.write_text(json.dumps(reference_pack.public(summary), indent=1) + "\n")
        files.append((f"{RESULTS_FOLDER}/{label}/{result.name}", copy, "result"))
        if is_floor(saved.comparison_request()):
            floors.append(_floor_row(saved, files[-1][0]))
        per_token = summary.get("per_token_file")
        if per_token and (result.parent / per_token).is_file():
            files.append((f"{RESULTS_FOLDER}/{label}/{per_token}", result.parent / per_token, "result"))
    return files, floors


def _floor_row(summary, path: str) -> dict:
    """A numerics-floor result (qeval.identity.is_floor: the reference model on another of llama.cpp's kernel paths)
    as the manifest lists it (reference_pack.FLOOR_FIELDS): which path it flipped (`decode`, `flash-attn`: the
    names of qeval matrix's --floor), where it ran, its KLD and same top-1, the file they come from."""
    request = summary.comparison_request()
    ref_kv, floor_kv = (side.get("kv") or {} for side in (request.reference, request.candidate))
    kind = "+".join(name.replace("_", "-") for name in FLOOR_KV_FREE if ref_kv.get(name) != floor_kv.get(name))
    numerics = request.candidate.get("numerics")
    kld, top1 = summary.figures.kld, summary.figures.blocks.get("same_top1") or {}
    return {"kind": kind, "backend": report.ran_on(numerics)["backend"],
            "build": reference_pack.build_block(numerics, None), "path": path, "chunks": summary.chunks,
            "scored_tokens": summary.scored_tokens,
            "kld_mean": kld.get("mean"), "kld_se": kld.get("se"), "same_top1": top1.get("fraction"),
            "same_top1_se": top1.get("se")}


def ran_where(spec: str, ref_header, cand_header) -> dict:
    """What ran where when a candidate is compared with the published reference `spec` (hf:USER/REPO[:LABEL]): each
    side's build and backend (qeval.present.report.ran_where), and the numerics-floor rows published with the
    reference for the candidate's backend (published_floor)."""
    where = report.ran_where(ref_header, cand_header)
    floors = reference_pack.published_manifest(spec).floors
    return {**where, "floor": published_floor(floors, where["candidate"]["backend"])}


def published_floor(floors: list[dict], backend: str) -> dict:
    """Of a manifest's numerics-floor rows, those that ran on `backend` (the candidate's): a floor measured on another
    backend says nothing of this one's kernels; `published`: the backends the reference publishes a floor for."""
    return {"backend": backend, "rows": [f for f in floors if f["backend"] == backend],
            "published": sorted({f["backend"] for f in floors})}


def _uploaded(files: list[tuple[str, Path, str]], manifest: dict) -> dict:
    """What a publish sent: every file's size and role, the manifest's own size, and what the manifest says."""
    listed = [{"path": path, "bytes": local.stat().st_size, "role": role} for path, local, role in files]
    return {"files": listed, "manifest_bytes": next(f["bytes"] for f in listed if f["role"] == "manifest"), "bytes": sum(f["bytes"] for f in listed),
            "published": {k: manifest[k] for k in ("backend", "build", "form", "bounds", "sizes", "floors")}}


def _report(repo: str, label: str, commit, uploaded: dict, certified: int) -> tuple[dict, str]:
    spec = f"hf:{repo}:{label}"
    out = {"repo": repo, "label": label, "reference": spec, "commit": commit.oid, "commit_url": commit.commit_url,
           "certified_lean_pieces": certified, **uploaded}
    width = max(len(f["path"]) for f in uploaded["files"])
    lines = [*([f"certified {certified} lean pieces first (qeval certify): the store reads on any machine"]
               if certified else []),
             f"published reference {label} to hf:{repo} (commit {commit.oid[:12]}): {len(uploaded['files'])} files, "
             f"{uploaded['bytes']:,} bytes",
             *(f"  {f['path']:<{width}}  {f['bytes']:>14,} bytes  {f['role']}" for f in uploaded["files"]),
             *(f"numerics floor listed: {f['kind']} on {f['backend']} ({f['path']})"
               for f in uploaded["published"]["floors"]),
             f"score a model against it, without the original: qeval kld --ref {spec} --cand MODEL.gguf"]
    return out, "\n".join(lines)

