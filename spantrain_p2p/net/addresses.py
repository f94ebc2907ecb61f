"""Which addresses a peer binds and which it announces (``--listen``, ``--host``, ``--announce``).

A peer binds what it is told; what it tells others must be an address they can reach: never
``0.0.0.0`` (every other peer reads that as itself). Defaults follow the join address: a peer that
joins (or listens on) a non-loopback address binds every interface, and announces, in order, its
``--announce`` addresses, the local address its route to each join address leaves from, then its
other interfaces' addresses (loopback last, and only when nothing else is there).
"""
from __future__ import annotations

import fcntl
import functools
import ipaddress
import socket
import struct
from typing import Iterable, Optional
from urllib.parse import urlsplit

LOOPBACK_LISTEN = "/ip4/127.0.0.1/tcp/0"
ALL_LISTEN = "/ip4/0.0.0.0/tcp/0"
MAX_ANNOUNCED = 4
SIOCGIFADDR = 0x8915


def is_unspecified(host: str) -> bool:
    return host in ("0.0.0.0", "::", "")


def ip_of(host: str) -> Optional[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The IP address ``host`` spells (an IPv4 one mapped into IPv6 as itself), None for a name."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    return ip.ipv4_mapped or ip if isinstance(ip, ipaddress.IPv6Address) else ip


def is_loopback(host: str) -> bool:
    ip = ip_of(host)
    return ip.is_loopback if ip is not None else host == "localhost"


def port_mapping_wanted(listen: str) -> bool:
    """Whether a p2p daemon listening on the multiaddr ``listen`` asks the router to forward a port
    to it (UPnP, NAT-PMP: libp2p's ``natPortMap``): only where it listens beyond this host. Asking
    multicasts SSDP on every interface and queries the default gateway; from a loopback listener,
    which no router can forward to, every peer of a local swarm (and of the tests) did that on the
    host's own network."""
    host = maddr_host(listen)
    return host is not None and not is_loopback(host)


def maddr_host(maddr: str) -> Optional[str]:
    """The IP or DNS name of a multiaddr (``/ip4/1.2.3.4/tcp/…`` → ``1.2.3.4``), None if it has none."""
    parts = maddr.strip("/").split("/")
    for i in range(0, len(parts) - 1):
        if parts[i] in ("ip4", "ip6", "dns", "dns4", "dns6"):
            return parts[i + 1]
    return None


def default_binds(listen: Optional[str], host: Optional[str], join: Iterable[str]) -> tuple[str, str]:
    """(p2p listen multiaddr, data-plane bind host) for the flags given (None: not given). Joining a
    non-loopback address, or listening on one, binds every interface; otherwise loopback only."""
    hosts = [h for h in (maddr_host(j) for j in join if j != "auto") if h]
    outward = any(not is_loopback(h) for h in hosts) or list(join) == ["auto"]
    if listen is None:
        listen = ALL_LISTEN if outward else LOOPBACK_LISTEN
    if host is None:
        lh = maddr_host(listen) or "127.0.0.1"
        host = "0.0.0.0" if outward or not is_loopback(lh) else "127.0.0.1"
    return listen, host


def parse_announce(value: str) -> tuple[str, Optional[int]]:
    """``HOST[:PORT]`` (``[V6]:PORT`` for IPv6) → (host, port or None); ValueError saying why not."""
    v = value.strip()
    host, port = v, None
    if v.startswith("["):
        end = v.find("]")
        if end < 0:
            raise ValueError(f"--announce {value!r}: unclosed '['")
        host, rest = v[1:end], v[end + 1:]
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"--announce {value!r}: want [HOST]:PORT")
            port = rest[1:]
    elif v.count(":") == 1:
        host, port = v.split(":")
    if not host or is_unspecified(host) or any(c in host for c in "/?#@ "):
        raise ValueError(f"--announce {value!r}: want a host others can reach (an IP address or a name), "
                         f"optionally with :PORT")
    if port is not None:
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--announce {value!r}: the port must be 1-65535")
        port = int(port)
    return host, port


def interface_addresses() -> list[str]:
    """The IPv4 addresses of this host's interfaces (Linux ``SIOCGIFADDR``), loopback included."""
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # an interface without an IPv4 address
            out.append(socket.inet_ntoa(raw[20:24]))
    return out


def route_source(host: str) -> Optional[str]:
    """The local address this host's route to ``host`` leaves from (a UDP connect sends nothing)."""
    try:
        infos = socket.getaddrinfo(host, 9, socket.AF_INET, socket.SOCK_DGRAM)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(infos[0][4])
            return s.getsockname()[0]
    except OSError:
        return None


@functools.lru_cache(maxsize=1024)  # asked for every message sent (urlsplit: ~15 us a time)
def address_of(url: str) -> tuple[str, int]:
    """(host, port) of a data-plane URL; ValueError for anything else (URLs come from the network)."""
    u = urlsplit(url)
    if u.scheme != "http" or not u.hostname or u.port is None:
        raise ValueError(f"not a data-plane address: {url!r} (want http://HOST:PORT)")
    return u.hostname, u.port


def url_of(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def announced_urls(bind_host: str, port: int, announce: Iterable[str] = (), join: Iterable[str] = (),
                   interfaces: Optional[list[str]] = None) -> list[str]:
    """The data-plane URLs a peer announces, best first (at most ``MAX_ANNOUNCED``)."""
    hosts: list[tuple[str, int]] = []
    for a in announce:
        h, p = parse_announce(a)
        hosts.append((h, p or port))
    if not is_unspecified(bind_host):
        hosts.append((bind_host, port))
    else:
        for j in join:
            h = maddr_host(j)
            src = route_source(h) if h else None
            if src and not is_unspecified(src):
                hosts.append((src, port))
        ifs = interface_addresses() if interfaces is None else interfaces
        hosts += [(a, port) for a in ifs if not is_loopback(a)]
        if not hosts:
            hosts.append(("127.0.0.1", port))
    return list(dict.fromkeys(url_of(h, p) for h, p in hosts))[:MAX_ANNOUNCED]


def p2p_announce(listen: str, announce: Iterable[str]) -> list[str]:
    """Multiaddrs the p2p daemon announces for ``--announce`` hosts: only where ``listen`` names a
    fixed port (the same port forwarded), as a daemon on port 0 learns its port only at start."""
    parts = listen.strip("/").split("/")
    try:
        port = int(parts[parts.index("tcp") + 1])
    except (ValueError, IndexError):
        return []
    if not port:
        return []
    out = []
    for a in announce:
        h, _ = parse_announce(a)
        proto = "ip6" if ":" in h else ("ip4" if h.replace(".", "").isdigit() else "dns")
        out.append(f"/{proto}/{h}/tcp/{port}")
    return out


def order_maddrs(maddrs: list[str], urls: Iterable[str] = ()) -> list[str]:
    """The daemon's visible multiaddrs, best to hand out first: those on an announced host, then
    other non-loopback ones, loopback last."""
    hosts = [u.split("//", 1)[-1].rsplit(":", 1)[0].strip("[]") for u in urls]

    def rank(m: str) -> tuple[int, int]:
        h = maddr_host(m) or ""
        return (0 if h in hosts else 1 if not is_loopback(h) else 2, hosts.index(h) if h in hosts else 0)

    return sorted(maddrs, key=rank)


def host_of(peername) -> str:
    """The source address (host part) of a connection's peername, what per-address limits count by."""
    return str(peername[0]) if isinstance(peername, tuple) and peername else ""
