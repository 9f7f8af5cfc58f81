"""`qeval publish-results` and `qeval board`: saved comparisons contributed to a Hugging Face Hub dataset, and one
board built from many contributors' results (the file format: qeval.storage.results_dataset, docs/results-dataset.md).

Publishing uploads, in one commit through huggingface_hub, each result's summary JSON made public (no local path or
user name: reference_pack.public) and its per-token file, at paths their identities give; the deployment records of
their rows beside them, each with its machine; and the contribution's manifest: the sha256 of every file, the
machine it was uploaded from (results record their build, not their machine: upload from the machine that measured
them) and what a board needs of each result. What identifies a measurement (a result's request, a record's machine)
is hashed, so it is never rewritten: a local path or the user's name in it is refused.

A board downloads every contribution's manifest of the datasets named (into huggingface_hub's cache), keeps the
results measured against one reference identity, downloads them (a cached file is not fetched again) and builds the
leaderboard (qeval.present.leaderboard) from those whose bytes are what a manifest lists. A file that is not (tampered
with, cut short) or does not read is refused, named, and left out: the board is still built from the rest. Results of
another reference, or that cannot share the board (another qeval's formulas), are listed apart with why.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections import defaultdict
from pathlib import Path, PurePosixPath

from qeval import __version__
from qeval.compare import metric_registry
from qeval.errors import QevalError
from qeval.identity import changes
from qeval.orchestrate.boards import this_machine
from qeval.present import contributed_board, leaderboard, report, results
from qeval.present.deployment_board import Machine, Records
from qeval.storage import hub_files, reference_pack, results_dataset
from qeval.storage.deployment import load_record, load_records
from qeval.storage.hub_files import is_hub_spec
from qeval.storage.reference_pack import PackFile, file_sha256
from qeval.storage.results import runs_dir_of

DATASET = "dataset"
DEFAULT_OUT = "board"
_PRIVATE_REMEDY = ("it identifies the measurement (its digest is the file's name), so it cannot be cut: measure it "
                   "again with the files named relative to the folder you run in")


def upload_machine() -> dict:
    """The machine a contribution is uploaded from (qeval.engine.machine.current_machine)."""
    from qeval.engine.machine import current_machine  # noqa: PLC0415 - llama.cpp's system info, nvidia-smi, on demand

    return current_machine()


def _dataset(spec: str) -> str:
    """USER/DATASET of `hf:USER/DATASET`."""
    if not is_hub_spec(spec):
        raise QevalError(f"name a Hub dataset, hf:USER/DATASET (not {spec!r})")
    repo, tag = hub_files.split_spec(spec, "dataset", "", "hf:USER/qeval-results")
    if tag:
        raise QevalError(f"bad dataset {spec!r}: expected hf:USER/DATASET, e.g. hf:USER/qeval-results")
    return repo


# --- publishing ----------------------------------------------------------------------------------------------------
def publish_results(runs: list, target: str, *, private: bool = False) -> tuple[dict, str]:
    """Upload the saved results `runs` names (files, or directories of them) to the Hub dataset `target`, with the
    deployment records of their rows and the contribution's manifest, in one commit."""
    repo = _dataset(target)
    loaded = leaderboard.load_results(runs, with_per_token=False)
    machine = upload_machine()
    reference_pack.refuse_private(machine, "machine", "this machine's description", _PRIVATE_REMEDY)
    with tempfile.TemporaryDirectory(prefix="qeval-contribute-") as staging:
        staging = Path(staging)
        files: dict[str, tuple[Path, str]] = {}  # path in the dataset -> (local file, role)
        staged = [(res, _stage_result(res, staging, files)) for res in loaded]
        entries = {}
        for _, entry in staged:
            entries.setdefault(entry["result"], entry)  # one measurement saved twice goes up once
        records = _stage_records(staged, staging, files)
        listed = [PackFile(path, file_sha256(local), local.stat().st_size, role)
                  for path, (local, role) in files.items()]
        name, data = results_dataset.contribution_manifest(__version__, machine, listed, list(entries.values()),
                                                           records)
        manifest = staging / "contribution.json"
        manifest.write_bytes(data)
        uploads = [(path, local) for path, (local, _) in files.items()] + [(name, manifest)]
        commit = hub_files.upload(repo, uploads, f"qeval results: {len(entries)} from {machine['id'][:12]}", private,
                                  repo_type=DATASET)
        sent = [{"path": path, "bytes": local.stat().st_size} for path, local in uploads]
    out = {"dataset": repo, "commit": commit.oid, "commit_url": commit.commit_url, "contribution": name,
           "machine": machine["id"], "results": list(entries.values()), "records": records, "files": sent}
    lines = [f"contributed {len(entries)} results and {len(records)} speed and memory records to hf:{repo} (commit "
             f"{commit.oid[:12]}), manifest {name}",
             *(f"  {e['candidate']['label']} vs {e['reference_label']}  ->  {e['file']}" for e in entries.values()),
             f"build a board from it: qeval board hf:{repo}"]
    return out, "\n".join(lines)


def _stage_result(res: results.Result, staging: Path, files: dict) -> dict:
    """A public copy of a result's summary staged at its identity's path, its per-token file beside it; its manifest
    entry."""
    results.require_current(res)
    summary = json.loads(res.path.read_text())
    reference_pack.refuse_private(summary["request"], "request", str(res.path), _PRIVATE_REMEDY)
    public = reference_pack.public(summary)
    reference, key = results_dataset.reference_id(public), results_dataset.result_id(public)
    json_path, npz_path = results_dataset.result_paths(reference, key)
    npz = res.path.parent / summary["per_token_file"] if summary.get("per_token_file") else None
    has_npz = npz is not None and npz.is_file()
    public["per_token_file"] = PurePosixPath(npz_path).name if has_npz else None
    copy = staging / f"{key}.json"
    copy.write_text(json.dumps(public, indent=1) + "\n")
    files[json_path] = (copy, "result")
    if has_npz:
        files[npz_path] = (npz, "per_token")
    held = res.summary.measured()
    return {"file": json_path, "per_token": npz_path if has_npz else None, "reference": reference,
            "reference_label": res.ref_label, "reference_identity": public["request"]["reference"], "result": key,
            "candidate": {"label": res.label, "fingerprint": res.summary.candidate.facts.get("fingerprint")},
            "metrics": {m.key: {"value": held[m.key].value, "se": held[m.key].se}
                        for m in metric_registry.board() if m.key in held},
            "ran_on": report.ran_on(public["request"]["candidate"].get("numerics"))}


def _stage_records(staged: list[tuple[results.Result, dict]], staging: Path, files: dict) -> list[dict]:
    """The deployment records beside the results (their runs directories' deployment/) of the rows uploaded, the
    reference's included, each staged beside the results of each reference it goes with; their manifest entries."""
    wanted = defaultdict(set)  # (runs dir, label) -> reference ids
    for res, entry in staged:
        for label in (res.label, res.ref_label):
            wanted[runs_dir_of(res.path).resolve(), label].add(entry["reference"])
    out = []
    for folder in dict.fromkeys(folder for folder, _ in wanted):
        for record in load_records(folder):
            for reference in sorted(wanted.get((folder, record.label), ())):
                reference_pack.refuse_private(record.machine, "machine", f"the record of {record.label}",
                                              _PRIVATE_REMEDY)
                path = results_dataset.record_path(reference, record.label, record.machine_id)
                copy = staging / PurePosixPath(path).name
                copy.write_text(json.dumps(reference_pack.public(record.to_json()), indent=2) + "\n")
                files[path] = (copy, "deployment")
                out.append({"file": path, "label": record.label, "machine": record.machine_id})
    return out


# --- the board -----------------------------------------------------------------------------------------------------
def board(datasets: list[str], *, ref: str | None = None, out=DEFAULT_OUT, title: str | None = None,
          machine: str | None = None) -> leaderboard.Leaderboard:
    """The board of every result in the Hub datasets `datasets` measured against one reference identity (`ref`: its
    label or the first digits of its digest; default the datasets' only one), written under `out`; rows measured on
    another machine than this one (or `machine`, a machine id's first digits) or backend than the reference's are
    marked."""
    if not datasets:
        raise QevalError("name at least one Hub dataset of results, hf:USER/DATASET")
    refused: list[tuple[str, str]] = []
    found = [(repo, c) for repo in map(_dataset, datasets) for c in _contributions(repo, refused)]
    entries = [(repo, c, r) for repo, c in found for r in c.results]
    chosen = _chosen_reference([r for _, _, r in entries], ref, datasets)
    apart = [(_where(repo, r.file.path), f"{r.reference_label} ({r.reference[:12]})",
              _other_reference(chosen, r)) for repo, _, r in entries if r.reference != chosen.reference]
    kept = _comparable(_downloaded(entries, chosen, refused), apart)
    labels = _row_labels(kept)
    current = this_machine()
    records = _records(kept, labels, chosen.reference, refused)
    machines = {facts["id"]: Machine(facts["id"][:12], facts, facts["id"] == current)
                for facts in [*(rec.machine for rec in records), *(c.machine for _, _, c, _ in kept)]}
    built = leaderboard.build(loaded=[_relabelled(res, labels[id(res)]) for _, res, _, _ in kept], title=title,
                              deployment=_deployment(records, current, machine))
    sources = contributed_board.Sources(
        datasets=tuple(datasets), reference=chosen.reference,
        reference_backend=report.ran_on(chosen.reference_identity.get("numerics"))["backend"],
        machine=_board_machine(machines, current, machine), apart=apart, refused=refused,
        origins={labels[id(res)]: contributed_board.Origin(machine=machines[c.machine["id"]],
                                                           backend=r.ran_on.get("backend", "?"),
                                                           file=_where(repo, r.file.path))
                 for repo, res, c, r in kept})
    contributed_board.mark_rows(built.table_rows, sources)
    built.sources = sources
    return leaderboard.write(built, out)


def _downloaded(entries: list, chosen: results_dataset.ContributedResult, refused: list) -> list:
    """(dataset, result, its contribution, its entry) of every result of the chosen reference, each file downloaded
    once and verified; one that is not what a manifest lists, or does not read, is refused."""
    by_file = defaultdict(list)
    for repo, c, r in entries:
        if r.reference == chosen.reference:
            by_file[repo, r.file.path].append((c, r))
    loaded = []
    for (repo, path), listed in by_file.items():
        try:
            loaded.append((repo, *_result(repo, listed)))
        except QevalError as exc:
            refused.append((_where(repo, path), str(exc)))
    if not loaded:
        raise QevalError(f"no result measured against {chosen.reference_label} ({chosen.reference[:12]}) reads: "
                         + "; ".join(f"{name}: {why}" for name, why in refused))
    return loaded


def _where(repo: str, path: str) -> str:
    return f"hf:{repo}/{path}"


def _contributions(repo: str, refused: list) -> list[results_dataset.Contribution]:
    """Every contribution of a dataset whose manifest reads; one that does not is refused, named."""
    listing, where = hub_files.repo_files(repo, DATASET)
    paths = results_dataset.contribution_paths(listing)
    if not paths:
        raise QevalError(f"{where} holds no qeval results ({results_dataset.CONTRIBUTIONS_FOLDER}/*.json): "
                         f"`qeval publish-results RUN hf:{repo}` contributes some")
    out = []
    for path in paths:
        try:
            data = Path(hub_files.download(repo, path, DATASET)).read_bytes()
            out.append(results_dataset.read_contribution(data, path, _where(repo, path)))
        except QevalError as exc:
            refused.append((_where(repo, path), str(exc)))
    return out


def _chosen_reference(entries: list, ref: str | None, datasets: list[str]) -> results_dataset.ContributedResult:
    """A result entry of the reference the board is of: the one whose label is `ref` or whose digest starts with it;
    with no `ref`, the datasets' only reference. Refused when none or several match, listing them."""
    by_id = {}
    for e in entries:
        by_id.setdefault(e.reference, (e, []))[1].append(e)
    known = "; ".join(f"{e.reference_label} ({ref_id[:12]}, {len(held)} results)"
                      for ref_id, (e, held) in by_id.items())
    if not by_id:
        raise QevalError(f"{', '.join(datasets)}: no result that reads")
    matching = [e for ref_id, (e, _) in by_id.items()
                if ref is None or e.reference_label == ref or (len(ref) >= 6 and ref_id.startswith(ref.lower()))]
    if len(matching) == 1:
        return matching[0]
    if not matching:
        raise QevalError(f"--ref {ref}: no result of {', '.join(datasets)} was measured against it; its references: "
                         f"{known}")
    raise QevalError(f"{', '.join(datasets)} hold results of {len(matching)} references"
                     f"{f' labelled {ref}' if ref else ''} ({known}): name one with --ref and the first digits of its "
                     "identity")


def _other_reference(chosen: results_dataset.ContributedResult, other: results_dataset.ContributedResult) -> str:
    """Why a result of another reference identity is not on the board: what differs."""
    differences = changes(chosen.reference_identity, other.reference_identity)
    what = "; ".join(differences or ["its identity"])
    return f"measured against another reference ({what}: this board's vs its)"


def _result(repo: str, listed: list) -> tuple[results.Result, results_dataset.Contribution,
                                              results_dataset.ContributedResult]:
    """A result downloaded, with the contribution whose manifest lists its bytes (and its per-token file's)."""
    local, (c, r) = _verified(repo, [(entry, entry[1].file) for entry in listed])
    if r.per_token is not None:
        _verified(repo, [((c, r), r.per_token)])
    return results.load_result(local), c, r


def _verified(repo: str, listed: list) -> tuple[Path, object]:
    """The file every one of `listed` ((what, its PackFile): one path) names, downloaded, and the last `what` whose
    size and sha256 it has (the same path uploaded again replaces the file); refused when it has none's."""
    path = listed[0][1].path
    local = Path(hub_files.download(repo, path, DATASET))
    matching = [what for what, packed in listed if not reference_pack.mismatch(local, packed)]
    if not matching:
        packed = listed[-1][1]
        got = reference_pack.mismatch(local, packed)
        what = "cut short (partial)" if local.stat().st_size < packed.bytes else "tampered with or damaged"
        raise QevalError(f"{_where(repo, path)} has {got}, its contribution's manifest says {packed.bytes:,} bytes, "
                         f"sha256 {packed.sha256}: {what}; left out of the board")
    return local, matching[-1]


def _comparable(loaded: list, apart: list) -> list:
    """The results that may share one board with the first (this qeval's formulas, the same reference label and
    chunks); the rest listed apart with why."""
    kept, base = [], None
    for repo, res, c, r in loaded:
        try:
            identity = leaderboard.board_identity(res)
            base = base or identity
            differences = changes(base, identity)
        except QevalError as exc:  # another qeval's formulas
            differences = [str(exc)]
        if differences:
            apart.append((_where(repo, r.file.path), f"{r.reference_label} ({r.reference[:12]})",
                          "; ".join(differences)))
        else:
            kept.append((repo, res, c, r))
    if not kept:
        raise QevalError("no result of these datasets can be put on a board: " +
                         "; ".join(f"{f}: {why}" for f, _, why in apart))
    return kept


def _row_labels(kept: list) -> dict[int, str]:
    """id(result) -> its row's label: the candidate's, with the first digits of its result's identity where two
    contributors measured candidates under one label."""
    count = defaultdict(int)
    for _, res, _, _ in kept:
        count[res.label] += 1
    return {id(res): res.label if count[res.label] == 1 else f"{res.label}@{r.result[:8]}" for _, res, _, r in kept}


def _relabelled(res: results.Result, label: str) -> results.Result:
    if label == res.label:
        return res
    summary = dataclasses.replace(res.summary, candidate=dataclasses.replace(res.summary.candidate, label=label))
    return dataclasses.replace(res, summary=summary)


def _records(kept: list, labels: dict[int, str], reference: str, refused: list) -> list:
    """The deployment records the kept rows' contributions list beside this reference, each under its row's label
    (the reference's record under its own), each file verified once."""
    by_file = defaultdict(list)
    rows = {}  # (contribution path, label as contributed) -> the row's label
    for repo, res, c, _ in kept:
        rows[c.path, res.label] = labels[id(res)]
        rows[c.path, res.ref_label] = res.ref_label
        for rec in c.records:
            if rec.file.path.startswith(f"{results_dataset.RESULTS_FOLDER}/{reference}/"):
                by_file[repo, rec.file.path].append(((c, rec), rec.file))
    out = []
    for (repo, path), listed in by_file.items():
        try:
            local, (c, rec) = _verified(repo, listed)
            record = load_record(local)
        except QevalError as exc:
            refused.append((_where(repo, path), str(exc)))
            continue
        label = rows.get((c.path, record.label))
        if label is not None:
            out.append(dataclasses.replace(record, label=label))
    return out


def _deployment(records: list, current: str, machine: str | None) -> Records | None:
    if not records:
        return None
    shown = machine if machine and any(r.machine_id.startswith(machine.lower()) for r in records) else None
    return Records(tuple(records), current, shown)


def _board_machine(machines: dict[str, Machine], current: str, asked: str | None) -> Machine:
    """The machine a board's unmarked rows were measured on: `asked` (a machine id's first digits, of a machine that
    uploaded a row or measured a record), else this one."""
    if asked is None:
        return machines.get(current) or Machine(current[:12], {"id": current}, True)
    found = [m for key, m in machines.items() if key.startswith(asked.lower())]
    if len(found) != 1:
        known = "; ".join(m.text for m in machines.values())
        raise QevalError(f"--machine {asked!r} {'matches several' if found else 'is none'} of the machines these "
                         f"results were measured on ({known})")
    return found[0]
