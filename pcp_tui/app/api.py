"""The operator API: a run's state as JSON and Prometheus metrics over HTTP, and a cancel command.

`OperatorAPI` is a hand-written ASGI app served by hypercorn beside the
shepherd, in the same trio program (`run_with_api`, which the headless mode, the
dashboard and the demo run the shepherd under), so it reads `RunState` in the trio thread between
two steps of the run: what it returns is always one consistent moment, and no
lock is needed. It only reads the state and calls the stop command it was given.

    GET  /healthz          the process answers (no token)
    GET  /readyz           200 once the graphs are exported and workers can join (no token)
    GET  /v1/controller    run id, version, addresses, status
    GET  /v1/job           round, losses, tokens/s, utilization, ETA
    GET  /v1/workers       one object per worker the run has seen
    GET  /v1/metrics       totals and the latest rounds, as JSON
    GET  /metrics          the same in the Prometheus text format (`pcp_` prefix)
    POST /v1/job/cancel    end the run for good after the current round, as the dashboard's q
                           does: the goodbye tells the workers to exit, not to wait

Everything but /healthz and /readyz needs `Authorization: Bearer <token>`, the
token coming from the environment variable `--api-token-env` names. What a
client sends can end its own connection (hypercorn answers malformed HTTP with
400 and drops slow or oversized requests), never the run; at most
`api_connections.MAX_CONNECTIONS` are open at once (more are answered 503).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, NamedTuple

import outcome
import trio
from hypercorn.config import Config as HypercornConfig
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

from pcp_tui.app.api_bodies import (
    RunCollector,
    controller_json,
    job_json,
    metrics_json,
    workers_json,
)
from pcp_tui.app.api_connections import CappedServer
from pcp_tui.config import ConfigError, RunConfig
from pcp_tui.shepherd.coordinator import RunFailed, Shepherd
from pcp_tui.shepherd.run.events import StopRequested
from pcp_tui.shepherd.run.state import FINISHED, RunState, finite_or_null
from pcp_tui.shepherd.serving.listening import EVERYWHERE, address_for_others

__all__ = ["OperatorAPI", "bearer_token", "run_with_api"]

Scope = Mapping[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class Answer(NamedTuple):
    """One HTTP response, built in full before a byte of it is sent."""

    status: int
    body: bytes
    content_type: bytes = b"application/json"
    headers: tuple[tuple[bytes, bytes], ...] = ()


class Route(NamedTuple):
    method: str  # GET routes answer HEAD too
    answer: Callable[[Scope], Answer]
    public: bool = False  # True: no bearer token needed


def bearer_token(config: RunConfig, environ: Mapping[str, str] = os.environ) -> str:
    """The API's bearer token, from the variable `config.operator.api_token_env` names.

    Raises ConfigError when it is unset or empty: an operator API that can
    cancel the run is never served without a token.
    """
    token = environ.get(config.operator.api_token_env, "")
    if not token:
        raise ConfigError(
            f"--api-port {config.operator.api_port} needs a bearer token: set the environment variable "
            f"{config.operator.api_token_env} (or name another one with --api-token-env)"
        )
    return token


class OperatorAPI:
    """The ASGI app plus the hypercorn server that runs it beside the shepherd.

    With the shepherd's `--tls-cert` it speaks HTTPS with that certificate, so
    the bearer token never crosses a network in the clear.

    `bind()` takes the port synchronously, so a busy port fails before the run
    starts (with an OSError the caller words); `serve()` runs until `close()`.
    """

    def __init__(
        self,
        state: RunState,
        request_stop: Callable[[str], None],
        *,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: tuple[str, str] | None = None,
    ):
        self.state = state
        self.tls = tls  # (certificate, key) PEM files: HTTPS, as the workers' link
        self._request_stop = request_stop
        self._token_digest = hashlib.sha256(token.encode()).digest()
        self.host, self.port = host, port
        self.address = ""  # "host:port" once bound
        self._socket: socket.socket | None = None
        self._closed = trio.Event()
        self.server: CappedServer | None = None  # once serving
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(RunCollector(state))
        self._routes = {
            "/healthz": Route("GET", lambda _: _json(200, {"status": "ok"}), public=True),
            "/readyz": Route("GET", self._readyz, public=True),
            "/v1/controller": Route("GET", lambda _: _json(200, controller_json(self.state))),
            "/v1/job": Route("GET", lambda _: _json(200, job_json(self.state))),
            "/v1/workers": Route("GET", lambda _: _json(200, workers_json(self.state))),
            "/v1/metrics": Route("GET", lambda _: _json(200, metrics_json(self.state))),
            "/metrics": Route("GET", self._prometheus),
            "/v1/job/cancel": Route("POST", self._cancel),
        }

    @classmethod
    def from_config(
        cls, config: RunConfig, state: RunState, request_stop: Callable[[str], None]
    ) -> OperatorAPI | None:
        """The API `config` asks for (None with `api_port` 0); ConfigError without a token."""
        if not config.operator.api_port:
            return None
        cert, key = config.security.tls_cert, config.security.tls_key  # both or neither
        return cls(
            state,
            request_stop,
            token=bearer_token(config),
            host=config.operator.api_host,
            port=config.operator.api_port,
            tls=(cert, key) if cert and key else None,
        )

    @property
    def url(self) -> str:
        """Where clients reach the API once bound: https with --tls-cert, else http."""
        return f"{'https' if self.tls else 'http'}://{self.address}"

    def bind(self, *, advertise: str | None = None) -> str:
        """Listen on host:port now; returns the "host:port" clients use. Raises OSError.

        `advertise` replaces the host in that address: a wildcard such as
        0.0.0.0 is where the API listens, not where anyone can reach it.
        """
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self._socket = socket.create_server((self.host, self.port), family=family)
        host, port = self._socket.getsockname()[:2]
        host = advertise or host
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return self.address

    async def serve(self) -> None:
        """Serve until `close()`; requests in flight then get a second to finish."""
        if self._socket is None:
            self.bind()
        config = HypercornConfig()
        config.accesslog = None
        config.errorlog = logging.getLogger(__name__)  # not stderr: that would tear the dashboard
        config.graceful_timeout = 1.0
        config.read_timeout = 10  # a client that stops sending loses its connection
        config.include_server_header = False
        if self.tls:
            config.certfile, config.keyfile = self.tls
        self.server = CappedServer(self, config)  # MAX_CONNECTIONS at once; more get a 503
        listening, self._socket = self._socket, None  # the server owns (and closes) it now
        assert listening is not None, "bind() above opened it"
        await self.server.serve(listening, self._closed)

    def close(self) -> None:
        """Stop serving (the run ended); safe to call twice, or before `serve`."""
        self._closed.set()
        if self._socket is not None and self._socket.fileno() >= 0:
            self._socket.close()

    # -- ASGI ------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI entry point hypercorn calls once per request (and once for lifespan)."""
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
        elif scope["type"] == "http":
            await _respond(send, self.answer(scope), head=scope["method"] == "HEAD")
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})

    def answer(self, scope: Scope) -> Answer:
        """Route one request: 404 unknown path, 405 wrong method, 401 bad token, else the handler.

        The request body is never read: no endpoint takes one.
        """
        path = scope["path"].rstrip("/") or "/"
        route = self._routes.get(path)
        if route is None:
            return _json(404, {"error": f"no such endpoint: {path}"})
        method = scope["method"]
        if method != route.method and not (route.method == "GET" and method == "HEAD"):
            allow = route.method.encode() + (b", HEAD" if route.method == "GET" else b"")
            return _json(405, {"error": f"{path} takes {route.method}"}, (b"allow", allow))
        if not route.public and not self._authorized(scope):
            return _json(
                401,
                {"error": "missing or wrong token: send the header Authorization: Bearer <token>"},
                (b"www-authenticate", b'Bearer realm="pcp-tui"'),
            )
        return route.answer(scope)

    def _authorized(self, scope: Scope) -> bool:
        """One `Authorization: Bearer <token>` header whose token matches, in constant time.

        Both sides are hashed first, so the comparison leaks not even the token's length.
        """
        values = [value for name, value in scope["headers"] if name.lower() == b"authorization"]
        if len(values) != 1:
            return False
        scheme, _, given = values[0].strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return hmac.compare_digest(hashlib.sha256(given.strip()).digest(), self._token_digest)

    # -- handlers ----------------------------------------------------------------

    def _readyz(self, scope: Scope) -> Answer:
        if self.state.finished_at is not None:
            return _json(503, {"ready": False, "reason": f"the run ended ({self.state.status})"})
        if not self.state.address:
            return _json(503, {"ready": False, "reason": "exporting the training graphs"})
        return _json(200, {"ready": True, "address": self.state.address})

    def _prometheus(self, scope: Scope) -> Answer:
        return Answer(200, generate_latest(self._registry), CONTENT_TYPE_LATEST.encode())

    def _cancel(self, scope: Scope) -> Answer:
        """End the run for good after the current round, as the dashboard's q does (the workers
        exit: the goodbye is not resumable); 409 once the run ended."""
        if self.state.finished_at is not None or self.state.status in FINISHED:
            return _json(409, {"error": f"the run already ended ({self.state.status})"})
        client = (scope.get("client") or ("an unknown address",))[0]
        self._request_stop("cancelled through the operator API")
        self.state.emit(
            StopRequested(
                f"operator API: cancel from {client}; ending the run for good after the current "
                "round (the workers exit)",
            )
        )
        return _json(202, {"status": "stopping", "round": self.state.round})


async def _lifespan(receive: Receive, send: Send) -> None:
    """Acknowledge startup and shutdown: the API has nothing to open or close."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _respond(send: Send, answer: Answer, *, head: bool) -> None:
    headers = [
        (b"content-type", answer.content_type),
        (b"content-length", str(len(answer.body)).encode()),
        (b"cache-control", b"no-store"),
        *answer.headers,
    ]
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if head else answer.body})


def _json(status: int, data: Any, *headers: tuple[bytes, bytes]) -> Answer:
    body = json.dumps(finite_or_null(data), allow_nan=False).encode() + b"\n"
    return Answer(status, body, headers=headers)


async def run_with_api(shepherd: Shepherd, *, task_status=trio.TASK_STATUS_IGNORED) -> RunState:
    """`shepherd.run()` with its operator API (`--api-port`) serving beside it; the bare run
    without one. Raises RunFailed as the run does.

    The API serves from before the graphs are exported (so /healthz and /readyz answer
    during a long export) until the run ends; its port is taken first, so a busy one
    fails the run at once.
    """
    api = OperatorAPI.from_config(shepherd.config, shepherd.state, shepherd.cancel)
    if api is None:
        return await shepherd.run(task_status=task_status)
    try:
        shepherd.state.api_address = api.bind(
            advertise=address_for_others() if api.host in EVERYWHERE else None
        )
    except OSError as exc:
        raise RunFailed(
            f"cannot serve the operator API on {api.host}:{api.port} "
            f"({exc.strerror or exc}); pick another --api-port or --api-host"
        ) from None
    shepherd.state.api_url = api.url
    async with trio.open_nursery() as nursery:
        nursery.start_soon(api.serve)
        result = await outcome.acapture(shepherd.run, task_status=task_status)
        api.close()
    return result.unwrap()  # RunFailed leaves bare, not wrapped in the nursery's group
