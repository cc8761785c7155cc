"""One line per failure for the ``hybridflow`` command: exit 2 for bad input, 1 for a run that failed.

The line says what went wrong and, where we know it, the fix; the traceback is printed only with
``--debug``. Causes buried in a chain (a full disk under a torch serialisation error, a permission error
under a Hugging Face one) are looked for along ``__cause__``/``__context__`` and named plainly.
"""

from __future__ import annotations

import errno
import sys
from collections.abc import Iterator

from hybridflow.train.signals import Terminated

BAD_INPUT = 2
RUN_FAILED = 1
INTERRUPTED = 130
TERMINATED = 143  # 128 + SIGTERM, what a shell reports for a process SIGTERM ended


# Exceptions our validation raises for a config, data file, graph or plan it refuses.
_BAD_INPUT_TYPES: tuple[type[BaseException], ...] = (ValueError, KeyError, TypeError, AttributeError, ImportError,
                                                     FileNotFoundError, NotADirectoryError, IsADirectoryError,
                                                     SyntaxError, LookupError)


def describe(err: BaseException) -> tuple[int, str]:
    """``(exit code, one line)`` for ``err``."""
    if isinstance(err, Terminated):  # a run's own says which checkpoint it wrote (hybridflow/train/preemption.py)
        return TERMINATED, f"terminated (SIGTERM) {err}" if str(err) else \
            "terminated (SIGTERM); a run resumes from its last checkpoint with --resume"
    if isinstance(err, KeyboardInterrupt):
        return INTERRUPTED, "interrupted; a run resumes from its last checkpoint with --resume"
    chain = list(_chain(err))
    for link in chain:
        if _is_disk_full(link):
            return RUN_FAILED, (f"no space left on device{_where(link)}: free some space or set output_dir to a "
                                f"disk with room ({_first_line(err)})")
    if isinstance(err, PermissionError):  # raised by our checks, with the config key in the message
        return BAD_INPUT, _first_line(err)
    for link in chain:
        if isinstance(link, PermissionError):
            return RUN_FAILED, f"permission denied{_where(link)}: make it writable or choose another path"
    # Not imported (it would load torch, via hybridflow.runtime): a step error exists only if a run imported it.
    runtime_errors = sys.modules.get("hybridflow.runtime.errors")
    if runtime_errors is not None and isinstance(err, runtime_errors.RuntimeStepError):
        return RUN_FAILED, _first_line(err)
    if _yaml_error(err):
        return BAD_INPUT, f"invalid YAML: {_yaml_line(err)}"
    if isinstance(err, _BAD_INPUT_TYPES):
        if isinstance(err, SyntaxError):
            return BAD_INPUT, f"syntax error in {err.filename}, line {err.lineno}: {err.msg}"
        return BAD_INPUT, _first_line(err)
    if isinstance(err, MemoryError):
        return RUN_FAILED, "out of memory; lower data.batch_size or micro_batch_size, or use more GPUs"
    if isinstance(err, OSError | RuntimeError | TimeoutError):
        return RUN_FAILED, f"{type(err).__name__}: {_first_line(err)}"
    return RUN_FAILED, f"unexpected {type(err).__name__}: {_first_line(err)} (rerun with --debug for the traceback)"


def _chain(err: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _is_disk_full(err: BaseException) -> bool:
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(err)
    # torch.save on a full disk raises "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
    # (or "... file write failed"), with no OSError in the chain (tested by saving to /dev/full).
    return "No space left on device" in text or (
        "inline_container.cc" in text and ("unexpected pos" in text or "write" in text))


def _where(err: BaseException) -> str:
    name = getattr(err, "filename", None)
    return f" ({name})" if name else ""


def _first_line(err: BaseException) -> str:
    if isinstance(getattr(err, "problems", None), list) and len(err.problems) > 1:  # type: ignore[attr-defined]
        return str(err)  # a config's bad keys, all of them, one per line (hybridflow.train.aliases)
    text = err.args[0] if isinstance(err, KeyError) and len(err.args) == 1 and isinstance(err.args[0], str) \
        else str(err)
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def _yaml_error(err: BaseException) -> bool:
    try:
        import yaml
    except ImportError:
        return False
    return isinstance(err, yaml.YAMLError)


def _yaml_line(err: BaseException) -> str:
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or _first_line(err)
    if mark is None:
        return str(problem)
    return f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}: {problem}"
