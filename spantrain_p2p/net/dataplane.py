"""The data plane: an aiohttp server per peer for bulk traffic, and its client.

``POST /msg/{kind}`` carries one frame (see ``framing``) to the handler registered for ``kind``;
the handler's reply is framed back. ``GET /status`` reports the peer. Sizes are capped: a body
over the limit gets 413 with the reason, a malformed frame 400, an unknown kind 404.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Awaitable, Callable, Optional, Sequence

import aiohttp
from aiohttp import web

from . import framing

log = logging.getLogger(__name__)

Reply = Optional[tuple[dict, Sequence[bytes | memoryview]]]
Handler = Callable[[dict, list[memoryview]], Awaitable[Reply]]


class Retry(Exception):
    """Raised by a handler that cannot take the message yet (e.g. it has no stage map): 503."""


class RemoteError(RuntimeError):
    """The other peer refused a message; ``status`` is the HTTP code, the message its reason."""

    def __init__(self, status: int, reason: str):
        super().__init__(f"{status}: {reason}")
        self.status = status
        self.reason = reason


class DataPlaneServer:
    def __init__(
        self,
        host: str,
        port: int,
        status: Callable[[], dict],
        max_message_bytes: int = framing.DEFAULT_MAX_MESSAGE_BYTES,
    ):
        self.host, self.port = host, port
        self.max_message_bytes = max_message_bytes
        self._handlers: dict[str, Handler] = {}
        self._json_gets: dict[str, Callable[[], dict]] = {"/status": status}
        self._runner: Optional[web.AppRunner] = None

    def register(self, kind: str, handler: Handler) -> None:
        self._handlers[kind] = handler

    def add_json_get(self, path: str, fn: Callable[[], dict]) -> None:
        """Serves ``GET path`` with the JSON ``fn()`` returns (before start)."""
        self._json_gets[path] = fn

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        app = web.Application(client_max_size=self.max_message_bytes)
        for path, fn in self._json_gets.items():
            app.router.add_get(path, self._json_handler(fn))
        app.router.add_post("/msg/{kind}", self._post_msg)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=False)
        try:
            await site.start()
        except OSError as e:
            await self._runner.cleanup()
            self._runner = None
            raise OSError(e.errno, f"data plane cannot listen on {self.host}:{self.port}: {e.strerror}") from None
        sock = site._server.sockets[0]  # the real port when 0 was asked for
        self.port = sock.getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @staticmethod
    def _json_handler(fn: Callable[[], dict]):
        async def handle(request: web.Request) -> web.Response:
            return web.json_response(fn())

        return handle

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
        handler = self._handlers.get(kind)
        if handler is None:
            return web.Response(status=404, text=f"no handler for message kind {kind!r}")
        length = request.content_length
        if length is not None and length > self.max_message_bytes:
            return web.Response(
                status=413, text=f"message of {length} bytes is over this peer's limit of {self.max_message_bytes}"
            )
        try:
            body = await self._read_body(request, length)
        except web.HTTPRequestEntityTooLarge:
            return web.Response(
                status=413, text=f"message is over this peer's limit of {self.max_message_bytes} bytes"
            )
        except framing.FrameError as e:
            return web.Response(status=400, text=str(e))
        try:
            header, buffers = framing.decode(body, self.max_message_bytes)
            reply = await handler(header, buffers)
        except framing.FrameError as e:
            log.warning("rejected %s message: %s", kind, e)
            return web.Response(status=400, text=str(e))
        except Retry as e:
            return web.Response(status=503, text=str(e))
        if reply is None:
            return web.Response(status=204)
        chunks = framing.encode(*reply)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-spantrain-frame"})
        resp.content_length = framing.frame_size(chunks)
        await resp.prepare(request)
        for c in chunks:
            await resp.write(c)
        await resp.write_eof()
        return resp


class DataPlaneClient:
    """One pooled HTTP session for all outgoing data-plane traffic of a peer."""

    def __init__(self, max_message_bytes: int = framing.DEFAULT_MAX_MESSAGE_BYTES):
        self.max_message_bytes = max_message_bytes
        self._session: Optional[aiohttp.ClientSession] = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def send(
        self, url: str, kind: str, header: dict, buffers: Sequence[bytes | memoryview] = (), timeout: float = 30.0,
        link=None, compensate: bool = True,
    ) -> tuple[dict, list[memoryview]] | None:
        """Posts one frame; the reply frame, or None if the peer had nothing to say.

        ``link`` (an ``emulator.EmulatedLink``) shapes the exchange like a wide-area link: the body
        leaves at the link's rate after its delay, the reply comes back likewise. ``timeout`` bounds
        the whole exchange, emulated time included. ``compensate=False`` keeps the real loopback
        transport's own round trip on top of the emulated one (the emulator leaves it out by default):
        for a caller that takes off a baseline of its own, like the prober's paired pings.
        """
        chunks = framing.encode(header, buffers)
        size = framing.frame_size(chunks)
        ex = link.exchange(compensate) if link is not None else None

        async def plain_body():
            for c in chunks:
                yield c

        async def exchange():
            reply, size_back = None, 0
            async with self._get_session().post(
                f"{url}/msg/{kind}", data=ex.body(chunks) if ex else plain_body(),
                timeout=aiohttp.ClientTimeout(total=timeout), headers={"Content-Length": str(size)},
            ) as resp:
                if ex:
                    ex.reply_started()
                if resp.status != 204:
                    if resp.status != 200:
                        raise RemoteError(resp.status, (await resp.text())[:500])
                    if resp.content_length is not None and resp.content_length > self.max_message_bytes:
                        raise RemoteError(413, f"reply of {resp.content_length} bytes is over our limit")
                    data = bytearray()
                    async for part in resp.content.iter_any():
                        data += part
                        if len(data) > self.max_message_bytes:
                            raise RemoteError(413, f"reply is over our limit of {self.max_message_bytes} bytes")
                    reply, size_back = framing.decode(data, self.max_message_bytes), len(data)
            if ex:
                await ex.reply_done(size_back)
            return reply

        return await asyncio.wait_for(exchange(), timeout)

    async def status(self, url: str, timeout: float = 5.0, path: str = "/status") -> dict:
        async with self._get_session().get(f"{url}{path}", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            resp.raise_for_status()
            return json.loads(await resp.text())
