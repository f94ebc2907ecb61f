"""The fields of a SWIM message (``swim_loop``), checked as they arrive: every one is untrusted, and
a malformed one is refused with a reason (``framing.FrameError``; ValueError for a member list)."""
from __future__ import annotations

from typing import Optional

import msgpack

from ..net import framing
from ..swarm.swim import MAX_NAME, MAX_NEWS, STATES, News, check_inc, check_name, news_from_wire

KIND = "swim"
VERSION = 1
OPS = ("ping", "req", "news", "list")
MAX_URL = 256
MAX_LIST = 20_000  # members in one answer to "list", at most
MAX_LIST_BYTES = 4 << 20
MAX_ASK = 8  # members a message asks the addresses of, at most (``SwimLoop._addressless``)


def read(header: dict, ops: tuple[str, ...] = OPS) -> tuple[str, int, int, list[News]]:
    """(life, incarnation, record seq, news) of a message or an ack."""
    framing.check_fields(header, {"v": int, "op": str, "inc": int, "life": str, "rec": int, "url": str,
                                  "news": list})
    if not 0 < len(header["url"]) <= MAX_URL:
        raise framing.FrameError(f"a swim url has 1-{MAX_URL} characters")
    if header["v"] != VERSION:
        raise framing.FrameError(f"swim version {header['v']} is not {VERSION}")
    if header["op"] not in ops:
        raise framing.FrameError(f"swim op must be one of {', '.join(ops)}, not {str(header['op'])[:20]!r}")
    try:
        check_name(header["life"], "life")
        check_inc(header["inc"])
        check_inc(header["rec"])
        return header["life"], header["inc"], header["rec"], news_from_wire(header["news"])
    except ValueError as e:
        raise framing.FrameError(str(e)) from None


def urls_of(header: dict) -> dict:
    """A message's addresses of members (``urls``: those its news is about, or that were asked of it); {} if none."""
    urls = header.get("urls")
    if urls is None:
        return {}
    if not (isinstance(urls, dict) and len(urls) <= MAX_NEWS and all(
            isinstance(k, str) and 0 < len(k) <= MAX_NAME and isinstance(v, str) and 0 < len(v) <= MAX_URL
            for k, v in urls.items())):
        raise framing.FrameError(f"a swim message's urls map at most {MAX_NEWS} member ids to addresses")
    return urls


def asked(header: dict) -> list:
    """The member ids a message asks the addresses of (``ask``); [] if none."""
    ask = header.get("ask")
    if ask is None:
        return []
    if not (isinstance(ask, list) and len(ask) <= MAX_ASK
            and all(isinstance(p, str) and 0 < len(p) <= MAX_NAME for p in ask)):
        raise framing.FrameError(f"a swim message asks the addresses of at most {MAX_ASK} member ids")
    return ask


def map_head(header: dict) -> Optional[tuple[int, int, str]]:
    """The (term, epoch, job) of the stage map the sender follows (``map``), None if it says none."""
    head = header.get("map")
    if head is None:
        return None
    if not (isinstance(head, list) and len(head) == 3 and all(type(x) is int and 0 <= x < 1 << 31 for x in head[:2])
            and isinstance(head[2], str) and len(head[2]) <= MAX_URL):
        raise framing.FrameError("a swim message's map is [term, epoch, job]: two small non-negative ints, a job id")
    return head[0], head[1], head[2]


def list_from_wire(buffers: list) -> list[tuple]:
    """Entries of an answer to "list": ValueError saying what is wrong."""
    if len(buffers) != 1 or len(buffers[0]) > MAX_LIST_BYTES:
        raise ValueError(f"a member list is one buffer of at most {MAX_LIST_BYTES} bytes")
    try:
        items = msgpack.unpackb(bytes(buffers[0]), raw=False, max_array_len=MAX_LIST, max_str_len=MAX_URL,
                                max_bin_len=0, max_map_len=0)
    except Exception as e:
        raise ValueError(f"not a msgpack list: {e}") from None
    if not isinstance(items, list):
        raise ValueError("a member list is a list")
    out = []
    for it in items:
        if not isinstance(it, list) or len(it) != 6:
            raise ValueError("an entry is [peer, state, incarnation, life, address, record seq]")
        peer, state, inc, life, url, rec = it
        if state not in ("alive", "suspect") or not isinstance(url, str) or not 0 < len(url) <= MAX_URL:
            raise ValueError("an entry's state is alive or suspect, its address a short string")
        news_from_wire([[peer, STATES.index(state), inc, life, rec]])
        out.append((peer, state, inc, life, url, rec))
    return out


def size(header: Optional[dict]) -> int:
    """Bytes of a message's header on the wire (0: none)."""
    return framing.frame_size(framing.encode(header)) if header else 0
