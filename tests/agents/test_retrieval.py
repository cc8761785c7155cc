"""BM25 retrieval: the passage about the query ranks first; corpus errors name the option."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.agents.retrieval import BM25Index, Passage, load_corpus, retrieval_tool
from hybridflow.registry import TOOLS

PASSAGES = [
    {"id": "paris", "text": "Paris is the capital of France. The Eiffel Tower stands in Paris."},
    {"id": "berlin", "text": "Berlin is the capital of Germany and its largest city."},
    {"id": "python", "text": "Python is a programming language created by Guido van Rossum."},
    {"id": "snakes", "text": "The python is a large snake. Pythons live in Africa, Asia and Australia."},
]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in PASSAGES) + "\n\n")
    return path


def test_the_passage_about_the_query_ranks_first(corpus: Path) -> None:
    tool = TOOLS.get("retrieval")(corpus=str(corpus), top_k=2)
    found = tool.fn(query="Who created the Python programming language?")
    assert found.startswith("[1] python: Python is a programming language")
    assert "[2] " in found and "[3] " not in found
    assert tool.fn(query="capital of Germany").startswith("[1] berlin:")
    assert tool.fn(query="zzz qqq").startswith("no passage matches")


def test_rare_terms_outweigh_common_ones() -> None:
    index = BM25Index([Passage(id=p["id"], text=p["text"]) for p in PASSAGES])
    assert index.idf("eiffel") > index.idf("capital") > index.idf("is") > 0
    (best, score), *_ = index.search("the Eiffel capital", top_k=4)
    assert best.id == "paris" and score > 0


def test_a_directory_of_txt_files(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    for passage in PASSAGES:
        (tmp_path / "docs" / f"{passage['id']}.txt").write_text(passage["text"])
    tool = retrieval_tool(corpus=str(tmp_path / "docs"), top_k=1)
    assert tool.fn(query="large snake in Africa").startswith("[1] snakes.txt:")


def test_corpus_errors_name_the_option(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="set corpus="):
        retrieval_tool()
    with pytest.raises(FileNotFoundError, match=r"corpus='.*missing.jsonl' does not exist"):
        retrieval_tool(corpus=str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "text": "ok"}\n{"id": 2}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 must be"):
        load_corpus(bad)
