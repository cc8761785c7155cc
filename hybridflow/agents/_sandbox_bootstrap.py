"""The sandbox child's first code (passed with ``python -I -c``): limits, the audit hook, then the model's code.

Arguments: scratch directory, CPU seconds, memory MB, max file bytes, max open files, status fd. The code comes
on stdin. A failure is reported as one ``error: ...`` line on the status fd, which the parent appends after the
(capped) output. Plain stdlib only: it runs before anything else in the child. See ``sandbox.py``.
"""

from __future__ import annotations

import os
import resource
import signal
import sys
from typing import Any

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_DEVICES_READ = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
_REFUSED = frozenset({
    "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
    "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo",
    "subprocess.Popen", "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.forkpty",
    "os.kill", "os.killpg", "signal.pthread_kill", "pty.spawn", "os.startfile",
    "sqlite3.enable_load_extension", "sqlite3.load_extension",
})
# event -> positions of (path, dir_fd) pairs whose paths are written; dir_fd None when the event has none.
_CTYPES = frozenset({"ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function"})
_WRITE_EVENTS: dict[str, tuple[tuple[int, int | None], ...]] = {
    "os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),), "os.chmod": ((0, 2),),
    "os.chown": ((0, 3),), "os.utime": ((0, 3),), "os.truncate": ((0, None),), "os.symlink": ((1, 2),),
    "os.rename": ((0, 2), (1, 3)), "os.link": ((0, 2), (1, 3)), "os.setxattr": ((0, None),),
    "os.removexattr": ((0, None),), "shutil.rmtree": ((0, None),), "os.chdir": ((0, None),),
}
_READ_EVENTS = frozenset({"os.listdir", "os.scandir", "os.getxattr", "os.listxattr"})


class SandboxRefusal(PermissionError):
    """An operation the sandbox does not allow."""


class NativeCodeRefusal(ImportError):
    """``ctypes`` refused: an ImportError, so libraries that treat ctypes as optional (numpy) still import."""


def _set_limits(cpu_s: int, memory_mb: int, file_bytes: int, open_files: int) -> None:
    for limit, value in ((resource.RLIMIT_CPU, cpu_s), (resource.RLIMIT_AS, memory_mb * 1024 * 1024),
                         (resource.RLIMIT_FSIZE, file_bytes), (resource.RLIMIT_NOFILE, open_files),
                         (resource.RLIMIT_CORE, 0)):
        _, hard = resource.getrlimit(limit)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        # CPU: SIGXCPU at the soft limit, SIGKILL one second later; the hard limits cannot be raised back.
        resource.setrlimit(limit, (value, value + 1 if limit == resource.RLIMIT_CPU else value))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a too-large write raises OSError instead of killing


def _install_hook(scratch: str) -> None:
    realpath, join, getcwd, isdir, readlink = os.path.realpath, os.path.join, os.getcwd, os.path.isdir, os.readlink
    fspath, fsdecode, sep = os.fspath, os.fsdecode, os.sep
    roots = tuple(sorted({realpath(entry) for entry in sys.path if entry and os.path.exists(entry)}))
    # Locals, not module globals: the model's code can reach this module as ``__main__``.
    refused, native, write_events, read_events = _REFUSED, _CTYPES, _WRITE_EVENTS, _READ_EVENTS
    devices, write_flags = _DEVICES_READ, _WRITE_FLAGS

    def resolve(path: Any, dir_fd: Any = None) -> str:
        # dir_fd: an fd, or None / a negative number (the events' "no dir_fd") for the working directory
        base = readlink(f"/proc/self/fd/{dir_fd}") if isinstance(dir_fd, int) and dir_fd >= 0 else getcwd()
        name = fsdecode(fspath(path))
        return realpath(join(base, name))

    def inside(path: str, folders: tuple[str, ...]) -> bool:
        return any(path == folder or path.startswith(folder + sep) for folder in folders)

    def check_write(path: str, event: str) -> None:
        if not inside(path, (scratch,)) and path != "/dev/null":
            raise SandboxRefusal(f"sandbox: {event} outside the working directory is not allowed ({path})")

    def check_read(path: str, event: str, *, directories: bool) -> None:
        if inside(path, (scratch,)) or path in devices:
            return
        # No directory fds from outside: they could anchor writes through dir_fd, which ``open`` does not report.
        if not inside(path, roots) or (not directories and isdir(path)):
            raise SandboxRefusal(f"sandbox: {event} of {path} is not allowed (only the working directory)")

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event in refused:
            raise SandboxRefusal(f"sandbox: {event} is not allowed (no network, processes or native calls)")
        if event in native:
            raise NativeCodeRefusal(f"sandbox: {event} is not allowed (ctypes is not available)")
        if event == "open":
            path, mode, flags = args
            if path is None or isinstance(path, int):  # an fd already open
                return
            writes = (isinstance(flags, int) and flags & write_flags) or \
                (isinstance(mode, str) and any(c in mode for c in "wax+"))
            if writes:
                check_write(resolve(path), "open")
            else:
                check_read(resolve(path), "open", directories=False)
        elif event in write_events:
            for path_at, fd_at in write_events[event]:
                path = args[path_at]
                if path is not None and not isinstance(path, int):
                    check_write(resolve(path, None if fd_at is None else args[fd_at]), event)
        elif event in read_events and args and args[0] is not None and not isinstance(args[0], int):
            check_read(resolve(args[0]), event, directories=True)
        elif event == "sqlite3.connect" and args and fsdecode(fspath(args[0])) != ":memory:":
            check_write(resolve(args[0]), event)

    sys.addaudithook(hook)


def _error_line(exc: BaseException, memory_mb: int) -> str:
    line = ""
    traceback = exc.__traceback__
    while traceback is not None:
        if traceback.tb_frame.f_code.co_filename == "<tool>":
            line = f" (line {traceback.tb_lineno})"
        traceback = traceback.tb_next
    if isinstance(exc, MemoryError):
        return f"error: memory limit ({memory_mb} MB): MemoryError{line}"
    return f"error: {type(exc).__name__}: {exc}{line}"


def main() -> None:
    scratch, cpu_s, memory_mb, file_bytes, open_files, status_fd = sys.argv[1], *map(int, sys.argv[2:7])
    code = sys.stdin.read()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # stdout and stderr interleave in order
    scratch = os.path.realpath(scratch)
    _set_limits(cpu_s, memory_mb, file_bytes, open_files)
    _install_hook(scratch)
    status = ""
    try:
        exec(compile(code, "<tool>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as exc:
        if exc.code not in (None, 0):
            status = f"error: exit status {exc.code}"
    except BaseException as exc:  # whatever the code raised is reported to the model, not re-raised
        status = _error_line(exc, memory_mb)
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(status_fd, status.encode("utf-8", errors="replace"))
    os.close(status_fd)


if __name__ == "__main__":
    main()
