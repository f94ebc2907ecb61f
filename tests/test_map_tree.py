"""The tree a new stage map goes down (train.map_tree): pure logic."""
from spantrain_p2p.train import map_tree


def _ids(n):
    return [f"Qm{i:05d}" for i in range(n)]


def test_every_peer_of_the_map_gets_it_once_and_nobody_sends_more_than_fanout_copies():
    for n in (1, 2, 8, 9, 64, 73, 1000):
        peers = _ids(n)
        root = peers[n // 2]
        tree = map_tree.order(peers, root, term=3, epoch=7)
        assert sorted(tree) == sorted(set(peers) - {root})
        got: dict[str, str] = {}
        for sender in [root, *tree]:
            kids = map_tree.children(tree, sender, root)
            assert len(kids) <= map_tree.FANOUT
            for k in kids:
                assert k not in got, (n, k)  # one parent each
                got[k] = None if sender == root else sender
        assert set(got) == set(tree)
        # the deepest peer is depth() hops from the root
        def hops(p):
            h = 1
            while got[p] is not None:
                p, h = got[p], h + 1
            return h
        assert max((hops(p) for p in tree), default=0) == map_tree.depth(len(tree))


def test_the_order_is_the_same_everywhere_and_another_each_epoch():
    peers = _ids(50)
    a = map_tree.order(peers, peers[0], 1, 4)
    assert a == map_tree.order(list(reversed(peers)), peers[0], 1, 4)  # (the map's order does not matter)
    b = map_tree.order(peers, peers[0], 1, 5)
    assert a != b and sorted(a) == sorted(b)
    # the root's children are the first FANOUT; a peer outside the tree hands it to nobody
    assert map_tree.children(a, peers[0], peers[0]) == a[:map_tree.FANOUT]
    assert map_tree.children(a, "QmStranger", peers[0]) == []
    assert map_tree.depth(1000) == 4 and map_tree.depth(8) == 1 and map_tree.depth(0) == 0
