"""The ``retrieval`` tool: BM25 search over a local corpus, in pure Python.

The corpus is a ``.jsonl`` file (one ``{"id": ..., "text": ...}`` per line) or a directory of ``.txt`` files
(the id is the path relative to it). The index is built once per factory call, so one environment (or one
worker) indexes its corpus once and every call searches it.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hybridflow.agents.protocols import Tool
from hybridflow.registry import TOOLS

_WORD = re.compile(r"\w+")


def tokenize(text: str) -> list[str]:
    """Lower-case words (runs of letters, digits and ``_``)."""
    return _WORD.findall(text.lower())


@dataclass(frozen=True, kw_only=True)
class Passage:
    """One searchable text and its id."""

    id: str
    text: str


class BM25Index:
    """Okapi BM25 (``k1``, ``b``) over passages, with the non-negative idf ``ln(1 + (N - df + .5) / (df + .5))``."""

    def __init__(self, passages: Sequence[Passage], *, k1: float = 1.5, b: float = 0.75) -> None:
        self.passages, self.k1, self.b = tuple(passages), k1, b
        self._postings: dict[str, list[tuple[int, int]]] = {}  # term -> [(passage index, term count)]
        self._lengths: list[int] = []
        for index, passage in enumerate(self.passages):
            counts = Counter(tokenize(passage.text))
            self._lengths.append(sum(counts.values()))
            for term, count in counts.items():
                self._postings.setdefault(term, []).append((index, count))
        self._mean_length = sum(self._lengths) / len(self._lengths) if self._lengths else 0.0

    def idf(self, term: str) -> float:
        frequency = len(self._postings.get(term, ()))
        return math.log(1.0 + (len(self.passages) - frequency + 0.5) / (frequency + 0.5))

    def search(self, query: str, top_k: int) -> list[tuple[Passage, float]]:
        """The ``top_k`` best-scoring passages with a positive score, best first (ties: corpus order)."""
        scores: dict[int, float] = {}
        for term in set(tokenize(query)):
            idf = self.idf(term)
            for index, count in self._postings.get(term, ()):
                norm = self.k1 * (1.0 - self.b + self.b * self._lengths[index] / (self._mean_length or 1.0))
                scores[index] = scores.get(index, 0.0) + idf * count * (self.k1 + 1.0) / (count + norm)
        best = sorted(scores.items(), key=lambda item: (-item[1], item[0]))[:top_k]
        return [(self.passages[index], score) for index, score in best]


def load_corpus(corpus: str | os.PathLike[str]) -> list[Passage]:
    """The passages of a ``.jsonl`` file or a directory of ``.txt`` files; errors name the file and line."""
    path = Path(corpus)
    if path.is_dir():
        files = sorted(path.rglob("*.txt"))
        if not files:
            raise ValueError(f"retrieval tool: corpus={str(corpus)!r} is a directory without .txt files")
        return [Passage(id=str(file.relative_to(path)), text=file.read_text(encoding="utf-8")) for file in files]
    if not path.is_file():
        raise FileNotFoundError(f"retrieval tool: corpus={str(corpus)!r} does not exist; pass corpus= a .jsonl "
                                'file (one {"id": ..., "text": ...} per line) or a directory of .txt files')
    passages = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"retrieval tool: {path}:{number} is not JSON ({exc.msg})") from exc
            if not isinstance(record, dict) or "id" not in record or not isinstance(record.get("text"), str):
                raise ValueError(f'retrieval tool: {path}:{number} must be {{"id": ..., "text": "..."}}')
            passages.append(Passage(id=str(record["id"]), text=record["text"]))
    if not passages:
        raise ValueError(f"retrieval tool: corpus={str(corpus)!r} holds no passages")
    return passages


def retrieval_tool(*, corpus: str | os.PathLike[str] | None = None, top_k: int = 3,
                   max_passage_chars: int = 1000, timeout_s: float = 10.0) -> Tool:
    """The ``retrieval`` tool: a ``query`` argument -> the ``top_k`` best passages of ``corpus``, with ids."""
    if corpus is None:
        raise ValueError("retrieval tool: set corpus= to a .jsonl file or a directory of .txt files "
                         "(tool_options={'retrieval': {'corpus': PATH}})")
    if top_k < 1:
        raise ValueError(f"retrieval tool: top_k={top_k} must be >= 1")
    index = BM25Index(load_corpus(corpus))

    def search(query: str) -> str:
        hits = index.search(query, top_k)
        if not hits:
            return "no passage matches the query; try other words"
        return "\n\n".join(f"[{rank}] {passage.id}: {passage.text[:max_passage_chars]}"
                           for rank, (passage, _) in enumerate(hits, start=1))

    return Tool(
        name="retrieval",
        description="Search the document collection; returns the best-matching passages with their ids.",
        parameters={"type": "object",
                    "properties": {"query": {"type": "string", "description": "words to search for"}},
                    "required": ["query"]},
        fn=search,
        timeout_s=timeout_s,
    )


TOOLS.add("retrieval", retrieval_tool)
