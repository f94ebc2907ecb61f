"""Reads and stores straight at a key's nearest nodes (``GuardedDHT``, issue 33), against a fake
network of hivemind's own local storages: the same records where hivemind's search would put them."""
import types

from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage
from hivemind.utils import MSGPackSerializer, get_dht_time

from spantrain_p2p.swarm.guard import REPLICAS, GuardedDHT


class World:
    """Nodes by DHTID, each a storage; ``down`` ones do not answer."""

    def __init__(self, n):
        self.ids = [DHTID.generate() for _ in range(n)]
        self.storage = {i: DHTLocalStorage() for i in self.ids}
        self.down: set = set()


class Node:
    """The slice of hivemind's DHTNode that GuardedDHT uses, at ``world.ids[me]``."""

    def __init__(self, world, me):
        self.world, self.node_id = world, world.ids[me]
        self.protocol = types.SimpleNamespace(serializer=MSGPackSerializer, record_validator=None,
                                              storage=world.storage[self.node_id], cache=DHTLocalStorage(),
                                              call_store=self._call_store)
        self.cache_on_store = False
        self.searches, self.fallbacks = 0, []
        self.asked: list = []  # (peer, number of keys) of every find it made

    async def find_nearest_nodes(self, queries, k_nearest, beam_size, exclude_self):
        self.searches += 1
        others = [i for i in self.world.ids if i != self.node_id]
        return {q: {i: f"peer-{i}" for i in sorted(others, key=q.xor_distance)[:k_nearest]} for q in queries}

    def _by_peer(self, peer):
        return next(i for i in self.world.ids if f"peer-{i}" == peer)

    async def _call_find_with_blacklist(self, peer, keys):
        self.asked.append((peer, len(keys)))
        node = self._by_peer(peer)
        if node in self.world.down:
            return None
        return {k: (self.world.storage[node].get(k), {}) for k in keys}

    async def _call_store(self, peer, keys, values, expiration_time, subkeys):
        node = self._by_peer(peer)
        if node in self.world.down:
            return None
        return [self.world.storage[node].store(k, v, e, subkey=s)
                for k, v, e, s in zip(keys, values, expiration_time, subkeys)]

    async def get(self, key, latest=False, **kw):
        self.fallbacks.append(("get", key))
        return None

    async def get_many(self, keys, **kw):
        self.fallbacks.extend(("get", k) for k in keys)
        return dict.fromkeys(keys)

    async def store(self, key, value, expiration_time, subkey=None, **kw):
        self.fallbacks.append(("store", key))
        return True


def nearest(world, key):
    key_id = DHTID.generate(source=key)
    return set(sorted(world.ids, key=key_id.xor_distance)[:REPLICAS])


async def test_entries_go_to_the_nearest_nodes_and_every_writers_entry_is_read_back():
    world, key = World(12), "spantrain/s/members"
    nodes = [Node(world, i) for i in range(12)]
    t = get_dht_time() + 60
    for i, n in enumerate(nodes):
        assert await GuardedDHT(n).store(key, {"seq": i}, t, subkey=f"p{i}")
    key_id = DHTID.generate(source=key)
    holding = {i for i in world.ids if world.storage[i].get(key_id) is not None}
    assert holding == nearest(world, key)  # where hivemind's store puts them, nowhere else
    reader = GuardedDHT(nodes[0])
    for _ in range(3):
        found = await reader.get(key, latest=True)
        assert {k: v.value for k, v in found.value.items()} == {f"p{i}": {"seq": i} for i in range(12)}
    assert nodes[0].searches == 2  # one lookup for its store, one for its reads: then straight to the nodes
    assert not any(n.fallbacks for n in nodes)


async def test_a_node_that_does_not_answer_sends_the_next_call_to_a_new_lookup():
    world, key = World(10), "spantrain/s/planner"
    writer, reader = Node(world, 0), Node(world, 1)
    assert await GuardedDHT(writer).store(key, "lease", get_dht_time() + 60, subkey="t1")
    guard = GuardedDHT(reader)
    assert (await guard.get(key, latest=True)).value["t1"].value == "lease"
    world.down.add(sorted(nearest(world, key) - {reader.node_id}, key=str)[0])
    assert (await guard.get(key, latest=True)).value["t1"].value == "lease"  # the others still answer
    searches = reader.searches
    await guard.get(key, latest=True)
    assert reader.searches == searches + 1


async def test_with_no_node_known_or_none_answering_hiveminds_own_search_runs():
    world, key = World(4), "spantrain/s/stagemap"
    node = Node(world, 0)
    world.down.update(i for i in world.ids if i != node.node_id)
    guard = GuardedDHT(node)
    assert await guard.get(key, latest=True) is None
    assert ("get", key) in node.fallbacks
    await guard.get(key)  # not a read of the latest value: hivemind's search, as before
    assert node.fallbacks.count(("get", key)) == 2


async def test_a_swarm_under_five_nodes_is_asked_whole_and_a_nearer_newcomer_brings_a_new_lookup():
    """A swarm of fewer than REPLICAS other nodes: a read asks every one of them, once, as hivemind's
    search would visit them (8 keys searched by hivemind made 12 calls a read at 4 peers); once
    known, a node nearer than one of the holders in the routing table (it joined since) makes the
    next call look them up again."""
    world, key = World(4), "spantrain/s/members"
    node = Node(world, 0)
    guard = GuardedDHT(node)
    await guard.get(key, latest=True, holders=1)
    assert not node.fallbacks and sorted(p for p, _ in node.asked) == sorted(f"peer-{i}" for i in world.ids[1:])
    world.ids += [DHTID.generate() for _ in range(8)]
    world.storage.update({i: DHTLocalStorage() for i in world.ids[4:]})
    guard._holders.clear()
    known: list = []
    node.protocol.routing_table = types.SimpleNamespace(
        get_nearest_neighbors=lambda key_id, k, exclude=None: sorted(known, key=lambda x: key_id.xor_distance(x[0]))[:k])
    await guard.get(key, latest=True)
    searches = node.searches
    key_id = DHTID.generate(source=key)
    held = set(guard._holders[key][1])
    farthest = max(held, key=key_id.xor_distance)
    newcomer = next(i for i in iter(DHTID.generate, None) if key_id.xor_distance(i) < key_id.xor_distance(farthest))
    await guard.get(key, latest=True)
    assert node.searches == searches  # nothing new in the routing table: straight to the holders
    known.append((newcomer, "peer-new"))
    world.ids.append(newcomer)
    world.storage[newcomer] = DHTLocalStorage()
    await guard.get(key, latest=True)
    assert node.searches == searches + 1


async def test_a_read_may_ask_one_of_the_keys_nodes_and_a_later_read_another():
    """A peer that reads the member key seldom asks one of its 5 nodes (``holders=1``): a fifth of the
    bytes; every node holds every entry, so the read is whole."""
    world, key = World(12), "spantrain/s/members"
    nodes = [Node(world, i) for i in range(12)]
    t = get_dht_time() + 60
    for i, n in enumerate(nodes):
        assert await GuardedDHT(n).store(key, {"seq": i}, t, subkey=f"p{i}")
    reader = nodes[0]
    guard = GuardedDHT(reader)
    for _ in range(8):
        found = await guard.get(key, latest=True, holders=1)
        assert {k: v.value for k, v in found.value.items()} == {f"p{i}": {"seq": i} for i in range(12)}
    assert len(reader.asked) == 8 and len({p for p, _ in reader.asked}) > 1  # one node a read, not always the same
    await guard.get(key, latest=True)
    assert len(reader.asked) == 8 + REPLICAS  # all of them: the key's nearest nodes but the reader itself


async def test_a_read_of_many_keys_asks_each_node_it_picks_once_for_all_the_keys_it_holds():
    """The member buckets (``keys.members_keys``): in a swarm of 6 nodes every node holds nearly every
    key, so a read of all 8 asks about 2 nodes (``holders=2``), not 16 calls; in one of 60 the keys'
    nodes differ and each key is asked of its own 2. Every writer's entry is read back either way."""
    from spantrain_p2p.swarm import keys as swarm_keys

    for n, most_calls in ((6, 3), (60, 16)):
        world = World(n)
        nodes = [Node(world, i) for i in range(n)]
        names = swarm_keys.members_keys("s")
        t = get_dht_time() + 60
        writers = nodes[:min(12, n - 1)]
        for i, node in enumerate(writers):
            assert await GuardedDHT(node).store(names[i % len(names)], {"seq": i}, t, subkey=f"p{i}")
        reader = nodes[-1]
        asked = reader.asked
        guard = GuardedDHT(reader)
        found = await guard.get_many(names, latest=True, holders=2)
        entries = {k: v.value for name in names if found[name] is not None for k, v in found[name].value.items()}
        assert entries == {f"p{i}": {"seq": i} for i in range(len(writers))}
        assert sum(k for _, k in asked) == 2 * len(names)  # each key of 2 of its nodes
        assert len(asked) <= most_calls and len({p for p, _ in asked}) == len(asked)
        assert reader.searches == 1  # the holders of all 8 keys looked up in one search
        assert not reader.fallbacks


async def test_a_lookup_that_found_too_few_nodes_is_redone_once_the_routing_table_knows_more():
    """A founder's first lookup finds few nodes; once its routing table knows more nodes than that
    lookup found, its next read looks the holders up again (not after HOLDERS_TTL_S)."""
    world, key = World(4), "spantrain/s/members.00"
    node = Node(world, 0)
    known: list = [(i, f"peer-{i}") for i in world.ids[1:]]
    node.protocol.routing_table = types.SimpleNamespace(
        get_nearest_neighbors=lambda key_id, k, exclude=None: sorted(known, key=lambda x: key_id.xor_distance(x[0]))[:k])
    guard = GuardedDHT(node)
    await guard.get(key, latest=True)
    await guard.get(key, latest=True)
    assert node.searches == 1 and not node.fallbacks  # the 3 others, asked directly
    new = [DHTID.generate() for _ in range(8)]
    world.ids += new
    world.storage.update({i: DHTLocalStorage() for i in new})
    known += [(i, f"peer-{i}") for i in new]
    await guard.get(key, latest=True)
    assert node.searches == 2 and not node.fallbacks  # looked up again: the 5 nearest of 11


async def test_a_holder_dropped_by_another_call_during_a_lookup_is_no_error():
    """A store whose holder failed drops that key's holders while a read of several keys waits for its
    lookup of the others: the read goes on (the dropped key searched), it does not raise."""
    world = World(12)
    node = Node(world, 0)
    guard = GuardedDHT(node)
    a, b = "spantrain/s/members.00", "spantrain/s/members.01"
    await guard.get(a, latest=True)  # a's holders known
    real = node.find_nearest_nodes

    async def lookup(queries, **kw):
        guard._holders.pop(a, None)  # meanwhile, another call found one of a's holders gone
        return await real(queries, **kw)

    node.find_nearest_nodes = lookup
    found = await guard.get_many([a, b], latest=True)
    assert set(found) == {a, b}


async def test_a_stores_lookup_of_a_member_key_looks_up_all_eight_with_it():
    """A heartbeat's store and a read of all 8 member keys share one lookup: the store's key found
    stale brings the others with it (before, the two ran out of step: two lookups a minute, not one)."""
    from spantrain_p2p.swarm import guard as guard_module
    from spantrain_p2p.swarm import keys as swarm_keys

    world = World(30)
    node = Node(world, 0)
    g = GuardedDHT(node)
    names = swarm_keys.members_keys("s")
    clock = [1000.0]
    real = guard_module.time.monotonic
    guard_module.time.monotonic = lambda: clock[0]
    try:
        assert await g.store(names[3], {"seq": 1}, get_dht_time() + 60, subkey="p0")
        assert node.searches == 1 and set(g._holders) == set(names)  # all 8 in the store's one lookup
        await g.get_many(names, latest=True, holders=1)
        assert node.searches == 1
        clock[0] += guard_module.HOLDERS_TTL_S + 1
        assert await g.store(names[3], {"seq": 2}, get_dht_time() + 60, subkey="p0")
        await g.get_many(names, latest=True, holders=1)
        assert node.searches == 2  # one lookup for both again, in step
    finally:
        guard_module.time.monotonic = real
    assert swarm_keys.read_together("spantrain/s/stagemap") == ["spantrain/s/stagemap"]
