"""Peer processes on this machine: start one (forked by the zygote, or as a new process), wait until
it is ready, read its /status, signal, stop and kill it; run folders; polling with a deadline.

Peers get SIGTERM if the launcher dies, and ``stop`` escalates to SIGKILL, so none is left behind.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional, Union

from ..osproc import die_with_parent
from . import zygote


@dataclass
class PeerProcess:
    name: str
    args: list[str]
    run_dir: str
    proc: Optional[Union[subprocess.Popen, zygote.ForkedPeer]] = None
    info: dict = field(default_factory=dict)
    wrap: list[str] = field(default_factory=list)  # a command prefix: run on another host (``hosts.Host.wrap``)
    observe: Optional[Callable] = None  # runs a page read where the peer can be reached (``hosts.World.observe``)
    page_host: str = ""  # read pages at this host (its own address behind NAT), not its data_url's
    netns: str = ""  # the network namespace a forked peer enters (``wrap`` runs it there without the zygote)

    @property
    def ready_file(self) -> str:
        return os.path.join(self.run_dir, f"{self.name}.ready.json")

    @property
    def log_file(self) -> str:
        return os.path.join(self.run_dir, f"{self.name}.log")

    def start(self) -> "PeerProcess":
        if os.path.exists(self.ready_file):
            os.remove(self.ready_file)
        argv = ["--ready-file", self.ready_file, *self.args]
        if zygote.enabled() and (self.netns or not self.wrap):
            try:
                modules = preloads(self.args)
                if modules:  # before the job's first peer: the others join later, forked after it
                    why = zygote.shared().preload(modules)
                    if why:
                        print(f"spantrain: the zygote did not import {modules}: {why}", file=sys.stderr, flush=True)
                self.proc = zygote.shared().spawn(argv, self.log_file, netns=self.netns)
                return self
            except zygote.ZygoteError as e:
                print(f"spantrain: {e}; starting peer {self.name} as a new process", file=sys.stderr, flush=True)
        cmd = [*self.wrap, sys.executable, "-m", "spantrain_p2p", "peer", *argv]
        with open(self.log_file, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=partial(die_with_parent, signal.SIGTERM) if sys.platform.startswith("linux") else None,
            )
        return self

    def poll_ready(self) -> bool:
        """True once the peer wrote its ready file; RuntimeError if it exited first."""
        if self.info:
            return True
        if os.path.exists(self.ready_file):
            with open(self.ready_file) as f:
                self.info = json.load(f)
            return True
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"peer {self.name} exited with code {self.proc.returncode}:\n{self.log_tail()}")
        return False

    def wait_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while not self.poll_ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"peer {self.name} not ready after {timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.1)
        return self.info

    def status(self, timeout: float = 5.0, path: str = "/status") -> dict:
        url = self.info["data_url"]
        if self.page_host:
            url = f"http://{self.page_host}:{url.rsplit(':', 1)[1]}"

        def read() -> dict:
            with urllib.request.urlopen(f"{url}{path}", timeout=timeout) as r:
                return json.loads(r.read())
        return self.observe(read) if self.observe is not None else read()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        """To the peer process only: its p2pd, in the same process group, must outlive a SIGINT long
        enough for the peer to write its tombstone through it and stop it (a group-wide SIGINT
        killed the daemon first, and every peer spent 5-10 s in timeouts before exiting)."""
        if self.alive():
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = 10.0) -> Optional[int]:
        """SIGINT (graceful: tombstone, daemon stopped), SIGKILL to the group if it lingers."""
        if self.proc is None:
            return None
        self.signal(signal.SIGINT)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the peer and its p2pd share its session
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_file, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""


def new_run_dir(base: str = "runs", tag: str = "swarm") -> str:
    path = os.path.join(base, f"{tag}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    os.makedirs(path, exist_ok=True)
    return path


def wait_until(pred, timeout: float, interval: float = 0.25, what: str = "a condition"):
    """Polls ``pred`` until it returns a truthy value; TimeoutError after ``timeout`` seconds,
    naming ``what`` was awaited."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            v = pred()
        except (OSError, ValueError):
            v = None
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def preloads(args: list[str]) -> list[str]:
    """What the zygote imports before it forks a peer of these arguments: transformers' model
    machinery where the peer defines a job with a transformers model (``--model hf:...``; the
    peers that join it are forked after it and find it imported too)."""
    for i, a in enumerate(args):
        # (``models.hf_model.PREFIX``: not imported here, it imports torch, which the launcher leaves to its peers)
        value = args[i + 1] if a == "--model" and i + 1 < len(args) else a[len("--model="):] if a.startswith("--model=") else None
        if value is not None and value.startswith("hf:"):
            return ["transformers.modeling_utils"]
    return []
