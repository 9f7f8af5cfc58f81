"""Corpora: files, shipped names, hub datasets (through `datasets`, on local data), chunking rules."""

from __future__ import annotations

import numpy as np
import pytest

from qeval.errors import QevalError
from qeval.inputs.corpus import HF_ALIASES, load_corpus, make_windows, parse_hf_spec, shipped_names, tokenize_documents

WIKI_ROWS = ["", " = Robert Boulter = \n", "", " Robert Boulter is an English film , television and theatre actor .\n",
             "", " = = Career = = \n", " He had a guest role in 2000 .\n"]


def local_hub(tmp_path, rows, column="text"):
    """A stand-in for datasets.load_dataset that reads a local parquet file with the real library."""
    import datasets

    path = tmp_path / "data.parquet"
    datasets.Dataset.from_dict({column: rows}).to_parquet(str(path))
    calls = []

    def loader(name, config, split):
        calls.append((name, config, split))
        return datasets.load_dataset("parquet", data_files=str(path), split="train")

    return loader, calls


def test_wikitext_alias_joins_rows_like_the_raw_file(tmp_path):
    loader, calls = local_hub(tmp_path, WIKI_ROWS)
    corpus = load_corpus("wikitext-2", hf_loader=loader)
    assert calls == [("wikitext", "wikitext-2-raw-v1", "test")]
    assert corpus.text == "".join(WIKI_ROWS)
    assert corpus.identity()["source"] == "hf:wikitext/wikitext-2-raw-v1"


def test_hf_spec_with_config_split_and_column(tmp_path):
    loader, calls = local_hub(tmp_path, ["a\n", "b\n"], column="content")
    corpus = load_corpus("hf:owner/books/en:validation#content", hf_loader=loader)
    assert calls == [("owner/books", "en", "validation")] and corpus.text == "a\nb\n"
    assert parse_hf_spec("hf:wikitext") == ("wikitext", None, "test", "text")
    with pytest.raises(QevalError, match="no column 'text'"):
        load_corpus("hf:owner/books/en", hf_loader=loader)


def test_unreachable_hub_gives_a_clear_message():
    def offline(name, config, split):
        raise ConnectionError("Couldn't reach the hub")

    with pytest.raises(QevalError, match="could not load hub dataset wikitext/wikitext-2-raw-v1.*local text file"):
        load_corpus("wikitext-2", hf_loader=offline)


def test_shipped_corpora_and_files(tmp_path):
    assert {"austen-northanger-abbey", "bierce-devils-dictionary"} <= set(shipped_names())
    assert load_corpus().name == "austen-northanger-abbey"
    assert len(load_corpus("bierce-devils-dictionary.txt").text) > 300_000
    f = tmp_path / "mine.txt"
    f.write_text("hello world", encoding="utf-8")
    assert load_corpus(str(f)).text == "hello world"
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(QevalError, match="not UTF-8"):
        load_corpus(str(tmp_path / "bin.txt"))
    with pytest.raises(QevalError, match="is not a file, a folder, a shipped corpus"):
        load_corpus("no-such-corpus")
    assert "wikitext-2" in HF_ALIASES


def test_windows_follow_llama_perplexity_rules():
    tokens = np.arange(1000, dtype=np.int32)
    w = make_windows(tokens, 128, None)
    assert w.shape == (7, 128) and w[1, 0] == 128  # tail dropped, non-overlapping
    assert make_windows(tokens, 128, 3).shape == (3, 128)
    with pytest.raises(QevalError, match="gives 7 chunks of 128 tokens .1000 tokens in 1 document.s..; --chunks 8 asks for more"):
        make_windows(tokens, 128, 8)
    with pytest.raises(QevalError, match="a window of n_ctx 2048 needs 2048 tokens"):
        make_windows(tokens, 2048, None)
    with pytest.raises(QevalError, match="even number"):
        make_windows(tokens, 63, None)


def test_windows_never_span_two_documents():
    docs = [np.arange(300, dtype=np.int32), 1000 + np.arange(100, dtype=np.int32), 2000 + np.arange(260, dtype=np.int32)]
    w = make_windows(docs, 128, None)
    # 2 windows of the first document, none of the second (too short), 2 of the third: each from one document
    assert w.shape == (4, 128)
    assert [int(row[0]) for row in w] == [0, 128, 2000, 2128]
    assert all(int(row[-1]) - int(row[0]) == 127 for row in w)
    assert make_windows(docs, 128, 3).shape == (3, 128)
    with pytest.raises(QevalError, match="no document of corpus fills a window: the longest tokenizes to 300 tokens; "
                                         "a window of n_ctx 512 needs 512 tokens of one document"):
        make_windows(docs, 512, None)


def test_folder_is_a_list_of_documents_and_concat_joins_them(tmp_path):
    (tmp_path / "b.txt").write_text("second document", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first document ", encoding="utf-8")
    (tmp_path / "notes.md").write_text("ignored", encoding="utf-8")
    corpus = load_corpus(str(tmp_path))
    assert corpus.documents == ("first document ", "second document")
    ident = corpus.identity()
    assert ident["documents"] == 2 and ident["bytes"] == 30
    # document boundaries are part of the identity: the same bytes split differently are another corpus
    (tmp_path / "a.txt").write_text("first ", encoding="utf-8")
    (tmp_path / "b.txt").write_text("document second document", encoding="utf-8")
    assert load_corpus(str(tmp_path)).identity()["sha256"] != ident["sha256"]

    def tokenize(text):
        return np.array([ord(c) for c in text], dtype=np.int32)

    assert [len(t) for t in tokenize_documents(corpus, tokenize)] == [15, 15]
    assert [len(t) for t in tokenize_documents(corpus, tokenize, concat=True)] == [30]
    (tmp_path / "empty").mkdir()
    with pytest.raises(QevalError, match="holds no"):
        load_corpus(str(tmp_path / "empty"))


def test_single_document_identity_is_unchanged():
    """Stores captured before corpora were lists of documents keep their identity."""
    import hashlib

    corpus = load_corpus("austen-northanger-abbey")
    text = corpus.documents[0]
    assert corpus.identity()["sha256"] == hashlib.sha256(text.encode("utf-8")).hexdigest()
    assert "documents" not in corpus.identity()


def test_shipped_set_holds_every_shipped_corpus():
    corpus = load_corpus("shipped")
    assert len(corpus.documents) == len(shipped_names()) >= 2
