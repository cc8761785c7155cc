"""The python sandbox: each limit holds (time, memory, network, files, processes, output size)."""

from __future__ import annotations

import os
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hybridflow.agents.protocols import ToolCall
from hybridflow.agents.sandbox import SandboxLimits, network_namespace_available, python_tool, run_python
from hybridflow.agents.tools import run_tool_calls
from hybridflow.registry import TOOLS

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox's limits are tested on Linux")


def test_output_then_the_error_line() -> None:
    out = run_python("print('a')\nprint('b', file=__import__('sys').stderr)\n1 / 0")
    assert out == "a\nb\nerror: ZeroDivisionError: division by zero (line 3)"
    assert run_python("x = 1") == "(no output)"


def test_an_infinite_loop_is_killed_at_the_timeout() -> None:
    start = time.monotonic()
    out = run_python("while True:\n    pass", limits=SandboxLimits(timeout_s=1.0))
    assert time.monotonic() - start < 3.0
    assert out.endswith("killed: time limit (1.0 s)")


def test_allocating_2_gb_fails_under_a_512_mb_limit() -> None:
    out = run_python("data = bytearray(2 * 1024 ** 3)\nprint('allocated')", limits=SandboxLimits(memory_mb=512))
    assert "allocated" not in out and "memory limit (512 MB)" in out


@pytest.mark.parametrize("isolate_network", [False, None], ids=["audit-hook-alone", "default"])
def test_a_socket_connect_to_localhost_is_refused(isolate_network: bool | None) -> None:
    with socket.socket() as server:  # a live listener: a refusal here is the sandbox's, not the kernel's
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))\nprint('connected')"
        out = run_python(code, isolate_network=isolate_network)
    assert "connected" not in out and "socket.connect is not allowed" in out


def test_name_lookups_and_binding_are_refused() -> None:
    out = run_python("import socket\nsocket.getaddrinfo('localhost', 80)", isolate_network=False)
    assert "socket.getaddrinfo is not allowed" in out
    out = run_python("import socket\nsocket.socket().bind(('127.0.0.1', 0))", isolate_network=False)
    assert "socket.bind is not allowed" in out


def test_files_outside_the_scratch_directory_are_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret")
    for code in (f"print(open({str(secret)!r}).read())", f"open({str(tmp_path / 'new.txt')!r}, 'w')",
                 f"import os\nos.remove({str(secret)!r})", f"import os\nprint(os.listdir({str(tmp_path)!r}))",
                 f"import os\nos.symlink({str(secret)!r}, 'link')\nprint(open('link').read())"):
        out = run_python(code)
        assert "top secret" not in out and "is not allowed" in out, (code, out)
    assert secret.read_text() == "top secret" and not (tmp_path / "new.txt").exists()
    if Path("/etc/hostname").exists():
        assert "open of /etc/hostname is not allowed" in run_python("print(open('/etc/hostname').read())")


def test_writing_in_scratch_works_and_the_scratch_is_deleted() -> None:
    code = ("import os\nopen('notes.txt', 'w').write('kept')\nos.mkdir('sub')\n"
            "print(open('notes.txt').read(), sorted(os.listdir('.')))\nprint(os.getcwd())")
    kept, scratch = run_python(code).splitlines()
    assert kept == "kept ['notes.txt', 'sub']"
    assert Path(scratch).name.startswith("hybridflow-sandbox-") and not Path(scratch).exists()


def test_imports_from_the_standard_library_still_work() -> None:
    out = run_python("import json, math, collections, re, tempfile\nprint(json.dumps([math.factorial(5)]))\n"
                     "with tempfile.TemporaryFile() as handle:\n    print(handle.write(b'ok'))")
    assert out == "[120]\n2"


def test_processes_and_signals_are_refused() -> None:
    assert "subprocess.Popen is not allowed" in run_python("import subprocess\nsubprocess.run(['true'])")
    assert "os.system is not allowed" in run_python("import os\nos.system('true')")
    assert "os.fork is not allowed" in run_python("import os\nos.fork()")
    assert "os.kill is not allowed" in run_python(f"import os\nos.kill({os.getpid()}, 9)")


def test_huge_output_is_capped() -> None:
    out = run_python("print('x' * 5_000_000)\nprint('done')", limits=SandboxLimits(max_output_chars=1000))
    assert len(out) <= 1000 and "characters dropped" in out
    endless = run_python("while True:\n    print('y' * 1000)", limits=SandboxLimits(timeout_s=0.5,
                                                                                  max_output_chars=1000))
    assert len(endless) <= 1000 and endless.endswith("killed: time limit (0.5 s)")


def test_the_registered_tool_runs_code_and_validates_options() -> None:
    tool = TOOLS.get("python")(timeout_s=2.0, memory_mb=256)
    assert tool.name == "python" and tool.timeout_s > 2.0  # the sandbox reports its own kill first
    assert tool.fn(code="print(sum(range(10)))") == "45"
    with pytest.raises(ValueError, match="memory_mb=8 must be >= 64"):
        python_tool(memory_mb=8)


def test_two_sandboxed_calls_of_a_turn_run_at_once() -> None:
    tools = {"python": python_tool(timeout_s=3.0)}
    calls = [ToolCall(name="python", arguments={"code": f"import time\ntime.sleep(0.5)\nprint({i})"}) for i in range(2)]
    with ThreadPoolExecutor(2) as executor:
        start = time.monotonic()
        results = run_tool_calls(calls, tools, executor=executor)
        elapsed = time.monotonic() - start
    assert [r.content for r in results] == ["0", "1"] and elapsed < 0.95, elapsed
    assert "\ud800" not in run_python("print('\ud800')")  # a lone surrogate in the code does not break the call


def test_network_namespace_probe_is_a_bool() -> None:
    assert isinstance(network_namespace_available(), bool)
