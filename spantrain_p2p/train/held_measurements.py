"""The planner's copy of its members' measurements (``Coordinator._measured``): how an entry is
held, which of two is newer, what versions are held against what the members' records say, and the
key a search's answer is remembered by. Plain functions over plain data."""
from __future__ import annotations

import json
from typing import Optional

from ..plan.stagemap import StageMap
from ..swarm import measure


def measurements_key(ids: list[str], profiles: dict, links: dict, smap: StageMap) -> str:
    """What a search for a better plan than ``smap`` is made from: the same key, the same answer."""
    return json.dumps([ids, [links.get(p) for p in ids], [profiles[p].get("profile") for p in ids],
                       smap.epoch, smap.term], sort_keys=True, default=str)


def measure_versions(records, profiles: Optional[dict] = None, links: Optional[dict] = None) -> Optional[tuple]:
    """The profile and links versions of the ready peers of ``records``: as their records say
    (``measure.version_field``), or as held in ``profiles`` and ``links`` where given (-1: none
    held); None where a record says none (a peer before versions: its entries are read at every
    check)."""
    out = []
    for r in sorted(records, key=lambda r: r.peer_id):
        vs = tuple(r.progress.get(measure.version_field(what)) for what in measure.VERSIONED)
        if not all(type(v) is int for v in vs):
            return None
        if profiles is not None:
            vs = (measure.version_of(profiles[r.peer_id]) if r.peer_id in profiles else -1,
                  links_version(links[r.peer_id]) if r.peer_id in links else -1)
        out.append((r.peer_id, vs))
    return tuple(out)


def links_entry(payload: dict) -> tuple[dict, int]:
    """What a links entry is held as: (its links, its version)."""
    return payload["links"], measure.version_of(payload)


def links_version(held: tuple[dict, int]) -> int:
    return held[1]


def newer(held: dict, more: dict, version) -> dict:
    """``held`` with the entries of ``more`` that are newer (by ``version``) or new: a new dict."""
    return {**held, **{p: v for p, v in more.items() if p not in held or version(v) >= version(held[p])}}
