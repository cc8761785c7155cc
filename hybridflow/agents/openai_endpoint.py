"""An OpenAI-compatible HTTP endpoint on the rollout worker, one URL per trajectory.

Agent code written against the ``openai`` SDK talks to ``{endpoint.url}/t/{trajectory_id}/v1``; each request is
handed to that trajectory's :class:`ChatHandler` (the :class:`~hybridflow.agents.openai_agent.OpenAIAgentEnvironment`
of its row), which answers it with the turn the policy sampled. The server only routes: it holds no token and
no conversation state, so the agent loop keeps owning the tokens it trains on.

Routes: ``POST /t/{id}/v1/chat/completions`` and ``GET /t/{id}/v1/models``. Errors are OpenAI-shaped
(``{"error": {"message", "type", "code"}}``) with ``x-should-retry: false``, since a retried turn would be a
different turn: 400 a bad body, 404 an unknown trajectory, 409 a conversation that does not extend the previous
request, 410 a trajectory that ended while its request waited, 504 a rollout that did not answer in time.

Standard library only (``http.server`` on ``127.0.0.1``, an ephemeral port, a daemon thread); no torch.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

_ROUTE = re.compile(r"^/t/(?P<trajectory>[A-Za-z0-9_-]+)/v1/(?P<route>chat/completions|models)/?$")
MAX_BODY_BYTES = 64 * 1024 * 1024


class EndpointError(Exception):
    """A request the endpoint refuses: its HTTP status and the OpenAI error ``type`` and ``code``."""

    def __init__(self, status: int, message: str, *, code: str, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.type = status, message, code, type

    def payload(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": None}}


class ChatHandler(Protocol):
    """One trajectory's side of the endpoint. Both methods run on the server's request threads and may block
    (bounded: they raise :class:`EndpointError` with status 504 rather than wait forever)."""

    def chat_completion(self, body: dict[str, Any]) -> dict[str, Any]:
        """A ``chat.completion`` object for the request ``body``, or :class:`EndpointError`."""
        ...

    def models(self) -> dict[str, Any]:
        """The ``GET /models`` list."""
        ...


class _Server(ThreadingHTTPServer):
    """Every trajectory's agent connects at once at a step's start: a listen backlog of socketserver's default 5
    overflows under load and the kernel resets connections the SDK (``max_retries=0``) then fails on."""

    request_queue_size = 1024


class OpenAIEndpoint:
    """A threading HTTP server on ``127.0.0.1`` routing ``/t/{id}/v1/...`` to registered :class:`ChatHandler` s."""

    def __init__(self) -> None:
        self._handlers: dict[str, ChatHandler] = {}
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), _handler_class(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="openai-endpoint", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def base_url(self, trajectory_id: str) -> str:
        """What the SDK takes as ``base_url`` for one trajectory."""
        return f"{self.url}/t/{trajectory_id}/v1"

    def register(self, handler: ChatHandler) -> str:
        """Route a fresh trajectory id to ``handler``; returns the id."""
        trajectory_id = uuid.uuid4().hex
        with self._lock:
            self._handlers[trajectory_id] = handler
        return trajectory_id

    def unregister(self, trajectory_id: str) -> None:
        """Later requests to ``trajectory_id`` get 404 (no-op if it is not registered)."""
        with self._lock:
            self._handlers.pop(trajectory_id, None)

    def handler(self, trajectory_id: str) -> ChatHandler:
        with self._lock:
            found = self._handlers.get(trajectory_id)
        if found is None:
            raise EndpointError(HTTPStatus.NOT_FOUND, f"no trajectory {trajectory_id!r} on this rollout (it ended, "
                                "or the base_url is not the one the environment gave the agent)",
                                code="trajectory_not_found")
        return found

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)


def _handler_class(endpoint: OpenAIEndpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the SDK's connection pool expects

        def do_GET(self) -> None:
            self._answer("GET")

        def do_POST(self) -> None:
            self._answer("POST")

        def _answer(self, method: str) -> None:
            try:
                body = self._read_body() if method == "POST" else None
                status, payload = HTTPStatus.OK, self._route(method, body)
            except EndpointError as err:
                status, payload = HTTPStatus(err.status), err.payload()
            except Exception as err:  # a handler bug must reach the agent as a 500, not a dropped connection
                logging.getLogger(__name__).exception("openai endpoint: %s %s failed", method, self.path)
                status = HTTPStatus.INTERNAL_SERVER_ERROR
                payload = EndpointError(status, f"{type(err).__name__}: {err}", code="internal_error",
                                        type="server_error").payload()
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("x-should-retry", "false")
            self.end_headers()
            self.wfile.write(data)

        def _read_body(self) -> dict[str, Any]:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                raise EndpointError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"request body of {length} bytes",
                                    code="body_too_large")
            raw = self.rfile.read(length)
            try:
                body = json.loads(raw or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise EndpointError(HTTPStatus.BAD_REQUEST, f"the request body is not JSON: {err}",
                                    code="invalid_json") from err
            if not isinstance(body, dict):
                raise EndpointError(HTTPStatus.BAD_REQUEST, "the request body must be a JSON object",
                                    code="invalid_body")
            return body

        def _route(self, method: str, body: dict[str, Any] | None) -> dict[str, Any]:
            match = _ROUTE.match(self.path.split("?", 1)[0])
            route = match["route"] if match else None
            if match is None or (route == "models") != (method == "GET"):
                raise EndpointError(HTTPStatus.NOT_FOUND, f"no route {method} {self.path}; this endpoint serves "
                                    "POST /t/{id}/v1/chat/completions and GET /t/{id}/v1/models",
                                    code="unknown_route")
            handler = endpoint.handler(match["trajectory"])
            if route == "models":
                return handler.models()
            assert body is not None
            return handler.chat_completion(body)

        def log_message(self, format: str, *args: Any) -> None:
            logging.getLogger(__name__).debug("openai endpoint: " + format, *args)

    return Handler


_ENDPOINT: OpenAIEndpoint | None = None
_ENDPOINT_LOCK = threading.Lock()


def openai_endpoint() -> OpenAIEndpoint:
    """This process's endpoint, started on first use and shared by every trajectory the process rolls out."""
    global _ENDPOINT
    with _ENDPOINT_LOCK:
        if _ENDPOINT is None:
            _ENDPOINT = OpenAIEndpoint()
        return _ENDPOINT
