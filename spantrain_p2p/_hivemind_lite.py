"""Importing hivemind without its package ``__init__``, for the processes our commands start.

``import hivemind`` loads everything (averaging, MoE, optimizers, scipy.optimize): 2.9-3.0 s of
CPU per process here, while a peer uses only ``hivemind.p2p``, ``hivemind.dht`` and a few utils
(2.0-2.3 s with torch, which it needs anyway). A swarm of 7 peers on 2 cores starts ~3 s sooner.

``install()`` registers the ``hivemind`` package module without running its ``__init__``, so its
subpackages import alone. The first access to anything else on the package (``hivemind.DHT``,
``from hivemind import Optimizer`` in a user's model module) runs the real ``__init__`` then, so
nothing that expects the full package breaks. Only the command-line entry points call it, never
an import of ``spantrain_p2p`` in somebody's own process.
"""
from __future__ import annotations

import importlib.util
import sys


def install() -> None:
    if "hivemind" in sys.modules:
        return
    spec = importlib.util.find_spec("hivemind")
    if spec is None or spec.loader is None or not spec.submodule_search_locations:
        return
    mod = importlib.util.module_from_spec(spec)

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        sub = sys.modules.get(f"hivemind.{name}")
        if sub is not None:  # a subpackage still importing (``import hivemind.p2p.x as y``)
            return sub
        mod.__dict__.pop("__getattr__", None)  # once: the real __init__ defines what is left
        spec.loader.exec_module(mod)
        return getattr(mod, name)

    mod.__getattr__ = __getattr__  # type: ignore[attr-defined]
    sys.modules["hivemind"] = mod
