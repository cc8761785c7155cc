"""The ``python`` tool: model-written code run in a limited subprocess.

What the sandbox does, for each call:

- runs ``sys.executable -I`` (isolated: no ``PYTHON*`` variables, no user site, no script dir on ``sys.path``)
  in a new session (process group), with a nearly empty environment and a fresh temporary scratch directory as
  its working directory, deleted afterwards;
- sets resource limits in the child: CPU seconds, address space (``memory_mb``), file size, open files, no core
  dumps; the wall-clock ``timeout_s`` kills the whole process group;
- captures stdout and stderr together, reads them as they come and keeps at most ``max_output_chars``;
- installs an audit hook (:func:`sys.addaudithook`, from a bootstrap passed with ``-c``) before the code runs
  that refuses network use (``socket.connect`` / ``bind`` / ``sendto`` / ``getaddrinfo`` ...), new processes
  (``subprocess.Popen``, ``os.system``, ``os.exec*``, ``os.fork``, ``os.posix_spawn``, ``os.kill``), ``ctypes``
  and any file access outside the scratch directory, except reading the interpreter's own ``sys.path``
  (stdlib, site-packages: imports need them) and a few devices (``/dev/null``, ``/dev/urandom``);
- where ``unshare -rn`` works (Linux user namespaces), also runs the child in an empty network namespace. The
  audit hook does not rely on it.

What it does not protect against: audit hooks are **not a security boundary**. They see only what CPython
reports; native code (a C extension, a crafted bytecode object, an interpreter bug) and some calls without an
audit event (``os.stat``, ``dbm``) pass them, and the limits do not hide the host's processes or the files
readable on ``sys.path``. The sandbox stops the accidents of a policy that is learning to write code (an
infinite loop, a huge allocation, ``rm -rf``, a stray network call), not an adversary. For untrusted code, run
the rollout workers in containers (gVisor, Firecracker, a locked-down Docker) as well.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass

from hybridflow.agents.protocols import Tool
from hybridflow.registry import TOOLS

MAX_FILE_BYTES = 64 * 1024 * 1024
MAX_OPEN_FILES = 64
STARTUP_SLACK_S = 10.0
"""How much longer than ``timeout_s`` the runner waits for the tool: start-up, the kill and clean-up."""

_BOOTSTRAP_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_bootstrap.py")


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """The limits of one run; validated on construction."""

    timeout_s: float = 5.0
    memory_mb: int = 512
    max_output_chars: int = 4000

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"python tool: timeout_s={self.timeout_s} must be > 0")
        if self.memory_mb < 64:
            raise ValueError(f"python tool: memory_mb={self.memory_mb} must be >= 64 (the interpreter needs it)")
        if self.max_output_chars < 200:
            raise ValueError(f"python tool: max_output_chars={self.max_output_chars} must be >= 200")


@functools.cache
def _bootstrap_source() -> str:
    with open(_BOOTSTRAP_PATH, encoding="utf-8") as handle:
        return handle.read()


@functools.cache
def network_namespace_available() -> bool:
    """Whether ``unshare -rn`` (a user + network namespace) works on this machine."""
    if sys.platform != "linux" or shutil.which("unshare") is None:
        return False
    try:
        probe = subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0


def run_python(code: str, *, limits: SandboxLimits | None = None, isolate_network: bool | None = None) -> str:
    """Run ``code`` in the sandbox; its output, then a trailing ``error: ...`` / ``killed: ...`` line if any.

    ``isolate_network``: also use ``unshare -rn`` (``None``: where it works). Output beyond
    ``limits.max_output_chars`` is dropped with a note; an empty output reads ``(no output)``.
    """
    limits = limits or SandboxLimits()
    if isolate_network is None:
        isolate_network = network_namespace_available()
    scratch = tempfile.mkdtemp(prefix="hybridflow-sandbox-")
    status_read, status_write = os.pipe()
    try:
        command = [sys.executable, "-I", "-X", "utf8", "-c", _bootstrap_source(), scratch,
                   str(math.ceil(limits.timeout_s) + 1), str(limits.memory_mb), str(MAX_FILE_BYTES),
                   str(MAX_OPEN_FILES), str(status_write)]
        if isolate_network:
            command = ["unshare", "-rn", *command]
        env = {"PATH": os.defpath, "LANG": "C.UTF-8", "HOME": scratch, "TMPDIR": scratch,
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, cwd=scratch, env=env, start_new_session=True,
                                   pass_fds=(status_write,))
        os.close(status_write)
        status_write = -1
        output = _OutputReader(process, code, limit_bytes=4 * limits.max_output_chars)
        killed = False
        try:
            process.wait(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            killed = True
        output.join()
        status = _read_all(status_read).strip()
        tail = _tail_line(process.returncode, killed=killed, status=status, limits=limits)
        return _compose(output.text(), output.dropped_bytes, tail, limits.max_output_chars)
    finally:
        for fd in (status_read, status_write):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(scratch, ignore_errors=True)


class _OutputReader:
    """Feeds the code on stdin and drains stdout+stderr on a thread, keeping the first ``limit_bytes``."""

    def __init__(self, process: subprocess.Popen[bytes], code: str, *, limit_bytes: int) -> None:
        self.process, self.limit_bytes = process, limit_bytes
        self.kept = bytearray()
        self.dropped_bytes = 0
        self._thread = threading.Thread(target=self._drain, name="hybridflow-sandbox-output", daemon=True)
        self._thread.start()
        assert process.stdin is not None
        try:
            process.stdin.write(code.encode("utf-8", errors="replace"))  # lone surrogates
            process.stdin.close()
        except (BrokenPipeError, OSError):  # the child died before reading its code; its status says why
            pass

    def _drain(self) -> None:
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        while chunk := os.read(fd, 65536):
            room = self.limit_bytes - len(self.kept)
            self.kept += chunk[:max(0, room)]
            self.dropped_bytes += max(0, len(chunk) - max(0, room))

    def join(self) -> None:
        self._thread.join(timeout=10)
        assert self.process.stdout is not None
        self.process.stdout.close()

    def text(self) -> str:
        return self.kept.decode("utf-8", errors="replace")


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _read_all(fd: int) -> str:
    """What the exited child wrote to ``fd``; never blocks, even if an escaped grandchild holds the pipe open."""
    os.set_blocking(fd, False)
    chunks = []
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", errors="replace")


def _tail_line(returncode: int, *, killed: bool, status: str, limits: SandboxLimits) -> str:
    """The trailing line: the child's own error report, or why it was stopped."""
    if killed:
        return f"killed: time limit ({limits.timeout_s} s)"
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return "killed: time limit (CPU seconds)"
    if returncode < 0:
        name = signal.Signals(-returncode).name
        return f"killed: {name} (perhaps the memory limit of {limits.memory_mb} MB)"
    if status:
        return status[:500]
    return f"error: exit status {returncode}" if returncode else ""


def _compose(body: str, dropped_bytes: int, tail: str, max_chars: int) -> str:
    """``body`` cut so that it, the truncation note and ``tail`` fit in ``max_chars``."""
    room = max_chars - len(tail) - 80
    if len(body) > room or dropped_bytes:
        dropped = max(0, len(body) - room) + dropped_bytes
        body = f"{body[:room]}\n... [output truncated: {dropped} characters dropped]\n"
    body = body.rstrip("\n")
    if not body and not tail:
        return "(no output)"
    return f"{body}\n{tail}" if body and tail else body + tail


def python_tool(*, timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 4000) -> Tool:
    """The ``python`` tool: runs a ``code`` argument in the sandbox and returns what it printed."""
    limits = SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb, max_output_chars=max_output_chars)

    def run(code: str) -> str:
        return run_python(code, limits=limits)

    return Tool(
        name="python",
        description=(f"Run Python 3 code and return what it prints (stdout and stderr). Limits: {timeout_s} s, "
                     f"{memory_mb} MB, no network, files only in the current directory."),
        parameters={"type": "object",
                    "properties": {"code": {"type": "string", "description": "the program; print the results"}},
                    "required": ["code"]},
        fn=run,
        timeout_s=timeout_s + STARTUP_SLACK_S,
    )


TOOLS.add("python", python_tool)
