"""A find that answers with the values alone: how a peer reads keys from the nodes that hold them.

hivemind's ``rpc_find`` answers every key with the node's 20 nearest neighbours besides the value
(about 1.2 KB a key), which a search needs to go on and a read straight at a key's holders
(``GuardedDHT``) throws away: with the member records in eight keys (``keys.MEMBER_BUCKETS``), a
seldom reader's read of 16 peers' records carried 7 KB of neighbours beside 23 KB of records.
Each peer serves ``NAME`` beside hivemind's handlers: the same answer as ``rpc_find`` (same storage,
same cache, the same record validation on the reader's side), with the neighbours left out. A node
that does not serve it (a bare hivemind node) is asked with ``rpc_find`` instead.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Collection, Optional

log = logging.getLogger(__name__)

NAME = "spantrain.find_values"
MAX_KEYS = 64  # keys one request may ask for (a read of every member key asks 8)


async def serve(p2p, protocol) -> None:
    """Registers the handler on ``p2p`` for the DHT ``protocol`` of this node."""
    from hivemind.proto import dht_pb2

    async def find_values(request: dht_pb2.FindRequest, context) -> dht_pb2.FindResponse:
        if len(request.keys) > MAX_KEYS or len(set(request.keys)) != len(request.keys):
            raise ValueError(f"a find of {len(request.keys)} keys ({len(set(request.keys))} different): "
                             f"this node answers at most {MAX_KEYS}, each once")
        response = await protocol.rpc_find(request, context)
        for result in response.results:
            del result.nearest_node_ids[:]
            del result.nearest_peer_ids[:]
        return response

    await p2p.add_protobuf_handler(NAME, find_values, dht_pb2.FindRequest)


async def call(node, peer, keys: Collection) -> Optional[dict]:
    """``DHTNode._call_find_with_blacklist(peer, keys)`` for a read at a key's holders: DHTID -> (value
    or None, {}), the values validated as hivemind's ``call_find`` validates them; None where the
    peer did not answer. A peer without the handler is asked with hivemind's find."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.proto import dht_pb2
    from hivemind.utils import ValueWithExpiration

    protocol = node.protocol
    if peer in node.blacklist:
        return None
    keys = list(keys)
    request = dht_pb2.FindRequest(keys=[k.to_bytes() for k in keys], peer=protocol.node_info)
    try:
        async with protocol.rpc_semaphore:
            response = await asyncio.wait_for(
                protocol.p2p.call_protobuf_handler(peer, NAME, request, dht_pb2.FindResponse), protocol.wait_timeout)
    except asyncio.TimeoutError:
        _failed(node, peer)
        return None
    except Exception as e:  # no such handler (a bare hivemind node), or the peer is gone: hivemind's call says which
        log.debug("find_values at %s failed (%s): asking with rpc_find", peer, e)
        return await node._call_find_with_blacklist(peer, keys)
    if len(response.results) != len(keys):
        _failed(node, peer)
        return None
    node.blacklist.register_success(peer)
    if response.peer and response.peer.node_id:  # as hivemind's call_find: the routing table learns who answered
        asyncio.create_task(protocol.update_routing_table(DHTID.from_bytes(response.peer.node_id), peer, responded=True))
    out = {}
    for key, result in zip(keys, response.results):
        key_bytes = DHTID.to_bytes(key)
        value = None
        if result.type == dht_pb2.FOUND_REGULAR:
            if protocol._validate_record(key_bytes, protocol.IS_REGULAR_VALUE, result.value, result.expiration_time):
                value = ValueWithExpiration(result.value, result.expiration_time)
        elif result.type == dht_pb2.FOUND_DICTIONARY:
            try:
                dictionary = protocol.serializer.loads(result.value)
            except Exception:
                dictionary = None
            if isinstance(dictionary, DictionaryDHTValue) and protocol._validate_dictionary(key_bytes, dictionary):
                value = ValueWithExpiration(dictionary, result.expiration_time)
        out[key] = (value, {})
    return out


def _failed(node, peer) -> None:
    """As hivemind's ``call_find`` and ``_call_find_with_blacklist`` after no answer: the peer is
    blacklisted for a while and leaves the routing table (else a lookup would keep finding it nearer
    than the holders it found, and look them up again on every read)."""
    node.blacklist.register_failure(peer)
    protocol = node.protocol
    asyncio.create_task(protocol.update_routing_table(protocol.routing_table.get(peer_id=peer), peer, responded=False))
