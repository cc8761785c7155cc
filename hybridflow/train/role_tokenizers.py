"""A policy-like role with a model of its own (a distillation teacher, a reference) shares the policy's tokenizer.

Such a role takes the log-probs of the token ids the policy sampled: under another tokenizer the same ids mean
other text, and its log-probs (a teacher's reverse KL, a reference's KL) are silently wrong. So the run refuses
it at start, in one line naming both models: a different vocabulary size, a token the two vocabularies number
differently, or a probe text (the run's first prompts and a fixed sentence) that encodes to different ids.
A directory without tokenizer files cannot be compared; its embedding must at least hold every id the policy
produces (``vocab_size`` in its config.json). Embedding sizes may differ (models pad them to different
multiples): only the tokenizers must agree. A role that only generates (an LLM judge, whose prompts a compute node
renders as text in its own tokens) may have any tokenizer. A ``teacher`` role needs a model of its own: by default
it would be the policy's starting weights, a teacher with nothing to teach.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from hybridflow.graph import Graph, Op, RoleKind
from hybridflow.models.tokenizer import load_tokenizer
from hybridflow.train.config import TrainConfig
from hybridflow.train.file_checks import model_config
from hybridflow.train.preflight import TOKENIZER_FILES

TEACHER = "teacher"  # the role name of hybridflow.algorithms.teacher
PROBE = "The quick brown fox jumps over 13 lazy dogs: (a+b)*c = 42, isn't it?\n"
_CHECKED_KINDS = (RoleKind.POLICY, RoleKind.FROZEN_POLICY)
_POLICY_ID_OPS = frozenset({Op.LOGPROB, Op.REF_LOGPROB, Op.UPDATE})  # what reads the token ids the policy sampled


def check_role_tokenizers(config: TrainConfig, graph: Graph, tokenizer: Any, texts: Iterable[str] = ()) -> None:
    """Raise a ValueError naming ``roles.<name>.model`` and the policy's model when a policy or frozen policy of
    ``graph`` with its own model does not share ``tokenizer`` (the policy's), or when a ``teacher`` role has no
    model of its own; ``texts``: prompts to probe with."""
    teacher = config.roles.get(TEACHER)
    if TEACHER in graph.role_names and (teacher is None or not teacher.model):
        raise ValueError(f"config key 'roles.{TEACHER}.model' is not set: the {graph.name} graph's {TEACHER} would be "
                         "the policy's own starting weights, which teach it nothing; set it to the teacher's local "
                         "HF directory")
    policy = repr(config.model.path) if config.model.path else f"the built-in {config.model.name}"
    probes = [PROBE, *texts]
    reads_policy_ids = graph.ops_by_role()
    for role in graph.roles:
        entry = config.roles.get(role.name)
        if role.kind not in _CHECKED_KINDS or entry is None or not entry.model:
            continue
        if not reads_policy_ids[role.name] & _POLICY_ID_OPS:  # a judge generates from prompts in its own tokens
            continue
        if config.model.path and Path(entry.model).resolve() == Path(config.model.path).resolve():
            continue
        problem = _mismatch(tokenizer, Path(entry.model).expanduser(), probes, f"roles.{role.name}.model", role.name)
        if problem:
            raise ValueError(f"config key 'roles.{role.name}.model'={entry.model!r} does not share the tokenizer of "
                             f"the policy's model ({policy}): {problem}; a {role.kind} role scores the token ids the "
                             "policy samples, so give it a model of the policy's tokenizer family")


def _mismatch(tokenizer: Any, directory: Path, probes: Sequence[str], key: str, name: str) -> str | None:
    """How ``directory``'s tokenizer differs from ``tokenizer``, or None when they agree."""
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        found = model_config(key, directory)
        vocab = found.get("vocab_size", (found.get("text_config") or {}).get("vocab_size"))
        if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab < len(tokenizer):
            return (f"it has no tokenizer files and its vocab_size={vocab} is smaller than the policy's "
                    f"{len(tokenizer)} tokens")
        return None
    theirs = load_tokenizer(directory)
    if len(theirs) != len(tokenizer):
        return f"vocabulary sizes differ (the policy's {len(tokenizer)} tokens, the {name}'s {len(theirs)})"
    ours_vocab, their_vocab = tokenizer.get_vocab(), theirs.get_vocab()
    for token, index in sorted(ours_vocab.items(), key=lambda item: item[1]):
        if their_vocab.get(token) != index:
            return f"token {token!r} is id {index} for the policy but {their_vocab.get(token)} for the {name}"
    for text in probes:
        ours, other = _ids(tokenizer, text), _ids(theirs, text)
        if ours != other:
            return f"{text[:40]!r} encodes to {ours[:8]}... for the policy but {other[:8]}... for the {name}"
    return None


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
