"""A world of hosts on one machine, for tests and long runs across real network boundaries.

Each host is a network namespace with its own address on a virtual internet (veth pairs to a bridge
in an "internet" namespace, addresses in 11.0.0.0/24: public-looking, as libp2p treats private
ranges as non-public). A host behind a home router sits on 192.168.N.0/24 behind a router namespace
that masquerades with nftables (endpoint-independent mapping, or symmetric with ``fully-random``)
and drops every unsolicited inbound packet, as home routers do. The operator (this process) looks
from the bridge's own address 11.0.0.1 through a thread that entered the internet namespace, so
nothing travels outside the namespaces the world made. ``close`` (also at exit) stops every process
and deletes every namespace.

Needs root, iproute2 and nftables (``scripts/setup-netns.sh`` installs them); ``why_not()`` says
what is missing.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional, TypeVar

from ..osproc import enter_netns

T = TypeVar("T")
OBSERVER = "11.0.0.1"


def _run(*cmd: str, input: Optional[str] = None) -> None:
    r = subprocess.run(cmd, input=input, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip() or r.stdout.strip()}")


def why_not() -> Optional[str]:
    """None when this machine can build a world; else the reason."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "nft"):
        if not shutil.which(tool):
            return f"{tool} is not installed (scripts/setup-netns.sh installs iproute2 and nftables)"
    name = f"stprobe{os.getpid()}"
    try:
        _run("ip", "netns", "add", name)
        _run("ip", "netns", "exec", name, "nft", "list", "tables")
    except RuntimeError as e:
        return f"network namespaces do not work here: {e}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


@dataclass
class Host:
    name: str
    ns: str
    address: str  # the host's own address (private behind a router)
    public: str  # the address the internet sees it at (its router's, behind one)
    nat: str = ""  # "", "eim" (endpoint-independent mapping) or "symmetric"
    procs: list = field(default_factory=list)

    def wrap(self) -> list[str]:
        """The command prefix that runs a program on this host."""
        return ["ip", "netns", "exec", self.ns]


class World:
    def __init__(self, tag: str = ""):
        self.prefix = f"st{tag}{os.getpid() % 100000}-"
        self.namespaces: list[str] = []
        self.hosts: dict[str, Host] = {}
        self._next = 10
        self._observers: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.inet = self._ns("inet")
        _run("ip", "-n", self.inet, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.inet, "addr", "add", f"{OBSERVER}/24", "dev", "br0")
        _run("ip", "-n", self.inet, "link", "set", "br0", "up")
        atexit.register(self.close)

    def __enter__(self) -> "World":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _ns(self, name: str) -> str:
        ns = self.prefix + name
        _run("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        return ns

    def _wire(self, ns: str, address: str) -> None:
        """Plugs ``ns`` into the internet's bridge as eth0 with ``address``/24."""
        port = f"p{self._next}"
        _run("ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", self.inet)
        _run("ip", "-n", self.inet, "link", "set", port, "master", "br0")
        _run("ip", "-n", self.inet, "link", "set", port, "up")
        _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")

    def public(self, name: str) -> Host:
        """A host with a public address on the internet."""
        n, self._next = self._next, self._next + 1
        ns = self._ns(name)
        address = f"11.0.0.{n}"
        self._wire(ns, address)
        self.hosts[name] = Host(name, ns, address, address)
        return self.hosts[name]

    def behind_nat(self, name: str, symmetric: bool = False) -> Host:
        """A host behind its own home router: masquerade NAT (``symmetric``: a random public port per
        connection) and no unsolicited inbound packet let through."""
        n, self._next = self._next, self._next + 1
        router, ns = self._ns(f"{name}-rt"), self._ns(name)
        public = f"11.0.0.{n}"
        self._wire(router, public)
        _run("ip", "-n", router, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "-n", router, "addr", "add", f"192.168.{n}.1/24", "dev", "lan0")
        _run("ip", "-n", router, "link", "set", "lan0", "up")
        _run("ip", "-n", ns, "addr", "add", f"192.168.{n}.2/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "route", "add", "default", "via", f"192.168.{n}.1")
        _run("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        rules = f"""
table ip nat {{
  chain prerouting {{
    type nat hook prerouting priority -100; policy accept
  }}
  chain postrouting {{
    type nat hook postrouting priority 100; policy accept
    oifname "eth0" masquerade{' fully-random' if symmetric else ''}
  }}
}}
table inet filter {{
  chain forward {{
    type filter hook forward priority 0; policy drop
    ct state established,related accept
    ct status dnat accept
    iifname "lan0" accept
  }}
  chain input {{
    type filter hook input priority 0; policy drop
    ct state established,related accept
    iifname {{ "lan0", "lo" }} accept
  }}
}}
"""
        _run("ip", "netns", "exec", router, "nft", "-f", "-", input=rules)
        self.hosts[name] = Host(name, ns, f"192.168.{n}.2", public, "symmetric" if symmetric else "eim")
        return self.hosts[name]

    def forward(self, host: Host, port: int) -> None:
        """Forwards TCP ``port`` of ``host``'s router to ``host`` (what a user does on a home router)."""
        _run("ip", "netns", "exec", self.prefix + f"{host.name}-rt", "nft", "add", "rule", "ip", "nat", "prerouting",
             "iifname", "eth0", "tcp", "dport", str(port), "dnat", "to", f"{host.address}:{port}")

    def host(self, name: str, kind: str) -> Host:
        """``kind``: "public", "nat" (endpoint-independent) or "symmetric"."""
        if kind == "public":
            return self.public(name)
        if kind not in ("nat", "symmetric"):
            raise ValueError(f"a host is public, nat or symmetric, not {kind!r}")
        return self.behind_nat(name, symmetric=kind == "symmetric")

    def swarm(self, kinds: list[str], job: list[str], run_dir: str, names: str = "abcdefghijklmnop",
              timeout: float = 90.0, every: tuple[str, ...] = ()) -> list:
        """One peer per host, started as the README says: the first (on a public host) founds the swarm
        with ``--listen /ip4/0.0.0.0/tcp/4001`` and the job, the others ``--join`` its address; ``every``:
        flags of every peer (``--encrypt``)."""
        hosts = [self.host(f"h{i}", k) for i, k in enumerate(kinds)]
        founder = self.peer(names[0], ["--listen", "/ip4/0.0.0.0/tcp/4001", "--name", names[0], *every, *job],
                            run_dir, hosts[0])
        founder.start().wait_ready(timeout)
        rest = [self.peer(n, ["--join", founder.info["address"], "--name", n, *every], run_dir, h)
                for n, h in zip(names[1:], hosts[1:])]
        for p in rest:
            p.start()
        for p in rest:
            p.wait_ready(timeout)
        return [founder, *rest]

    def shape(self, host: Host, mbit: float) -> None:
        """Caps what ``host`` sends to the internet at ``mbit`` Mbit/s (tbf on its uplink)."""
        ns = host.ns if not host.nat else self.prefix + f"{host.name}-rt"
        burst = max(32, int(mbit * 1e6 / 8 / 250)) // 1024 + 1
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf",
             "rate", f"{mbit}mbit", "burst", f"{burst}kb", "latency", "50ms")

    def observe(self, fn: Callable[[], T], host: Optional[Host] = None) -> T:
        """Runs ``fn`` in a thread of this process that lives in the internet namespace (at 11.0.0.1):
        how the operator reads the peers' pages; with ``host``, in that host's namespace (a peer
        behind NAT is read from its own host, as its owner would)."""
        ns = host.ns if host is not None else self.inet
        with self._lock:
            pool = self._observers.get(ns)
            if pool is None:
                pool = self._observers[ns] = concurrent.futures.ThreadPoolExecutor(1, initializer=enter_netns,
                                                                                   initargs=(ns,))
        return pool.submit(fn).result()

    def peer(self, name: str, args: list[str], run_dir: str, host: Host):
        """A ``PeerProcess`` on ``host``, its pages read from where they can be (``observe``)."""
        from .processes import PeerProcess

        p = PeerProcess(name, args, run_dir, wrap=host.wrap(), netns=host.ns,
                        observe=(lambda fn: self.observe(fn, host)) if host.nat else self.observe,
                        page_host=host.address if host.nat else "")
        host.procs.append(p)
        return p

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for h in self.hosts.values():
            for p in h.procs:
                try:
                    p.kill()
                except Exception:
                    pass
        for pool in self._observers.values():
            pool.shutdown(wait=False)
        for ns in reversed(self.namespaces):
            # processes still inside would keep the namespace's interfaces: kill them first
            r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in r.stdout.split():
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        atexit.unregister(self.close)
