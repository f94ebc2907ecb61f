"""A fork server for peer processes: torch and hivemind are imported once, each peer is a fork.

A peer process spends ~2.7 s of CPU importing torch, hivemind and this package before it does
anything; a launcher that starts 4-8 peers on a 2-core machine waits 6-11 s for those imports alone
(``spantrain swarm``, the chaos joiners, the tests). The launcher instead starts one zygote
(``serve`` in a new Python process), which imports what a peer needs and then only forks: a forked
peer is ready as fast as its own start-up allows.

Protocol (JSON lines; the launcher is the zygote's only client, over its stdin and stdout):
- request ``{"id": N, "argv": [...], "log": PATH, "cwd": DIR}``: fork a peer that runs
  ``spantrain-peer ARGV`` with stdout and stderr appended to ``log``; reply ``{"id": N, "pid": PID}``.
- when a child exits, ``{"exit": PID, "code": C}`` (C as ``Popen.returncode``: ``-signal`` if killed).
- request ``{"id": N, "import": [MODULE, ...]}``: import these (of ``IMPORTABLE`` only) before the
  next fork, for every peer forked after it; reply ``{"id": N, "imported": [...], "error": E}``. The
  launcher asks it before a job's first peer where the job's model needs a library only such jobs
  import (``transformers``: 2.2 s of CPU in each peer of an ``hf:`` job, four at once on two cores).
The zygote runs no torch operation, no event loop and starts no thread of its own before forking.
Each child starts a new session (``killpg`` reaches it and its p2pd, as with ``Popen``) and gets
SIGTERM if the zygote dies; the zygote ignores Ctrl-C (the launcher stops the peers) and exits at
EOF on its stdin, i.e. when the launcher exits or dies.

``ForkedPeer`` is the launcher's handle on one child, with the part of ``subprocess.Popen``'s
interface that ``processes.PeerProcess`` and the tests use (pid, poll, wait, returncode, send_signal).
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
import traceback
from typing import Any, Optional

from ..osproc import die_with_parent, enter_netns

START_TIMEOUT_S = 60.0  # the zygote's own imports, on a loaded 2-core machine
# what the launcher may have the zygote import on request: transformers' model machinery (its import
# pulls in torchao's quantizers and scipy, whose BLAS starts one idle thread, as numpy's does already)
IMPORTABLE = ("transformers.modeling_utils",)


# ---- the zygote process ------------------------------------------------------------------------
def _preload() -> None:
    from .. import import_noise
    from .._hivemind_lite import install

    install()
    import_noise.leave_out()  # before any import of torchao (``_import``): its notes of kernels this machine lacks
    import torch  # noqa: F401
    # a job's model built on the meta device (its fingerprint, ``job.spec.check_compatible``) runs
    # torch's Python references, whose first call imports torch._dynamo: 1.1 s of CPU in every peer
    # of a lan-4 swarm, 31 % of the Python it ran (py-spy, 2026-11-29), paid here once instead
    import torch._dynamo  # noqa: F401
    from hivemind.dht.node import DHTNode  # noqa: F401
    from hivemind.p2p import P2P  # noqa: F401

    from .. import peer  # noqa: F401
    from ..peer_command import main  # noqa: F401
    from ..swarm import discovery  # noqa: F401
    from ..models import model
    from ..train import trainer  # noqa: F401


def _child(argv: list[str], log: str, cwd: str, netns: str = "") -> None:
    """In the forked child: become a peer process like ``python -m spantrain_p2p peer ARGV`` (in
    network namespace ``netns``, if given: a host of ``hosts.World``)."""
    code = 1
    try:
        os.setsid()
        if netns:
            enter_netns(netns)
        die_with_parent(signal.SIGTERM)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.close(null)
        os.chdir(cwd)
        import numpy

        numpy.random.seed()  # the zygote's state is every child's: draw a fresh one (random does so itself)
        sys.argv = ["spantrain-peer", *argv]
        from ..peer_command.main import main as peer_main

        code = peer_main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:
        code = 130
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


def _import(modules) -> dict:
    """Imports the modules asked for (``IMPORTABLE`` ones only): what to reply."""
    import importlib
    import warnings

    done = []
    for name in modules if isinstance(modules, list) else []:
        if name not in IMPORTABLE:
            return {"imported": done, "error": f"{str(name)[:80]!r} is not a module the zygote imports"}
        try:
            with warnings.catch_warnings():  # (torchao's about CUDA kernels this machine lacks)
                warnings.simplefilter("ignore")
                importlib.import_module(name)
        except Exception as e:  # the peers import it themselves, and say why it fails
            return {"imported": done, "error": f"{name}: {type(e).__name__}: {e}"[:300]}
        done.append(name)
    return {"imported": done, "error": None}


def _reap(out) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _reply(out, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _reply(out, msg: dict) -> None:
    out.write(json.dumps(msg) + "\n")
    out.flush()


def serve() -> int:
    try:
        return _serve()
    except BrokenPipeError:  # the launcher is gone (it stopped before it needed us: a bad argument, say)
        return 0


def _serve() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # stray prints of imported modules stay off the protocol
    _preload()
    _reply(out, {"ready": os.getpid()})
    stdin = sys.stdin.buffer
    buf = b""
    while True:
        readable, _, _ = select.select([stdin.fileno()], [], [], 0.05)
        _reap(out)
        if not readable:
            continue
        chunk = os.read(stdin.fileno(), 65536)
        if not chunk:
            return 0  # the launcher is gone; children get SIGTERM as we exit
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            if "import" in req:
                _reply(out, {"id": req["id"], **_import(req["import"])})
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                out.close()
                _child([str(a) for a in req["argv"]], str(req["log"]), str(req["cwd"]), str(req.get("netns") or ""))
            _reply(out, {"id": req["id"], "pid": pid})


# ---- the launcher's side -----------------------------------------------------------------------
class ZygoteError(RuntimeError):
    pass


# not ``python -m spantrain_p2p.launch.zygote``: the package imports this module first, and runpy would
# run a second copy of it as __main__
_SERVE = "import sys; from spantrain_p2p.launch.zygote import serve; sys.exit(serve())"


class Zygote:
    """The launcher's connection to one zygote process (started on first use; thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._proc: Optional[subprocess.Popen] = None
        self._replies: dict[int, Any] = {}  # request id -> pid (a fork) or error text (an import)
        self._exits: dict[int, int] = {}
        self._next_id = 0
        self._dead: Optional[str] = None
        self._ready = threading.Event()
        self._imported: set[str] = set()  # modules this zygote has imported on request

    def prestart(self) -> None:
        """Starts the zygote now, without waiting: its imports overlap with the launcher's work."""
        with self._lock:
            self._ensure_process()

    def _ensure_process(self) -> None:
        if self._proc is not None and not self._dead:
            return
        self._dead = None
        self._ready = threading.Event()
        self._imported = set()
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _SERVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=None, bufsize=0,
        )
        threading.Thread(target=self._read, args=(self._proc, self._ready), name="zygote-reader", daemon=True).start()

    def _started(self) -> None:
        self._ensure_process()
        if not self._ready.wait(START_TIMEOUT_S) or self._dead:
            why = self._dead or f"not ready after {START_TIMEOUT_S:.0f}s"
            self.close()
            self._proc = None
            raise ZygoteError(f"the zygote did not start: {why}")

    def _read(self, proc: subprocess.Popen, ready: threading.Event) -> None:
        for line in proc.stdout:
            msg = json.loads(line)
            with self._cond:
                if "ready" in msg:
                    ready.set()
                elif "exit" in msg:
                    self._exits[int(msg["exit"])] = int(msg["code"])
                elif "imported" in msg:
                    self._imported.update(msg["imported"])
                    self._replies[int(msg["id"])] = msg.get("error") or ""
                else:
                    self._replies[int(msg["id"])] = int(msg["pid"])
                self._cond.notify_all()
        with self._cond:
            self._dead = f"exited with code {proc.wait()}"
            self._cond.notify_all()
        ready.set()

    def _ask(self, req: dict, timeout: float):
        """Sends ``req`` (an id added); its reply."""
        with self._lock:
            self._started()
            self._next_id += 1
            rid = self._next_id
            try:
                self._proc.stdin.write(json.dumps({"id": rid, **req}).encode() + b"\n")
            except OSError as e:
                raise ZygoteError(f"the zygote is gone: {e}") from None
        with self._cond:
            if not self._cond.wait_for(lambda: rid in self._replies or self._dead, timeout):
                raise ZygoteError(f"the zygote did not answer within {timeout:.0f} s")
            if rid not in self._replies:
                raise ZygoteError(f"the zygote {self._dead}")
            return self._replies.pop(rid)

    def spawn(self, argv: list[str], log: str, netns: str = "") -> "ForkedPeer":
        return ForkedPeer(self, self._ask({"argv": list(argv), "log": os.path.abspath(log), "cwd": os.getcwd(),
                                           "netns": netns}, 30))

    def preload(self, modules: list[str]) -> Optional[str]:
        """Has the zygote import ``modules`` (of ``IMPORTABLE``) for the peers it forks from now on;
        None once they are imported, else why not (the peers then import them themselves)."""
        if set(modules) <= self._imported:
            return None
        return self._ask({"import": list(modules)}, START_TIMEOUT_S) or None

    def returncode(self, pid: int) -> Optional[int]:
        with self._cond:
            if pid in self._exits:
                return self._exits[pid]
            if self._dead:  # its children got SIGTERM with it
                return -signal.SIGTERM if _gone(pid) else None
            return None

    def wait(self, pid: int, timeout: Optional[float]) -> Optional[int]:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits or (self._dead and _gone(pid)), timeout)
        return self.returncode(pid)

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def close(self) -> None:
        """Ends the zygote (its children still running get SIGTERM)."""
        if self._proc is not None:
            try:
                self._proc.stdin.close()
            except OSError:
                pass
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class ForkedPeer:
    """A peer forked by the zygote, with ``Popen``'s pid, poll, wait, returncode and send_signal."""

    def __init__(self, zygote: Zygote, pid: int):
        self._zygote = zygote
        self.pid = pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self._zygote.returncode(self.pid)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.poll() is None:
            self.returncode = self._zygote.wait(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"peer pid {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


_shared: Optional[Zygote] = None
_shared_lock = threading.Lock()


def enabled() -> bool:
    """Peers are forked by a zygote unless ``SPANTRAIN_ZYGOTE=0``."""
    return os.environ.get("SPANTRAIN_ZYGOTE", "1") != "0"


def prestart() -> None:
    """Starts this process's zygote now (if enabled), so that it is ready when the first peer starts."""
    if enabled():
        shared().prestart()


def existing() -> Optional[Zygote]:
    """This process's zygote if one was started, else None."""
    return _shared


def shared() -> Zygote:
    """This process's zygote (one per launcher process, started on first use), ended and waited for
    when this process exits: left to exit at its stdin's EOF alone, it outlived the launcher for a
    moment and was adopted by init, and its peers' CPU never reached the launcher's children's
    (``spantrain swarm`` on lan-4, 5 steps: 2.1 CPU-s counted of the 15.4 the machine spent)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Zygote()
            atexit.register(_shared.close)
        return _shared
