"""A results dataset (spec: docs/results-dataset.md): saved comparisons that anyone contributes to a Hugging Face
Hub dataset repository, each file at a path its identity gives, so that two contributors' files never collide and
the same measurement uploads to the same name:

    results/<REFERENCE>/<RESULT>.json                   a result's summary JSON, made public
    results/<REFERENCE>/<RESULT>.npz                    its per-token values, as saved
    results/<REFERENCE>/deployment/<LABEL>.<MACHINE>.json   a row's speed and memory on one machine
    contributions/<ID>.json                             the manifest of one upload (one commit)

REFERENCE is the digest of the reference identity a result was measured against (qeval.identity.reference_identity,
as its request records it), RESULT the result's own request key (qeval.identity.ComparisonRequest.key), MACHINE the
first 12 digits of the machine id of a deployment record. A contribution's manifest lists the sha256 and size of
every file it uploaded, the machine it was uploaded from, and per result what a board needs without downloading
it: the reference's identity and label, the candidate's label and model fingerprint, its metrics and the build and
backend its candidate ran on. It is read trusting nothing (read_contribution): each fault is one QevalError.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath

from qeval.errors import QevalError
from qeval.identity import ComparisonRequest, digest
from qeval.storage.deployment import MACHINE_ID_DIGITS, machine_id
from qeval.storage.reference_pack import PackFile, check_fields, manifest_bytes, manifest_json, pack_file

FORMAT = "qeval-results"
VERSION = 1
READABLE_VERSIONS = (1,)
RESULTS_FOLDER = "results"
CONTRIBUTIONS_FOLDER = "contributions"
DEPLOYMENT_FOLDER = "deployment"
ROLES = ("result", "per_token", "deployment")
_HEX = re.compile(r"^[0-9a-f]{64}$")
_FIELDS = {"format": str, "version": int, "qeval_version": str, "machine": dict, "files": list, "results": list,
           "deployment": list}
_RESULT_FIELDS = {"file": str, "reference": str, "reference_label": str, "reference_identity": dict, "result": str,
                  "candidate": dict, "metrics": dict, "ran_on": dict}


@dataclass(frozen=True, kw_only=True)
class ContributedResult:
    """One result of a contribution, as its manifest describes it."""

    file: PackFile  # the summary JSON
    per_token: PackFile | None  # its per-token npz; None: uploaded without one
    reference: str  # reference_id
    reference_label: str
    reference_identity: dict  # what reference_id digests: the reason a result is another reference's
    result: str  # result_id
    candidate: dict  # {"label", "fingerprint"}
    metrics: dict  # board metrics by key: {"value", "se"}
    ran_on: dict  # the candidate's build and backend ({"backend", "llama_cpp_python", "system_info", ...})


@dataclass(frozen=True, kw_only=True)
class ContributedRecord:
    """A deployment record of a contribution: one row's speed and memory on the machine it names."""

    file: PackFile
    label: str
    machine: str  # its machine id


@dataclass(frozen=True, kw_only=True)
class Contribution:
    path: str  # of its manifest, in the dataset
    qeval_version: str
    machine: dict  # the machine it was uploaded from (qeval.engine.machine.current_machine), its id checked
    results: tuple[ContributedResult, ...]
    records: tuple[ContributedRecord, ...]


def reference_id(summary: dict) -> str:
    """The digest of the reference identity a saved result's request records."""
    return digest(summary["request"]["reference"])


def result_id(summary: dict) -> str:
    """A saved result's own identity: its request's key, recomputed from the request as recorded."""
    request = ComparisonRequest.from_summary(summary)
    if request is None:
        raise QevalError("the result records no request (an older qeval): recompute it")
    return request.key


def result_paths(reference: str, result: str) -> tuple[str, str]:
    """(summary JSON, per-token npz) of a result in the dataset."""
    stem = f"{RESULTS_FOLDER}/{reference}/{result}"
    return f"{stem}.json", f"{stem}.npz"


def record_path(reference: str, label: str, machine: str) -> str:
    """A deployment record in the dataset, beside the results of the reference its row was measured against."""
    return f"{RESULTS_FOLDER}/{reference}/{DEPLOYMENT_FOLDER}/{label}.{machine[:MACHINE_ID_DIGITS]}.json"


# --- writing -------------------------------------------------------------------------------------------------------
def contribution_manifest(qeval_version: str, machine: dict, files: list[PackFile], results: list[dict],
                          records: list[dict]) -> tuple[str, bytes]:
    """(its path in the dataset, its bytes) of the manifest of a contribution: `files` every file uploaded with it,
    `results` one entry per result (the keys of ContributedResult, files by path), `records` {"file", "label",
    "machine"} per deployment record. Its name is a digest of what it lists: the same upload, the same name."""
    manifest = {"format": FORMAT, "version": VERSION, "qeval_version": qeval_version, "machine": machine,
                "files": [f.to_json() for f in files], "results": results, "deployment": records}
    name = digest(manifest["files"])[:16]
    return f"{CONTRIBUTIONS_FOLDER}/{name}.json", manifest_bytes(manifest)


# --- reading -------------------------------------------------------------------------------------------------------
def contribution_paths(files: list[str]) -> list[str]:
    """The manifests among a dataset's files."""
    return sorted(f for f in files if PurePosixPath(f).parent.as_posix() == CONTRIBUTIONS_FOLDER
                  and f.endswith(".json"))


def read_contribution(data: bytes, path: str, where: str) -> Contribution:
    """A contribution's manifest from its bytes, every field checked (`where` names it in messages)."""
    d = manifest_json(data, where, "results", FORMAT, READABLE_VERSIONS, _FIELDS)
    if d["machine"].get("id") != machine_id(d["machine"]):
        raise QevalError(f"{where}: its machine id does not match its machine's fields")
    files = {f.path: f for f in (pack_file(entry, where, ROLES) for entry in d["files"])}
    if len(files) != len(d["files"]):
        raise QevalError(f"{where}: a file is listed twice")
    results = tuple(_result(entry, files, where) for entry in d["results"])
    records = tuple(_record(entry, files, where) for entry in d["deployment"])
    return Contribution(path=path, qeval_version=d["qeval_version"], machine=d["machine"], results=results,
                        records=records)


def _listed(files: dict[str, PackFile], path: object, role: str, where: str) -> PackFile:
    found = files.get(path) if isinstance(path, str) else None
    if found is None or found.role != role:
        raise QevalError(f"{where}: {path!r} is not a listed file of role {role!r}")
    return found


def _result(entry: object, files: dict[str, PackFile], where: str) -> ContributedResult:
    check_fields(entry, _RESULT_FIELDS, where, "a result's entry")
    for name in ("reference", "result"):
        if not _HEX.match(entry[name]):
            raise QevalError(f"{where}: {entry['file']}: {name} {entry[name]!r} is not 64 lowercase hex digits")
    if digest(entry["reference_identity"]) != entry["reference"]:
        raise QevalError(f"{where}: {entry['file']}: its reference identity is not the one its reference names")
    per_token = entry.get("per_token")
    return ContributedResult(
        file=_listed(files, entry["file"], "result", where),
        per_token=None if per_token is None else _listed(files, per_token, "per_token", where),
        reference=entry["reference"], reference_label=entry["reference_label"],
        reference_identity=entry["reference_identity"], result=entry["result"], candidate=entry["candidate"],
        metrics=entry["metrics"], ran_on=entry["ran_on"])


def _record(entry: object, files: dict[str, PackFile], where: str) -> ContributedRecord:
    check_fields(entry, {"file": str, "label": str, "machine": str}, where, "a deployment entry")
    return ContributedRecord(file=_listed(files, entry["file"], "deployment", where), label=entry["label"],
                             machine=entry["machine"])
