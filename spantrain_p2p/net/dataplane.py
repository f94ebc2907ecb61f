"""The data plane: a server per peer for bulk traffic (its client is ``client``).

Two ways in on one port, told apart by a connection's first four bytes (``connections``):
- **framed TCP** (what ``DataPlaneClient.send`` speaks, wire in ``wire``): on a peer's server a
  connection starts with the handshake (``handshake``) that binds it to the sender's libp2p
  identity; then requests follow, one at a time, each answered before the next. The server
  receives a frame straight into the buffer its tensors are then decoded from (no copy between the
  socket and the tensor), within a budget of connections and bytes (``budget``). A message's
  ``src`` must be the authenticated sender (it is filled in when absent), and ``policy(kind,
  sender)`` may refuse a kind to non-members;
- **HTTP** (aiohttp): ``GET /status`` and the other pages report the peer; in a closed swarm they
  need the operator token (``Authorization: Bearer TOKEN``, or ``?token=`` once, kept as a cookie
  for a browser). ``POST /msg/{kind}`` carries a frame only on a server without an
  ``Authenticator`` (tests, the raw benchmark): messages between peers are authenticated.
Both go through the same handlers and limits: a frame over the size limit gets 413 with the reason
(the framed server answers before the body has come, then drops it), a malformed frame 400, a
sender that is not who it says 403, an unknown kind 404, a handler that cannot take it yet (or a
budget that is spent) 503, a handler that fails 500.
"""
from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import logging
import math
import secrets
from typing import Any, Awaitable, Callable, Optional, Sequence

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from . import framing
from .addresses import is_unspecified, url_of
from .budget import Budget, Limits, LogBudget
from .connections import FirstBytes, FramedConnection
from .handshake import Authenticator
from .wire import RECV_BYTES, ANSWER, ANSWER_MAGIC, REQUEST, REQUEST_MAGIC, RemoteError, Retry  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

Reply = Optional[tuple[dict, Sequence[bytes | memoryview]]]
Handler = Callable[[dict, list[memoryview]], Awaitable[Reply]]
InlineHandler = Callable[[dict, list[memoryview]], Reply]


class LaneRefused(Exception):
    """Raised by a lane's ``accept`` that will not take a lane now (the sender sends through the
    event loop instead): 409."""


LaneAccept = Callable[[dict, list[memoryview]], Callable[[Any], None]]


def _lane_only(header: dict, buffers) -> Reply:
    raise framing.FrameError("this kind opens a lane: it is not a message (over HTTP or a framed connection's handler)")


class _MalformedRequests(logging.Filter):
    """aiohttp logs a request it cannot parse as an ERROR with a traceback and the bytes that failed
    (up to ~2 KB of escaped garbage a request: 28 such records in one suite run, from the fuzzing
    test). On a port open to the internet, bytes that are not HTTP (a scanner, a fuzzer, a client of
    another protocol) are the client's fault, not the server's: one line at WARNING, the parser's
    reason without the bytes, like the data plane's other refusals. A handler that fails stays an
    ERROR with its traceback. A line a source address every 10 s at most (``LogBudget``)."""

    def __init__(self):
        super().__init__()
        self.quiet = LogBudget()

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            remote = str((record.args or ("?",))[0])
            reason = next((line.strip() for line in str(exc.message or "").splitlines() if line.strip()), "")
            said = self.quiet.line(remote, "refused a malformed HTTP request from %s (%s): %s", remote, exc.code,
                                   reason.rstrip(":")[:120] or type(exc).__name__)
            if said is None:
                return False
            if record.levelno > logging.WARNING:  # (a bad method on a first request: aiohttp's debug, kept)
                record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg, record.args = said
            record.exc_info = record.exc_text = None
        return True


_http_log = logging.getLogger(__name__ + ".http")
_http_log.addFilter(_MalformedRequests())


class _Refused(Exception):
    """A message its connection's peer may not send (403)."""


class DataPlaneServer:
    def __init__(
        self,
        host: str,
        port: int,
        status: Callable[[], dict],
        max_message_bytes: int = framing.DEFAULT_MAX_MESSAGE_BYTES,
        auth: Optional[Authenticator] = None,
        limits: Limits = Limits(),
    ):
        self.host, self.port = host, port
        self.announced: list[str] = []  # the URLs others reach this server at, best first (set by the peer)
        self.max_message_bytes = max_message_bytes
        self.auth = auth
        self.budget = Budget(limits)
        self.quiet = LogBudget()  # what remotes make this server log: a line a source every 10 s at most
        # set by the peer: who counts as a member (for the budget), and which kinds a sender may send
        self.is_member: Callable[[str], bool] = lambda peer_id: True
        self.policy: Callable[[str, str], Optional[str]] = lambda kind, sender: None
        self._handlers: dict[str, Handler] = {}
        self._inline: set[str] = set()  # kinds whose handler is a plain function (``register``)
        self._lanes: dict[str, LaneAccept] = {}  # kinds that open a lane (``register_lane``)
        self._json_gets: dict[str, Callable[[], dict]] = {"/status": status}
        self._gets: dict[str, Callable[[], tuple[bytes, str]]] = {}
        self._async_json_gets: dict[str, Callable[[], Awaitable[dict]]] = {}
        self._runner: Optional[web.AppRunner] = None
        self._listener: Optional[asyncio.AbstractServer] = None
        self._framed: set[FramedConnection] = set()
        self._tasks: set[asyncio.Task] = set()
        self._scratch = bytearray(RECV_BYTES)  # where the framed server drops the body of a refused message
        # connections that open with another magic (``preambles``): magic -> (bytes after it, handler)
        self.preambles: dict[bytes, tuple[int, Callable[[asyncio.Transport, bytes], None]]] = {}

    def register(self, kind: str, handler: "Handler | InlineHandler", inline: bool = False) -> None:
        """``handler`` answers messages of ``kind``; ``inline``: it is a plain function that neither
        waits nor takes long (the tensors of a pipeline: checked and filed), run as its frame comes
        in (``dispatch_now``), not as a task of its own."""
        if inline and inspect.iscoroutinefunction(handler):
            raise TypeError(f"an inline handler is a plain function: {kind!r}'s is async")
        self._handlers[kind] = handler
        if inline:
            self._inline.add(kind)
        else:
            self._inline.discard(kind)

    def register_lane(self, kind: str, accept: "LaneAccept") -> None:
        """A request of ``kind`` asks to turn its connection into a lane (``lanes``): ``accept(header,
        buffers)`` (run at once, like an inline handler, after the same checks of the sender) raises
        to refuse it (``Retry``: 503, ``FrameError``: 400, ``LaneRefused``: 409), or returns what takes
        the connection's socket once it is answered 204 and off the event loop. Only on an
        authenticated connection that is not encrypted (two peers of one machine): 409 otherwise."""
        self._lanes[kind] = accept
        self._handlers[kind] = _lane_only
        self._inline.add(kind)

    def dispatch_lane(self, kind: str, body, sender: Optional[str], encrypted: bool
                      ) -> tuple[int, str, Optional[Callable[[Any], None]]]:
        """A lane request: (status, reason, what takes the socket: None unless the status is 204)."""
        if sender is None or encrypted:
            return 409, "a lane needs an authenticated connection between peers of one machine", None
        try:
            take = self._lanes[kind](*self._opened(kind, body, sender))
        except LaneRefused as e:
            return 409, str(e), None
        except Exception as e:
            status, reason = self._failed(kind, e, sender)
            return status, reason, None
        return 204, "", take

    def add_json_get(self, path: str, fn: Callable[[], dict]) -> None:
        """Serves ``GET path`` with the JSON ``fn()`` returns (before start)."""
        self._json_gets[path] = fn

    def add_get(self, path: str, fn: Callable[[], tuple[bytes, str]]) -> None:
        """Serves ``GET path`` with the body and content type ``fn()`` returns (before start)."""
        self._gets[path] = fn

    def add_async_json_get(self, path: str, fn: Callable[[], Awaitable[dict]]) -> None:
        """Serves ``GET path`` with the JSON ``await fn()`` returns (non-finite numbers as null)."""
        self._async_json_gets[path] = fn

    def local_json(self, path: str) -> Optional[dict]:
        """What ``GET path`` of this server answers, without a request (None: no such page)."""
        fn = self._json_gets.get(path)
        return fn() if fn is not None else None

    @property
    def url(self) -> str:
        """Where others reach this server: the first announced URL; else the bound address (loopback
        for an unspecified one: ``0.0.0.0`` means "this host" to whoever reads it)."""
        if self.announced:
            return self.announced[0]
        return url_of("127.0.0.1" if is_unspecified(self.host) else self.host, self.port)

    async def start(self) -> None:
        closed = self.auth is not None and self.auth.swarm_key is not None
        app = web.Application(client_max_size=self.max_message_bytes,
                              middlewares=[_operator_only(lambda: self.auth.operator_token)] if closed else [])
        for path, fn in self._json_gets.items():
            app.router.add_get(path, self._json_handler(fn))
        for path, raw in self._gets.items():
            app.router.add_get(path, self._raw_handler(raw))
        for path, afn in self._async_json_gets.items():
            app.router.add_get(path, self._async_json_handler(afn))
        if self.auth is None:
            app.router.add_post("/msg/{kind}", self._post_msg)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, logger=_http_log)
        await self._runner.setup()
        http = self._runner.server
        try:
            self._listener = await asyncio.get_running_loop().create_server(
                lambda: FirstBytes(self, http), self.host, self.port, reuse_address=False)
        except OSError as e:
            await self._runner.cleanup()
            self._runner = None
            raise OSError(e.errno, f"data plane cannot listen on {self.host}:{self.port}: {e.strerror}") from None
        self.port = self._listener.sockets[0].getsockname()[1]  # the real port when 0 was asked for

    async def page(self, path: str) -> Optional[dict]:
        """What ``GET path`` answers as JSON (None: no such JSON page), without HTTP."""
        fn = self._json_gets.get(path)
        if fn is not None:
            return _finite(fn())
        afn = self._async_json_gets.get(path)
        return _finite(await afn()) if afn is not None else None

    async def adopt(self, sock) -> asyncio.Transport:
        """Serves a connected socket this peer opened (a reversed, hole-punched or relayed connection)
        as if it had been accepted: the peer at its end is our client."""
        transport, _ = await asyncio.get_running_loop().connect_accepted_socket(
            lambda: FirstBytes(self, self._runner.server), sock=sock)
        return transport

    async def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for conn in list(self._framed):
            conn.transport.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @staticmethod
    def _json_handler(fn: Callable[[], dict]):
        async def handle(request: web.Request) -> web.Response:
            return web.json_response(fn())

        return handle

    @staticmethod
    def _async_json_handler(fn: Callable[[], Awaitable[dict]]):
        async def handle(request: web.Request) -> web.Response:
            return web.Response(body=json.dumps(_finite(await fn())).encode(), content_type="application/json")

        return handle

    @staticmethod
    def _raw_handler(fn: Callable[[], tuple[bytes, str]]):
        async def handle(request: web.Request) -> web.Response:
            body, content_type = fn()
            return web.Response(body=body, headers={"Content-Type": content_type})

        return handle

    def _refusal(self, kind: str, length: Optional[int]) -> Optional[tuple[int, str]]:
        """(status, reason) for a message refused before its body is read, else None."""
        if kind not in self._handlers:
            return 404, f"no handler for message kind {kind!r}"
        if length is not None and length > self.max_message_bytes:
            return 413, f"message of {length} bytes is over this peer's limit of {self.max_message_bytes}"
        return None

    def _opened(self, kind: str, body, sender: Optional[str]) -> tuple[dict, list[memoryview]]:
        """The frame's header and buffers, its ``src`` checked against the authenticated sender
        (``sender``; None: no handshake on this server) and the policy: ``_Refused`` if not allowed."""
        header, buffers = framing.decode(body, self.max_message_bytes)
        if sender is not None:
            src = header.setdefault("src", sender)
            if src != sender:
                self.quiet.warning(log, sender, "refused a %s message from %s claiming to be from %r", kind, sender, src)
                raise _Refused(f"this connection is authenticated as {sender}, not {str(src)[:60]}")
            refused = self.policy(kind, sender)
            if refused:
                raise _Refused(refused)
        return header, buffers

    def _failed(self, kind: str, e: Exception, sender: Optional[str] = None) -> tuple[int, str]:
        """The answer to a message whose decoding or handler raised ``e`` (``sender``: who sent it,
        None on a server without a handshake)."""
        if isinstance(e, _Refused):
            return 403, str(e)
        if isinstance(e, framing.FrameError):
            self.quiet.warning(log, f"{sender} {kind}", "rejected %s message: %s", kind, e)
            return 400, str(e)
        if isinstance(e, Retry):
            return 503, str(e)
        # a handler's bug: the sender hears of it, this peer carries on
        log.error("handler of %s messages failed", kind, exc_info=e)
        return 500, f"the {kind} handler failed: {type(e).__name__}: {e}"[:500]

    @staticmethod
    def _answered(reply: Reply) -> tuple[int, "str | list[bytes | memoryview]"]:
        return (204, "") if reply is None else (200, framing.encode(*reply))

    async def _dispatch(self, kind: str, body, sender: Optional[str] = None) -> tuple[int, "str | list[bytes | memoryview]"]:
        """Decodes a whole frame and runs its kind's handler: (status, reason or reply chunks).
        ``sender``: the peer the connection is authenticated as (None: no handshake on this server)."""
        if kind in self._inline:
            return self.dispatch_now(kind, body, sender)
        try:
            return self._answered(await self._handlers[kind](*self._opened(kind, body, sender)))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # (a reply that does not encode too: the sender hears of it)
            return self._failed(kind, e, sender)

    def dispatch_now(self, kind: str, body, sender: Optional[str] = None) -> tuple[int, "str | list[bytes | memoryview]"]:
        """``_dispatch`` of a kind whose handler is a plain function (``register(..., inline=True)``),
        run at once where the frame came in: no task, and no pause of the connection's reading."""
        try:
            return self._answered(self._handlers[kind](*self._opened(kind, body, sender)))
        except Exception as e:
            return self._failed(kind, e, sender)

    async def _read_body(self, request: web.Request, length: Optional[int]) -> bytearray:
        """The whole body, received straight into one buffer of its announced length (no regrowing
        and no final copy, unlike ``request.read()``); the buffers decoded from it are writable views
        a tensor can own without another copy."""
        if length is None:
            return bytearray(await request.read())
        body = bytearray(length)
        view, got = memoryview(body), 0
        while got < length:
            chunk = await request.content.readany()
            if not chunk:
                raise framing.FrameError(f"message ended after {got} of its {length} bytes")
            if got + len(chunk) > length:
                raise framing.FrameError(f"message is longer than its announced {length} bytes")
            view[got:got + len(chunk)] = chunk
            got += len(chunk)
        return body

    async def _post_msg(self, request: web.Request) -> web.StreamResponse:
        kind = request.match_info["kind"]
        refused = self._refusal(kind, request.content_length)
        if refused is not None:
            return web.Response(status=refused[0], text=refused[1])
        try:
            body = await self._read_body(request, request.content_length)
        except web.HTTPRequestEntityTooLarge:
            return web.Response(
                status=413, text=f"message is over this peer's limit of {self.max_message_bytes} bytes"
            )
        except framing.FrameError as e:
            return web.Response(status=400, text=str(e))
        status, out = await self._dispatch(kind, body)
        if isinstance(out, str):
            return web.Response(status=status, text=out) if out else web.Response(status=status)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-spantrain-frame"})
        resp.content_length = framing.frame_size(out)
        await resp.prepare(request)
        for c in out:
            await resp.write(c)
        await resp.write_eof()
        return resp


def _operator_only(current_token: Callable[[], Optional[str]]):
    """aiohttp middleware: a closed swarm's pages need its operator token (a header, or ``?token=``
    once: a browser keeps it as a cookie for the page's own requests). ``current_token()`` is read
    per request: a grouped swarm's token is known once its group key is (until then, no page)."""

    @web.middleware
    async def check(request: web.Request, handler):
        token = current_token() or secrets.token_hex(16)  # none yet: nothing matches
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip() or \
            request.query.get("token") or request.cookies.get("spantrain_token", "")
        if not hmac.compare_digest(given.encode(), token.encode()):
            return web.Response(status=401, text="this swarm is closed: give its operator token "
                                "(spantrain keygen prints it; Authorization: Bearer TOKEN or ?token=TOKEN)")
        resp = await handler(request)
        if "token" in request.query:
            resp.set_cookie("spantrain_token", token, httponly=True, samesite="Strict")
        return resp

    return check


def _finite(x: Any) -> Any:
    """``x`` with every NaN or infinity as None (JSON has neither; browsers refuse them)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x
