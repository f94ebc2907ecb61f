"""Parts of one layer's state held by the replicas of a sharded stage (``models.state``): put together,
told whole or not, and where the parts held across peers make a layer whole."""
import pytest
import torch
from torch import nn

from spantrain_p2p.net.framing import FrameError
from spantrain_p2p.models import state


def _layer_and_opt():
    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    opt = torch.optim.Adam(layer.parameters(), lr=0.1)
    layer(torch.randn(4, 3)).sum().backward()
    opt.step()
    return layer, opt


def test_two_replicas_parts_make_the_whole_state_and_load_like_it():
    layer, opt = _layer_and_opt()
    whole = state.capture(layer, opt)
    a = state.capture(layer, opt, foreign=frozenset({"bias"}))  # its replica holds the bias's moments
    b = state.capture(layer, opt, foreign=frozenset({"weight"}))
    assert state.missing(whole) == frozenset() and state.missing(a) == {"bias"} and state.missing(b) == {"weight"}
    assert not any(n.startswith("o:bias:") for n, _ in a)
    merged = state.merge(a, b)
    assert state.missing(merged) == frozenset()
    assert sorted((n, t.tolist()) for n, t in merged) == sorted((n, t.tolist()) for n, t in whole)
    assert state.merge(a, a) is a  # a part lacking the same: nothing to take
    # the wire: the markers travel and are checked against the layer
    header, bufs = state.encode(a)
    back = state.decode(header, bufs, state.expected_shapes(layer))
    assert state.missing(back) == {"bias"}
    bad = {"names": header["names"] + ["x:nothing"], "shapes": header["shapes"] + [[0]]}
    with pytest.raises(FrameError, match="names no parameter"):
        state.decode(bad, bufs + [memoryview(b"")], state.expected_shapes(layer))
    # loaded on a replica that owns the weight: the bias's moments stay the other replica's
    fresh = nn.Linear(3, 2)
    opt2 = torch.optim.Adam(fresh.parameters())
    state.apply(fresh, opt2, merged, foreign=frozenset({"bias"}))
    assert fresh.bias not in opt2.state and fresh.weight in opt2.state
    assert torch.equal(fresh.weight, layer.weight) and torch.equal(fresh.bias, layer.bias)
    assert torch.equal(opt2.state[fresh.weight]["exp_avg"], opt.state[layer.weight]["exp_avg"])


def test_a_store_of_copies_puts_parts_together_and_a_whole_copy_replaces_what_was_held():
    layer, opt = _layer_and_opt()
    a = state.capture(layer, opt, foreign=frozenset({"bias"}))
    b = state.capture(layer, opt, foreign=frozenset({"weight"}))
    store = state.Store()
    store.put(4, 9, a, merge_parts=True)
    assert state.missing(store.get(4, 9)) == {"bias"}
    store.put(4, 9, b, merge_parts=True)
    assert state.missing(store.get(4, 9)) == frozenset()
    whole = store.get(4, 9)
    store.put(4, 9, a, merge_parts=True)  # a newer part: completed from the whole one held
    assert state.missing(store.get(4, 9)) == frozenset()
    assert sorted((n, t.tolist()) for n, t in store.get(4, 9)) == sorted((n, t.tolist()) for n, t in whole)
    newer = state.capture(layer, opt)  # a whole copy (a lone stage's) replaces what was held, as before sharding
    store.put(4, 9, newer, merge_parts=True)
    assert store.get(4, 9) is newer


def test_a_layer_is_whole_at_a_step_where_the_parts_held_lack_nothing_together():
    w, b = frozenset({"weight"}), frozenset({"bias"})
    peers = [{0: {5: w, 6: w}, 1: {5: w}},   # peer 1's parts
             {0: {5: b, 6: w}, 1: {6: b}}]   # peer 2's
    assert state.covered(peers) == {0: [5]}  # layer 0 at step 6 lacks the weight's everywhere; layer 1 never both
    assert state.covered([]) == {}


def test_a_store_keeps_the_latest_steps_and_the_latest_multiples_of_the_copy_interval():
    """Buddy copies go after every 4th step and take a few steps to land: a peer keeps its own
    snapshots of the last three multiples of 4 beside its latest three, so the step a dead peer's
    copy was taken at is still held by every other peer (one step ahead or behind)."""
    store = state.Store(keep_steps=3)
    for step in range(0, 15):
        store.put(1, step, [])
    assert store.inventory() == {1: [12, 13, 14]}  # copies after every step: the latest three
    store = state.Store(keep_steps=3)
    for step in range(0, 15):
        store.put(1, step, [], pin_every=4)
    assert store.inventory() == {1: [4, 8, 12, 13, 14]}


def test_a_resume_keeps_the_pinned_steps_and_forgets_the_abandoned_timeline():
    """Copies every 8 steps, a crash after step 29, the swarm resumes at 24: the peer reloads 24,
    forgets 25-29 (redone; kept, they would push out the redone steps' snapshots) and keeps 8 and
    16, where a second crash before the next copy lands may have to go."""
    store = state.Store(keep_steps=3)
    for step in range(30):
        store.put(1, step, [], pin_every=8)
    assert store.inventory() == {1: [8, 16, 24, 27, 28, 29]}
    store.drop_after(1, 24)
    store.put(1, 24, [], pin_every=8)
    for step in (25, 26):
        store.put(1, step, [], pin_every=8)
    assert store.inventory() == {1: [8, 16, 24, 25, 26]}


def test_the_steps_an_inventory_named_stay_held_while_the_peer_trains_on():
    """A planner read this peer's inventory (steps 8-10) and resumes its next map from step 10, which
    reaches the peers 3 steps later: the named steps are still there; once the hold runs out, the
    store keeps its latest three again. Holds within the time add up, 2 x keep steps at most."""
    import time

    store = state.Store(keep_steps=3)
    for step in range(11):
        store.put(0, step, [])
    store.hold(time.monotonic() + 60)
    for step in range(11, 14):
        store.put(0, step, [])
    assert store.inventory() == {0: [8, 9, 10, 11, 12, 13]}
    store.hold(time.monotonic() + 60)  # a resuming peer's read: both are held
    for step in range(14, 30):
        store.put(0, step, [])
    assert store.inventory() == {0: [8, 9, 10, 11, 12, 13, 27, 28, 29]}
    for _ in range(5):  # reads cannot pin more than 2 x keep steps a layer
        store.hold(time.monotonic() + 60)
        store.put(0, 30 + _, [])
    assert len(store.inventory()[0]) <= 2 * 3 + 3
    store.hold(time.monotonic() - 1)  # run out
    store.put(0, 40, [])
    assert store.inventory() == {0: [33, 34, 40]}


def test_a_layer_walked_again_finds_the_same_tensors_and_notices_what_moved():
    """A layer's next snapshots reuse where its first walk found its tensors: the entries are the
    ones a fresh walk finds, the same tensors, through optimizer steps, a replaced parameter, a
    state that appears later (SGD's momentum), another optimizer, and a state that is no float32
    tensor (walked afresh every time)."""
    from spantrain_p2p.models.state import _walk

    def same(layer, opt):
        got, own = state.walk(layer, opt, [("s:scale", torch.tensor(8.0))])
        want, want_own = _walk(layer, opt, frozenset())
        assert [n for n, _ in got[:-1]] == [n for n, _ in want] and own == want_own
        # the same tensors (a float64 state is converted afresh by either walk: equal then)
        assert all(a is b or (b.dtype == torch.float32 and a.dtype == b.dtype and torch.equal(a, b) and
                              b.data_ptr() != a.data_ptr()) for (_, a), (_, b) in zip(got, want))
        assert got[-1][0] == "s:scale"

    def train(layer, opt):
        layer(torch.randn(3, 4)).sum().backward()
        opt.step()

    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.BatchNorm1d(4))
    adam = torch.optim.Adam(layer.parameters(), foreach=True)
    same(layer, adam)  # no state yet
    for _ in range(2):
        train(layer, adam)
        same(layer, adam)
    layer[0].weight = torch.nn.Parameter(layer[0].weight.detach() + 1)  # replaced: not the optimizer's
    same(layer, adam)
    sgd = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    same(layer, sgd)
    train(layer, sgd)  # its momentum appears
    same(layer, sgd)
    sgd.state[layer[1].weight]["momentum_buffer"] = torch.zeros(4, dtype=torch.float64)
    same(layer, sgd)
    same(layer, sgd)
