"""A local server that answers as the Hugging Face Hub does for the calls huggingface_hub makes, and the `fake_hub`
fixture that points huggingface_hub at it (its cache in tmp_path). Nothing here reaches the internet.

Reading: the repo listing (GET /api/models/REPO) and file downloads (HEAD then GET /REPO/resolve/REVISION/FILE, with a
Range request to resume a cut one). Publishing, as huggingface_hub 2.4 does it without hf_xet (HF_HUB_DISABLE_XET:
the Xet protocol's content-addressed store is not served here; upload_hub() sets it): POST /api/repos/create, POST
/api/models/REPO/preupload/main (each file "regular" or "lfs"), the git LFS batch API
(POST /REPO.git/info/lfs/objects/batch: an object the server holds needs no upload), a PUT of each LFS object's
bytes (checked against its sha256), POST /api/validate-yaml for a README.md, and POST
/api/models/REPO/commit/main (NDJSON: regular files inline in base64,
LFS files by oid), applied at once; what is committed is then served as any repo. A dataset repository is served
the same under /api/datasets/ and /datasets/: `repos` holds it as "datasets/USER/NAME"."""

from __future__ import annotations

import base64
import hashlib
import json
import re

import pytest
from werkzeug import Request, Response

COMMIT = "0123456789abcdef0123456789abcdef01234567"
CUT = 1024  # where a cut download ends: whole chunks of huggingface_hub's, as test_a_cut_download_resumes sets them
TEXT_SUFFIXES = (".json", ".md")  # committed inline ("regular"); every other file goes through git LFS


def fake_gguf(name: str) -> bytes:
    """Bytes that open like a GGUF (its magic) and differ per file; no model has to run from them."""
    return b"GGUF" + hashlib.sha256(name.encode()).digest() * 64


def repo_of(*names: str) -> dict[str, bytes]:
    return {name: fake_gguf(name) for name in names}


# a release as llama.cpp users meet them: quants, a split set in a folder of its own, a vision projector and
# an importance matrix whose names also carry a tag (picking either would be an ambiguity error here)
RELEASE = repo_of("README.md", "model-Q4_K_M.gguf", "model-Q4_K.gguf", "model-IQ4_XS.gguf", "model-F16.gguf",
                  "Q8_0/model-Q8_0-00001-of-00002.gguf", "Q8_0/model-Q8_0-00002-of-00002.gguf",
                  "mmproj-model-Q8_0.gguf", "model-Q8_0.imatrix.gguf", "model.imatrix")


class FakeHub:
    """Repos (path -> bytes) served as the Hub serves them; every GET of a file is logged with its Range, every
    upload call with what it carried."""

    def __init__(self, server):
        self.url = server.url_for("").rstrip("/")
        self.repos: dict[str, dict[str, bytes]] = {}
        self.commits: dict[str, str] = {}  # repo -> its last commit's id (COMMIT until one is made here)
        self.refused: dict[str, tuple[int, str | None]] = {}  # repo -> status and X-Error-Code of its downloads
        self.cut: set[str] = set()  # files whose first GET ends after CUT bytes
        self.gets: list[tuple[str, str | None]] = []
        self.lfs: dict[str, bytes] = {}  # oid (sha256) -> bytes: the LFS objects uploaded
        self.puts: list[tuple[str, int]] = []  # (oid, bytes) of every LFS upload
        self.calls: list[str] = []  # every upload call, as "METHOD /path"
        self.failing_commits = 0  # commits refused (HTTP 500) before one is applied: an interrupted publish
        server.expect_request("/api/repos/create", method="POST").respond_with_handler(self._create)
        # a README.md in a commit is checked first; huggingface_hub also asks which AI agents to recognise (none)
        server.expect_request("/api/validate-yaml", method="POST").respond_with_json({"warnings": [], "errors": []})
        server.expect_request("/api/agent-harnesses", method="GET").respond_with_json(
            {"standardEnvVars": [], "harnesses": {}})
        server.expect_request(re.compile(r"^/api/(models|datasets)/.+/preupload/main$"), method="POST") \
            .respond_with_handler(self._preupload)
        server.expect_request(re.compile(r"^/api/(models|datasets)/.+/commit/main$"), method="POST") \
            .respond_with_handler(self._commit)
        server.expect_request(re.compile(r"^/.+\.git/info/lfs/objects/batch$"), method="POST") \
            .respond_with_handler(self._lfs_batch)
        server.expect_request(re.compile(r"^/lfs-upload/[0-9a-f]{64}$"), method="PUT").respond_with_handler(self._lfs_put)
        server.expect_request(re.compile(r"^/api/(models|datasets)/"), method="GET").respond_with_handler(self._listing)
        server.expect_request(re.compile(r"^/.+/resolve/[^/]+/")).respond_with_handler(self._file)

    # -- reading -----------------------------------------------------------------------------------------------
    def _listing(self, request: Request) -> Response:
        repo = repo_key(request.path)
        if repo not in self.repos:
            return hub_error(404, "RepoNotFound")
        body = {"id": repo, "sha": self.commits.get(repo, COMMIT),
                "siblings": [{"rfilename": name} for name in self.repos[repo]]}
        return Response(json.dumps(body), content_type="application/json")

    def _file(self, request: Request) -> Response:
        repo, _, rest = request.path.removeprefix("/").partition("/resolve/")
        name = rest.partition("/")[2]
        if repo in self.refused:
            return hub_error(*self.refused[repo])
        if repo not in self.repos:
            return hub_error(404, "RepoNotFound")
        if name not in self.repos[repo]:
            return hub_error(404, "EntryNotFound")
        data = self.repos[repo][name]
        headers = {"X-Repo-Commit": self.commits.get(repo, COMMIT), "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                   "Accept-Ranges": "bytes"}
        if request.method == "HEAD":
            return Response(data, headers=headers)  # werkzeug sends the headers of `data` without the body
        wanted = request.headers.get("Range")
        self.gets.append((name, wanted))
        if wanted:
            start = int(re.fullmatch(r"bytes=(\d+)-", wanted)[1])
            span = f"bytes {start}-{len(data) - 1}/{len(data)}"
            return Response(data[start:], 206, {**headers, "Content-Range": span})
        if name in self.cut:
            self.cut.discard(name)
            # the full length announced, CUT bytes sent, the connection closed: a connection cut mid-download
            return Response([data[:CUT]], headers={**headers, "Content-Length": str(len(data)),
                                                               "Connection": "close"})
        return Response(data, headers=headers)

    # -- publishing --------------------------------------------------------------------------------------------
    def _create(self, request: Request) -> Response:
        self.calls.append(f"POST {request.path}")
        body = request.get_json()
        repo = f"{'datasets/' if body.get('type') == 'dataset' else ''}{body['organization']}/{body['name']}"
        url = {"url": f"{self.url}/{repo}"}
        if repo in self.repos:  # as the Hub answers: the conflict, with the existing repo's URL
            return Response(json.dumps({"error": "You already created this model repo", **url}), 409,
                            content_type="application/json")
        self.repos[repo] = {}
        return Response(json.dumps(url), content_type="application/json")

    def _preupload(self, request: Request) -> Response:
        self.calls.append(f"POST {request.path}")
        files = [{"path": f["path"], "uploadMode": "regular" if f["path"].endswith(TEXT_SUFFIXES) else "lfs",
                  "shouldIgnore": False} for f in request.get_json()["files"]]
        return Response(json.dumps({"files": files}), content_type="application/json")

    def _lfs_batch(self, request: Request) -> Response:
        self.calls.append(f"POST {request.path}")
        objects = []
        for obj in request.get_json()["objects"]:
            actions = {} if obj["oid"] in self.lfs else \
                {"actions": {"upload": {"href": f"{self.url}/lfs-upload/{obj['oid']}"}}}
            objects.append({"oid": obj["oid"], "size": obj["size"], **actions})
        return Response(json.dumps({"transfer": "basic", "objects": objects}), content_type="application/json")

    def _lfs_put(self, request: Request) -> Response:
        oid = request.path.rpartition("/")[2]
        data = request.get_data()
        self.calls.append(f"PUT {request.path}")
        if hashlib.sha256(data).hexdigest() != oid:
            return hub_error(400, "BadContent")
        self.lfs[oid] = data
        self.puts.append((oid, len(data)))
        return Response("")

    def _commit(self, request: Request) -> Response:
        self.calls.append(f"POST {request.path}")
        if self.failing_commits:
            self.failing_commits -= 1
            return hub_error(500, None)
        repo = repo_key(request.path.removesuffix("/commit/main"))
        lines = [json.loads(line) for line in request.get_data().splitlines() if line.strip()]
        files = {}
        for line in lines:
            value = line["value"]
            if line["key"] == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif line["key"] == "lfsFile":
                if value["oid"] not in self.lfs:
                    return hub_error(422, None)
                files[value["path"]] = self.lfs[value["oid"]]
        self.repos[repo] = {**self.repos[repo], **files}
        commit = hashlib.sha1(json.dumps(sorted((p, hashlib.sha256(d).hexdigest()) for p, d in
                                                self.repos[repo].items())).encode()).hexdigest()
        self.commits[repo] = commit
        return Response(json.dumps({"commitUrl": f"{self.url}/{repo}/commit/{commit}", "commitOid": commit,
                                    "success": True}), content_type="application/json")


def repo_key(api_path: str) -> str:
    """The key in FakeHub.repos of /api/models/USER/NAME (USER/NAME) or /api/datasets/USER/NAME (datasets/USER/NAME)."""
    return api_path.removeprefix("/api/models/").removeprefix("/api/")


def hub_error(status: int, code: str | None) -> Response:
    headers = {"X-Error-Code": code, "X-Error-Message": code} if code else {}
    return Response(json.dumps({"error": code or "refused"}), status, headers, content_type="application/json")


@pytest.fixture
def fake_hub(httpserver, tmp_path, monkeypatch):
    """huggingface_hub pointed at the local server, its cache in tmp_path. It reads HF_ENDPOINT, HF_HUB_CACHE and
    HF_HUB_OFFLINE when it is imported, so they are set where it keeps them."""
    from huggingface_hub import constants

    endpoint(monkeypatch, httpserver.url_for("").rstrip("/"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    fake = FakeHub(httpserver)
    fake.repos["org/release"] = RELEASE
    return fake


def upload_hub(monkeypatch) -> None:
    """huggingface_hub set to publish to the fake hub: a token (it sends one with every write) and the git LFS
    protocol instead of Xet."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_TOKEN", "hf_fake_write_token")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)


def endpoint(monkeypatch, url: str) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")


def offline(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
