"""A tiny OpenAI-style completions server for the server-fleet tests (stdlib only, run as a script).

``python fake_openai_server.py PORT [flags]``. ``GET /health`` answers 200 (never, with ``--unhealthy``);
``GET /v1/models`` names the model ``policy`` and its ``max_model_len`` (``--max-model-len N``, default 2048);
``POST /v1/completions`` with a token-id ``prompt`` returns ``max_tokens`` ids counting up from the prompt's last
id, log-probs ``-0.1 * (i + 1)``, and this server's port as the id, so a test can tell which replica served a
request.

``--dev-mode``: it answers the weight-sync calls (``/pause``, ``/collective_rpc``, ``/reset_prefix_cache``,
``/resume``, ``/v1/load_lora_adapter``) as a vLLM server in dev mode does (404 without). Every completion and sync
call is one line of its log (``served`` / ``sync <path> <weights_path or lora_path>``), in order.
``--fail-reload-once FILE``: the first ``/collective_rpc`` of whichever server finds no FILE creates it and
answers 500 (one failed weight sync across restarts). ``--spawn-child`` also starts a sleeping child in the same
process group (a stand-in for vLLM's engine core), whose pid the server prints to its log. ``--slow``: each
completion takes 0.5 s (requests still in flight when a test kills the server); ``--slow-sync``: so does each
``/pause`` (a weight sync still under way when a test kills the router).
``--end-id N``: a completion is at most ``TURN_TOKENS`` ids, the last ``N`` (an agent's turn that ends), each also
logged as ``turn {"session", "prompt", "ids", "logprobs"}`` (the ``X-Session-ID`` it arrived with and the prompt
ids it continued).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TURN_TOKENS = 4
LOG_LOCK = threading.Lock()


def log(line: str) -> None:
    """One whole line of the log: the handler threads run concurrently, and ``print`` writes text and newline apart."""
    with LOG_LOCK:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


class Handler(BaseHTTPRequestHandler):
    unhealthy = False
    slow = False
    slow_sync = False
    dev_mode = False
    end_id: int | None = None
    fail_reload_once = ""
    max_model_len = 2048

    def log_message(self, format: str, *args: object) -> None:  # quiet
        return

    def _send(self, status: int, payload: object) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health" and not self.unhealthy:
            self._send(200, {})
        elif self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": "policy", "max_model_len": self.max_model_len}]})
        else:
            self._send(503 if self.path == "/health" else 404, {"detail": "no"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        path = self.path.split("?")[0]
        if self.dev_mode and path == "/collective_rpc" and self.fail_reload_once \
                and not os.path.exists(self.fail_reload_once):
            open(self.fail_reload_once, "w").close()
            log("sync failed")
            self._send(500, {"error": {"message": "reload_weights failed (injected)"}})
            return
        if self.dev_mode and path in ("/pause", "/collective_rpc", "/reset_prefix_cache", "/resume",
                                      "/v1/load_lora_adapter"):
            loaded = (body.get("kwargs") or {}).get("weights_path") or body.get("lora_path") or "-"
            log(f"sync {path} {loaded}")
            if self.slow_sync and path == "/pause":
                time.sleep(0.5)
            self._send(200, {})
            return
        if self.path != "/v1/completions":
            self._send(404, {"detail": "Not Found"})
            return
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not prompt:
            self._send(400, {"error": {"message": "prompt must be a non-empty list of token ids"}})
            return
        log("served")
        if self.slow:
            time.sleep(0.5)
        tokens = [int(prompt[-1]) + 1 + i for i in range(int(body.get("max_tokens", 1)))]
        if self.end_id is not None:
            tokens = [*tokens[:TURN_TOKENS - 1], self.end_id][:len(tokens)]
        logprobs = {"token_logprobs": [-0.1 * (i + 1) for i in range(len(tokens))]} if "logprobs" in body else None
        if self.end_id is not None:
            log("turn " + json.dumps({"session": self.headers.get("X-Session-ID"), "prompt": prompt, "ids": tokens,
                                      "logprobs": (logprobs or {}).get("token_logprobs")}))
        choice = {"index": 0, "text": "", "token_ids": tokens, "logprobs": logprobs,
                  "finish_reason": "length"}
        self._send(200, {"id": str(self.server.server_address[1]), "object": "text_completion", "choices": [choice]})


def main() -> None:
    port = int(sys.argv[1])
    Handler.unhealthy = "--unhealthy" in sys.argv
    Handler.slow = "--slow" in sys.argv
    Handler.slow_sync = "--slow-sync" in sys.argv
    Handler.dev_mode = "--dev-mode" in sys.argv
    if "--end-id" in sys.argv:
        Handler.end_id = int(sys.argv[sys.argv.index("--end-id") + 1])
    if "--fail-reload-once" in sys.argv:
        Handler.fail_reload_once = sys.argv[sys.argv.index("--fail-reload-once") + 1]
    if "--max-model-len" in sys.argv:
        Handler.max_model_len = int(sys.argv[sys.argv.index("--max-model-len") + 1])
    if "--spawn-child" in sys.argv:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        log(f"child {child.pid}")
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    log(f"listening on {port}")
    server.serve_forever()


if __name__ == "__main__":
    main()
