"""Finding a swarm: checked multiaddrs for ``--join``, and zeroconf (mDNS) on a LAN for ``--join auto``.

A peer that advertises registers ``<peer id>._spantrain._tcp.local.`` with TXT entries ``swarm``
(the swarm name) and ``m0``, ``m1``, … (its multiaddrs, each ending in ``/p2p/<peer id>``).
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from typing import Iterable, Optional

from hivemind.utils.multiaddr import Multiaddr

log = logging.getLogger(__name__)

SERVICE_TYPE = "_spantrain._tcp.local."
MAX_ADVERTISED = 4


def parse_join(addrs: Iterable[str]) -> list[str]:
    """Checks ``--join`` multiaddrs; ValueError naming the first malformed one."""
    out = []
    for a in addrs:
        try:
            m = Multiaddr(a)
        except Exception as e:
            raise ValueError(f"malformed multiaddr {a!r}: {e}") from None
        protos = [p.name for p in m.protocols()]
        if "p2p" not in protos:
            raise ValueError(f"malformed multiaddr {a!r}: it must end with /p2p/<peer id>")
        if not ({"ip4", "ip6", "dns", "dns4", "dns6"} & set(protos)) or "tcp" not in protos:
            raise ValueError(f"malformed multiaddr {a!r}: it needs an address and a tcp port")
        out.append(str(m))
    return out


def _maddr_host_port(maddr: str) -> Optional[tuple[str, int]]:
    try:
        m = Multiaddr(maddr)
        return m.value_for_protocol("ip4"), int(m.value_for_protocol("tcp"))
    except Exception:
        return None


class Advertiser:
    """Keeps this peer's multiaddrs registered on mDNS while it runs."""

    def __init__(self, peer_id: str, swarm: str, maddrs: list[str]):
        self.peer_id, self.swarm, self.maddrs = peer_id, swarm, maddrs[:MAX_ADVERTISED]
        self._zc = None
        self._info = None

    async def start(self) -> None:
        from zeroconf import IPVersion, ServiceInfo
        from zeroconf.asyncio import AsyncZeroconf

        hosts = [hp for hp in map(_maddr_host_port, self.maddrs) if hp]
        if not hosts:
            raise ValueError("no IPv4 multiaddr to advertise")
        addresses = sorted({socket.inet_aton(h) for h, _ in hosts if not ipaddress.ip_address(h).is_unspecified})
        props = {"swarm": self.swarm, **{f"m{i}": m for i, m in enumerate(self.maddrs)}}
        self._info = ServiceInfo(
            SERVICE_TYPE,
            f"{self.peer_id}.{SERVICE_TYPE}",
            addresses=addresses or [socket.inet_aton("127.0.0.1")],
            port=hosts[0][1],
            properties=props,
        )
        self._zc = AsyncZeroconf(ip_version=IPVersion.V4Only)
        await self._zc.async_register_service(self._info)
        log.info("advertising on mDNS as %s", self._info.name)

    async def stop(self) -> None:
        if self._zc is not None:
            try:
                await self._zc.async_unregister_service(self._info)
            finally:
                await self._zc.async_close()
                self._zc = None


async def browse(swarm: str, timeout: float = 5.0, exclude: str = "") -> list[str]:
    """Multiaddrs of peers of ``swarm`` found on mDNS within ``timeout`` seconds (may be empty)."""
    from zeroconf import IPVersion, ServiceStateChange
    from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

    names: asyncio.Queue[str] = asyncio.Queue()

    def on_change(zeroconf, service_type, name, state_change):
        if state_change is ServiceStateChange.Added:
            names.put_nowait(name)

    zc = AsyncZeroconf(ip_version=IPVersion.V4Only)
    browser = AsyncServiceBrowser(zc.zeroconf, [SERVICE_TYPE], handlers=[on_change])
    found: list[str] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        while not found and (left := deadline - loop.time()) > 0:
            try:
                name = await asyncio.wait_for(names.get(), left)
            except asyncio.TimeoutError:
                break
            info = AsyncServiceInfo(SERVICE_TYPE, name)
            if not await info.async_request(zc.zeroconf, 3000):
                continue
            props = {k.decode(errors="replace"): (v or b"").decode(errors="replace") for k, v in info.properties.items()}
            if props.get("swarm") != swarm:
                continue
            try:
                maddrs = parse_join(v for k, v in sorted(props.items()) if k.startswith("m") and v)
            except ValueError as e:
                log.warning("ignoring mDNS service %s: %s", name, e)
                continue
            found.extend(m for m in maddrs if not (exclude and m.endswith(exclude)))
    finally:
        await browser.async_cancel()
        await zc.async_close()
    return found
