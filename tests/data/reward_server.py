"""A reward service on loopback for the tests: ``serve()`` yields a :class:`Service` whose ``answer`` decides each
reply and whose ``requests`` (and ``headers``) record what it got."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# What the service answers a request: (status, body, extra headers); a body that is a list of bytes goes chunked.
Answer = tuple[int, bytes | list[bytes], dict[str, str]]


@dataclass
class Service:
    """A loopback service: ``answer`` decides each reply; ``requests`` are the JSON bodies it got, in order, and
    ``headers`` their headers."""

    url: str
    answer: Callable[[Any], Answer]
    requests: list[Any] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    in_flight: int = 0
    most_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def json_answer(value: Any, status: int = 200) -> Answer:
    return status, json.dumps(value).encode(), {"Content-Type": "application/json"}


def _handler(service: Service) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with service.lock:
                service.requests.append(body)
                service.headers.append(dict(self.headers))
                service.in_flight += 1
                service.most_in_flight = max(service.most_in_flight, service.in_flight)
            try:
                status, payload, headers = service.answer(body)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                if isinstance(payload, list):
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for part in payload:
                        self.wfile.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
                    self.wfile.write(b"0\r\n\r\n")
                else:
                    if "Content-Length" not in headers:
                        self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up on a slow or huge answer
                pass
            finally:
                with service.lock:
                    service.in_flight -= 1

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


@contextmanager
def serve(path: str = "/get_reward") -> Iterator[Service]:
    """A service at ``http://127.0.0.1:<free port><path>``, answering every batch request with rewards of 1.0."""
    made = Service(url="", answer=lambda body: json_answer({"rewards": [1.0] * len(body["query"])}))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(made))
    server.daemon_threads = True
    made.url = f"http://127.0.0.1:{server.server_address[1]}{path}"
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield made
    finally:
        server.shutdown()
        server.server_close()
