"""The swarm's door on the DHT: every value a peer stores or reads goes through a ``GuardedDHT``.

The DHT itself is open (anyone who reaches one node can store anything under any key), so the
guard decides what a peer believes:
- in a closed swarm (a ``SwarmKey``), values are sealed on the way in and opened on the way out;
  a value that does not open is dropped, and logged once;
- with an allow-list, a value signed by a peer id not on it is dropped too (every value of a
  swarm is a signed payload, see ``records.sign_payload``): roles, stage maps, job records and
  measurements are taken from members only;
- a closed swarm with an allow-list seals its values with the group key (``group``, handed to
  listed members only, see ``group_key``); only the group-key exchange itself stays under the
  swarm key. Until a joining peer holds the group key, it reads nothing else.
``refused`` counts what was dropped, by reason, so a joining peer can say why it sees no swarm.
"""
from __future__ import annotations

import asyncio
import functools
import random
import time
from collections import Counter
from typing import Any, Optional

from hivemind.utils import ValueWithExpiration

from . import find_values
from .holders import pick
from .identity import peer_id_from_public_der
from .keys import is_key_exchange, read_together
from .membership import BadRecordLog
from .sealing import GroupKey, SealError, Sealer, SwarmKey, is_group_sealed, is_sealed, sealed_key_id


def signer_of(value: Any) -> Optional[str]:
    """The peer id a signed payload claims (checked against its signature later), else None."""
    if isinstance(value, dict) and isinstance(value.get("key"), bytes) and len(value["key"]) <= 2048:
        try:
            return peer_id_from_public_der(value["key"])
        except Exception:
            return None
    return None

# A key's entries are stored on the REPLICAS nodes nearest to it (hivemind's ``num_replicas``), so a
# read that visits the REPLICAS nearest nodes merges every copy there is. hivemind's default beam
# (its bucket size, 20) visited up to 20 nodes a read: every member of a swarm under 20, each
# returning the whole dictionary (issue 33: 31 finds a second per peer at 16 peers). A store that
# falls back to hivemind's (no nearest nodes known) searches with hivemind's beam.
REPLICAS = 5
# A read of the latest value and a store ask the key's nearest nodes directly, one call each, once
# they are known: hivemind searches from this peer's routing table every time, and visited 13 nodes
# a read at 16 peers (the path to the nearest ones included). The nearest nodes are looked up again
# after this long, at once when one of them does not answer, and when a nearer node is known (the
# member keys' 8 lookups every 30 s were a fifth of an idle peer's calls at 48 peers).
HOLDERS_TTL_S = 60.0


_NOBODY = object()  # ``_ask_holders``: no answer, search instead


class GuardedDHT:
    """``store`` and ``get`` of hivemind's ``DHTNode`` (the subset a swarm uses), with sealing and
    the allow-list applied; ``node`` is the node underneath."""

    def __init__(self, node, key: Optional[SwarmKey] = None, allow: Optional[frozenset[str]] = None,
                 values_only: bool = False):
        """``values_only``: the swarm's nodes serve ``find_values`` (every peer of this version does):
        a read at a key's holders asks for the values without the neighbours."""
        self.node, self.key, self.allow = node, key, allow
        self.values_only = values_only
        # a store's lookup finds the nodes of the keys read with its key too (``keys.read_together``:
        # every member key, where the members are read together); False: its own key's only (SWIM)
        self.together = True
        self.holders_ttl = HOLDERS_TTL_S  # SWIM: longer (its peers read little; a lookup's last nodes are the key's)
        self.group: Optional[GroupKey] = None  # set once made or handed over (grouped swarms only)
        self.refused: Counter[str] = Counter()
        self.other_key_ids: set[str] = set()
        self._log = BadRecordLog("DHT value")
        self._read: dict[str, dict] = {}  # per dictionary key: the unexpired entries read or stored (``_merge``)
        self._holders: dict[str, tuple[float, dict]] = {}  # per key: (when, its nearest nodes: DHTID -> PeerID)
        self._rng = random.Random()
        validator = getattr(getattr(node, "protocol", None), "record_validator", None)
        if validator is not None and hasattr(validator, "sealer_for"):  # a ``validator.SwarmValidator``
            validator.sealer_for = self.sealer_for  # sealed values that do not open are refused at store time

    @property
    def grouped(self) -> bool:
        """Whether this swarm's values are sealed with a group key: closed, with an allow-list."""
        return self.key is not None and self.allow is not None

    def sealer_for(self, dht_key: str) -> Optional[Sealer]:
        """The sealer a value of ``dht_key`` is sealed with (None: an open swarm, or a grouped
        swarm's value before this peer holds the group key)."""
        if not self.grouped or is_key_exchange(dht_key):
            return self.key
        return self.group

    async def store(self, key: str, value: Any, expiration_time: float, subkey: Any = None, **kwargs) -> bool:
        plain = value
        if self.key is not None:
            sealer = self.sealer_for(key)
            if sealer is None:
                raise RuntimeError("this peer does not hold the swarm's group key yet: it cannot store anything")
            value = sealer.seal(value, key, subkey, expiration_time)
        stored = await self._store_at_holders(key, value, expiration_time, subkey) if not kwargs else None
        ok = bool(await self.node.store(key, value, expiration_time, subkey=subkey, **kwargs)) if stored is None else stored
        if ok and subkey is not None:  # this peer's own entry is in its next read, whatever nodes answer
            self._merge(key, {subkey: ValueWithExpiration(plain, expiration_time)})
        return ok

    async def get(self, key: str, latest: bool = False, holders: int = REPLICAS, **kwargs) -> Optional[ValueWithExpiration]:
        """``holders``: with ``latest``, how many of the key's nodes are asked (fewer: one of them at
        random, for a read that may miss an entry one node lacks until the next read)."""
        kwargs.setdefault("beam_size", REPLICAS)
        found = (await self._ask_holders([key], holders))[key] if latest and kwargs == {"beam_size": REPLICAS} else _NOBODY
        if found is _NOBODY:
            found = await self.node.get(key, latest=latest, **kwargs)
        return self._accept(key, found)

    async def get_many(self, keys: list[str], latest: bool = False, holders: int = REPLICAS) -> dict[str, Optional[ValueWithExpiration]]:
        """``get`` of several keys in one go: with ``latest``, each node picked is asked once for
        every key it holds (``holders.pick``); the keys whose nodes are not known, or did not
        answer, in one search of hivemind's for them all."""
        keys = list(dict.fromkeys(keys))
        found = await self._ask_holders(keys, holders) if latest else dict.fromkeys(keys, _NOBODY)
        rest = [k for k in keys if found[k] is _NOBODY]
        if rest:
            more = await self.node.get_many(rest, sufficient_expiration_time=float("inf") if latest else None,
                                            beam_size=REPLICAS)
            found.update({k: more.get(k) for k in rest})
        return {k: self._accept(k, found[k]) for k in keys}

    def _accept(self, key: str, found: Optional[ValueWithExpiration]) -> Optional[ValueWithExpiration]:
        """What this peer believes of a value ``found`` for ``key``: the entries it admits, merged into
        what it read before (``_merge``)."""
        if found is None:
            merged = self._merge(key, {})  # nothing answered: what this peer read before, until it expires
            return ValueWithExpiration(merged, max(v.expiration_time for v in merged.values())) if merged else None
        if isinstance(found.value, dict):
            kept = {}
            for subkey, item in found.value.items():
                value = self._admit(key, subkey, getattr(item, "value", None), getattr(item, "expiration_time", 0.0))
                if value is not None:
                    kept[subkey] = ValueWithExpiration(value, item.expiration_time)
            merged = self._merge(key, kept)
            return ValueWithExpiration(merged, max([found.expiration_time, *(v.expiration_time for v in merged.values())]))
        value = self._admit(key, None, found.value, found.expiration_time)
        return None if value is None else ValueWithExpiration(value, found.expiration_time)

    async def _ask_holders(self, keys: list[str], ask: int = REPLICAS) -> dict:
        """Per key, its latest value from the REPLICAS nodes nearest to it (and this node), asked
        directly, as hivemind's search merges it (``ask`` of them, picked by ``holders.pick``: a node
        is asked once for all the keys it is picked for); _NOBODY where they are not known or none
        answered (the caller searches). Copies on other nodes are not seen: they are not where
        stores go."""
        from hivemind.dht.node import _SearchState
        from hivemind.dht.routing import DHTID

        out: dict = dict.fromkeys(keys, _NOBODY)
        node = self.node
        protocol = getattr(node, "protocol", None)
        if protocol is None or not hasattr(node, "find_nearest_nodes"):
            return out
        ids = {k: DHTID.generate(source=k) for k in keys}
        held = await self._holders_of(ids)
        calls = pick({k: list(h.values()) for k, h in held.items() if h}, ask, self._rng, whole_below=REPLICAS)
        find = functools.partial(find_values.call, node) if self.values_only else node._call_find_with_blacklist
        answers = await asyncio.gather(*(find(p, [ids[k] for k in ks]) for p, ks in calls.items()),
                                       return_exceptions=True)
        got: dict[str, list] = {k: [] for k in keys}
        asked: Counter[str] = Counter()
        for ks, answer in zip(calls.values(), answers):
            for k in ks:
                asked[k] += 1
                if isinstance(answer, dict) and ids[k] in answer:
                    got[k].append(answer[ids[k]][0])
        for k in keys:
            if not asked[k]:
                continue
            if len(got[k]) < asked[k]:
                self._holders.pop(k, None)  # one is gone or busy: look them up again next time
            if not got[k]:
                continue
            state = _SearchState(ids[k], float("inf"), serializer=protocol.serializer,
                                 record_validator=protocol.record_validator)
            try:
                state.add_candidate(protocol.storage.get(ids[k]), source_node_id=node.node_id)
                state.add_candidate(protocol.cache.get(ids[k]), source_node_id=node.node_id)
                for value in got[k]:
                    state.add_candidate(value, source_node_id=None)
                state.finish_search()
                out[k] = await state.future
            except Exception as e:  # an answer that does not decode: nothing from them this time, logged once
                self._log(k, f"an answer of its nodes could not be merged ({e.__class__.__name__})")
                out[k] = None
        return out

    async def _holders_of(self, ids: dict) -> dict:
        """Per key of ``ids`` (key -> its DHTID), the REPLICAS nodes nearest to it but this one
        (DHTID -> PeerID), or {} where the swarm has fewer; looked up at most every HOLDERS_TTL_S (at
        once after one of them did not answer), the stale keys' in one search."""
        from hivemind.dht.routing import DHTID

        now = time.monotonic()
        stale = [k for k, key_id in ids.items() if (held := self._holders.get(k)) is None
                 or now - held[0] > self.holders_ttl or self._nearer_known(key_id, held[1])]
        if stale:
            # searched for an id beside the key's, which nobody holds: the same nearest nodes (XOR
            # order is kept but between two nodes that differ in the last bit alone), and not one of
            # them answers with the key's whole value (a member key's records: 1.5 MB at 1,000 peers)
            beside = {k: DHTID(int(ids[k]) ^ 1) for k in stale}
            nearest = await self.node.find_nearest_nodes(list(beside.values()), k_nearest=REPLICAS, beam_size=REPLICAS,
                                                         exclude_self=True)
            for k, b in beside.items():
                self._holders[k] = (now, dict(nearest.get(b, {})))
        # (another call may have dropped an entry meanwhile: one of its holders failed). A swarm of
        # fewer nodes: the ones found, while the routing table knows no other (every read asks them
        # all, ``_ask_holders``); one that joins brings a new lookup (``_nearer_known``). None found
        # yet: hivemind's search.
        out = {}
        for k, key_id in ids.items():
            h = self._holders.get(k, (0.0, {}))[1]
            out[k] = h if len(h) >= REPLICAS or (h and not self._nearer_known(key_id, h)) else {}
        return out

    def _nearer_known(self, key_id, holders: dict) -> bool:
        """Whether this node's routing table knows a node nearer to ``key_id`` than one of ``holders``
        (a node that joined since they were looked up), or, where fewer than REPLICAS were found (the
        swarm was smaller), any node beside them: they are looked up again. (A lookup of a founder's
        first seconds found nobody, and its reads searched for the rest of HOLDERS_TTL_S.)"""
        table = getattr(self.node.protocol, "routing_table", None)
        if table is None:
            return False
        near = table.get_nearest_neighbors(key_id, REPLICAS, exclude=self.node.node_id)
        if len(holders) < REPLICAS:
            return any(n not in holders for n, _ in near)
        farthest = max(key_id.xor_distance(h) for h in holders)
        return any(n not in holders and key_id.xor_distance(n) < farthest for n, _ in near)

    async def _store_at_holders(self, key: str, value: Any, expiration_time: float, subkey: Any) -> Optional[bool]:
        """Stores at the REPLICAS nodes nearest to ``key`` (this one among them where it is), asked
        directly once known, the record made and signed as hivemind's ``store_many`` makes it; None
        where they are not known or none took it (the caller stores through hivemind). hivemind's
        store searches for them on every store, each node of the search answering with the key's
        whole dictionary (a member's heartbeat every 2 s made half of an idle swarm's calls)."""
        import dataclasses

        from hivemind.dht.crypto import DHTRecord
        from hivemind.dht.routing import DHTID

        node = self.node
        protocol = getattr(node, "protocol", None)
        if protocol is None or not hasattr(node, "find_nearest_nodes"):
            return None
        key_id = DHTID.generate(source=key)
        keys = read_together(key) if self.together else [key]
        holders = (await self._holders_of({k: DHTID.generate(source=k) for k in keys}))[key]
        if not holders:
            return None
        value_bytes = protocol.serializer.dumps(value)
        record = DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), value_bytes, expiration_time)
        if protocol.record_validator is not None:
            value_bytes = protocol.record_validator.sign_value(record)
            record = dataclasses.replace(record, value=value_bytes)
        nearest = sorted([*holders, node.node_id], key=key_id.xor_distance)[:REPLICAS]
        remote = [holders[n] for n in nearest if n != node.node_id]
        results = await asyncio.gather(*(protocol.call_store(p, keys=[key_id], values=[value_bytes],
                                                             expiration_time=[expiration_time], subkeys=[subkey])
                                         for p in remote), return_exceptions=True)
        # (an answer is the store_ok field of hivemind's response, a protobuf sequence; None if none came)
        taken = [bool(r[0]) for r in results if r is not None and not isinstance(r, BaseException) and len(r)]
        if len(taken) < len(remote):
            self._holders.pop(key, None)  # one is gone or busy: look them up again next time
        if node.node_id in nearest and (protocol.record_validator is None or protocol.record_validator.validate(record)):
            taken.append(protocol.storage.store(key_id, value_bytes, expiration_time, subkey=subkey))
        if not taken:
            return None
        if node.cache_on_store:
            node._update_cache_on_store(key_id, [subkey], [value_bytes], [expiration_time], store_ok=[any(taken)])
        return any(taken)

    def _merge(self, key: str, entries: dict) -> dict:
        """``entries`` of dictionary key ``key`` merged into what this peer read and stored there before
        (per subkey the later expiry wins; expired ones dropped), remembered, and returned: a read that
        some replicas did not answer (a busy machine, a timeout) still gives every entry an earlier
        read saw, until it expires, and this peer's own entries whatever nodes answer. It does not
        depend on hivemind's local cache, which issue 33 means to turn off (its copies are served to
        every other reader)."""
        from hivemind.utils import get_dht_time

        now = get_dht_time()
        mine = {k: v for k, v in self._read.get(key, {}).items() if v.expiration_time >= now}
        for subkey, v in entries.items():
            old = mine.get(subkey)
            if v.expiration_time >= now and (old is None or v.expiration_time >= old.expiration_time):
                mine[subkey] = v
        self._read[key] = mine
        return dict(mine)

    def _admit(self, key: str, subkey: Any, value: Any, expiration: float) -> Any:
        where = f"{key.rsplit('/', 1)[-1]}/{str(subkey)[:16]}"
        if self.key is None:
            if is_sealed(value):
                return self._refuse("sealed-no-key", where, "sealed with a swarm key (this peer has none)")
        else:
            sealer = self.sealer_for(key)
            if sealer is None:  # a grouped swarm's value, before this peer holds the group key
                if is_group_sealed(value) and sealed_key_id(value) == self.key.key_id:
                    return self._refuse("no-group-key", where, "sealed with the group key (this peer has none yet)")
                sealer = self.key  # tells a wrong swarm key, or a swarm without an allow-list
            try:
                value = sealer.open(value, key, subkey, expiration)
            except SealError as e:
                if e.kind == "other-key" and sealer is self.key:
                    self.other_key_ids.add(sealed_key_id(value).hex())
                return self._refuse(e.kind, where, str(e))
            if sealer is not self.sealer_for(key):  # opened with the swarm key where a group key belongs
                return self._refuse("swarm-sealed", where, "sealed with the swarm key alone (its peer has no allow-list)")
        if self.allow is not None:
            signer = signer_of(value)
            if signer not in self.allow:
                return self._refuse("not-allowed", where, f"signed by {signer}, who is not on the allow-list")
        return value

    def _refuse(self, kind: str, where: str, reason: str) -> None:
        self.refused[kind] += 1
        if kind != "no-group-key":  # a joiner's normal state until a member hands it the key
            self._log(where, reason)
        return None

    def why_locked_out(self, swarm: str) -> Optional[str]:
        """Why this peer cannot take part in ``swarm``, from what it was refused (None: nothing
        says so). Called once a first read found no member it could accept."""
        if self.refused["sealed-no-key"]:
            return (f"swarm {swarm!r} is closed: its records are sealed with a swarm key; start this peer "
                    f"with --swarm-key PATH (the key file its members use)")
        if self.refused["other-key"]:
            ours = self.key.key_id.hex() if self.key is not None else "-"
            return (f"swarm {swarm!r} is sealed with another swarm key (key id {', '.join(sorted(self.other_key_ids))}; "
                    f"this peer's --swarm-key has id {ours})")
        if self.refused["unsealed"]:
            return (f"swarm {swarm!r} is open (its records are not sealed), but this peer was given --swarm-key: "
                    f"start it without, or join a closed swarm")
        if self.refused["group-sealed"] or self.refused["no-group-key"] or self.refused["other-group"]:
            return (f"swarm {swarm!r} is closed to the peers on its allow-list: its records are sealed with a group "
                    f"key that only they are handed, and no member handed it to this peer (start it with the "
                    f"swarm's --allow list, which must name it)")
        if self.refused["swarm-sealed"]:
            return (f"swarm {swarm!r} has no allow-list (its records are sealed with the swarm key alone), but this "
                    f"peer was given --allow: start it with the same options as its members")
        if self.refused["forged"]:
            return f"swarm {swarm!r}: its records do not open with this peer's swarm key"
        return None
