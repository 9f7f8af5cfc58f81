"""Corpora: files, shipped names, hub datasets (through `datasets`, on local data), chunking rules."""

from __future__ import annotations

import numpy as np
import pytest

from qeval.capture.corpus import HF_ALIASES, load_corpus, make_windows, parse_hf_spec, shipped_names
from qeval.errors import QevalError

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
    with pytest.raises(QevalError, match="is not a file, a shipped corpus"):
        load_corpus("no-such-corpus")
    assert "wikitext-2" in HF_ALIASES


def test_windows_follow_llama_perplexity_rules():
    tokens = np.arange(1000, dtype=np.int32)
    w = make_windows(tokens, 128, None)
    assert w.shape == (7, 128) and w[1, 0] == 128  # tail dropped, non-overlapping
    assert make_windows(tokens, 128, 3).shape == (3, 128)
    with pytest.raises(QevalError, match="tokenizes to 1000 tokens = 7 chunks of 128; --chunks 8 asks for more"):
        make_windows(tokens, 128, 8)
    with pytest.raises(QevalError, match="needs at least 1024"):
        make_windows(tokens, 512, None)
    with pytest.raises(QevalError, match="even number"):
        make_windows(tokens, 63, None)
