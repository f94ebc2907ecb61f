"""The islands' exchange in one process, peers joined by a fake data plane that can cut an island
off: a silent island is left out and the others go on, it catches up (merging the members'
contributions, or fetching their state when the cut lost them) and contributes again, and every
island ends on the same anchor with no round merged twice."""
from __future__ import annotations

import asyncio
import hashlib
from types import SimpleNamespace

import pytest
import torch

from spantrain_p2p.net.dataplane import RemoteError, Retry
from spantrain_p2p.net.framing import FrameError
from spantrain_p2p.pipeline.executor import StepFailed
from spantrain_p2p.islands import members as island_members
from spantrain_p2p.islands.exchange import OUTER, OUTER_FETCH, OUTER_MEMBERS, OuterSync

LAYERS = 2


class _Net:
    """Routes each send to the receiver's handler; a cut island neither sends nor receives."""

    def __init__(self):
        self.syncs: dict[str, OuterSync] = {}
        self.cut: set[str] = set()
        self.fetch_s = 0.0  # how long an outer state's reply takes to arrive (a slow link)
        self.cut_at: tuple[str, int] | None = None  # (peer, round): its contribution of that round begins the cut
        self.begin_cut = lambda: None
        self.cut_to: tuple[str, int] | None = None  # (receiver, layer): the cut begins at that message of cut_at's

    def client(self, me: str):
        net = self

        class _Client:
            async def send(self, url, kind, header, buffers=(), timeout=30.0, link=None, charge=1.0,
                           reply_charge=1.0, peer_id=None, **_):
                if kind == OUTER and net.cut_at == (me, header["round"]) and net.cut_to in (None, (url, header["layer"])):
                    net.cut_at = None
                    net.begin_cut()  # before this contribution leaves: it is lost, whatever the timing
                await asyncio.sleep(0.001)
                if me in net.cut or url in net.cut:
                    await asyncio.sleep(0.05)
                    raise ConnectionError("cut")
                target = net.syncs[url]
                handler = {OUTER: target.on_outer, OUTER_FETCH: target.on_fetch,
                           OUTER_MEMBERS: target.on_members}[kind]
                try:
                    reply = await handler({**header, "src": me}, [bytes(b) for b in buffers])
                except FrameError as e:
                    raise RemoteError(400, str(e)) from None
                except Retry as e:
                    raise RemoteError(503, str(e)) from None
                if reply is None:
                    return None
                if kind == OUTER_FETCH:
                    await asyncio.sleep(net.fetch_s)
                h, bufs = reply
                return h, [memoryview(bytes(b)) for b in bufs]
        return _Client()


def _world(steps_per_round=(2, 1), split_second=False, replica=False):
    """Islands of one peer holding both layers; with ``split_second`` the second island is two
    peers of one layer each (a pipeline's stages: each catches up on its own, to the same round);
    with ``replica`` the first island's stage has a second replica, i0b (the keeper is i0)."""
    layouts = {0: [("i0", (0, LAYERS))] + ([("i0b", (0, LAYERS))] if replica else [])}
    layouts[1] = [("i1", (0, 1)), ("i1b", (1, LAYERS))] if split_second else [("i1", (0, LAYERS))]
    islands = [SimpleNamespace(steps_per_round=h, predicted_step_s=0.01) for h in steps_per_round]
    stages = {k: [SimpleNamespace(peers=(n,), layers=span) for n, span in lay] for k, lay in layouts.items()}
    if replica:
        stages[0] = [SimpleNamespace(peers=("i0", "i0b"), layers=(0, LAYERS))]
    smap = SimpleNamespace(islands=islands, island_map=lambda k: SimpleNamespace(stages=stages[k]),
                           exchange_codec="int8", epoch=1, name_of=lambda p: p, start_data_step=0,
                           predicted_step_s=0.01)
    job = SimpleNamespace(job_id="j", recv_timeout_s=3.0, outer_lr=0.7, outer_momentum=0.9, steps=10_000, aggregate="robust")
    net = _Net()
    peers = {}
    for k, lay in layouts.items():
        for n, span in lay:
            torch.manual_seed(0)
            full = {i: [torch.nn.Parameter(torch.randn(16))] for i in range(LAYERS)}
            layers = {i: full[i] for i in range(*span)}
            peer = SimpleNamespace(peer_id=n, client=net.client(n), data_url_of=lambda p: p, link_to=lambda p: None,
                                   name_of=lambda p: p, last_data_url=lambda p: p, swim=SimpleNamespace(
                                       url_of=lambda p: p, ping=_answers))
            sync = OuterSync(peer, lambda ev: None)
            sync.begin(job, smap, k, layers, LAYERS)
            net.syncs[n] = sync
            peers[n] = (sync, layers)
    return net, peers, job


async def _island(sync: OuterSync, layers, k: int, rounds: int, steps_per_round: int, step_s: float):
    """One island's rounds: each 'step' nudges the weights; the exchange at each round's end."""
    r, base, gen = 0, 0, torch.Generator().manual_seed(k + 1)
    done = []
    while r < rounds:
        for _ in range(steps_per_round):
            await asyncio.sleep(step_s)
            with torch.no_grad():
                for _i, ps in sorted(layers.items()):
                    ps[0].add_(torch.randn(16, generator=gen) * 0.01)
        fig = await sync.round_end(r, 100 * steps_per_round, base + 3, last=r == rounds - 1)
        done.append(r)
        if "rejoin" in fig:
            r, base = fig["rejoin"][0], fig["rejoin"][1]
        else:
            r, base = r + 1, base + 3
    return done


def _digest(sync: OuterSync) -> str:
    return hashlib.sha256(b"".join(a.numpy().tobytes() for _i, a in sorted(sync.outer.anchor.items()))).hexdigest()


def _run_cut(net: _Net, islands: list, cut: set[str], for_s: float | None = None, at_round: int = 6,
             for_rounds: int = 5, to: tuple[str, int] | None = None) -> list[list[int]]:
    """Runs the islands (``_island`` coroutines) while the peers ``cut`` are cut off from the moment
    i1 sends its contribution of round ``at_round`` until the keeper's island (i0) has ended
    ``for_rounds`` more rounds (events, not times: on a loaded machine the rounds a second differ,
    and a cut of 0.8 s lost fewer rounds than the 3 a peer keeps, so the cut island caught up
    without the fetch a test was about), or, with ``for_s``, for that many seconds (a cut of the
    keeper itself, which is about the receive deadline); the rounds each island went through. That
    contribution is lost, so island 1 is left out of the round whichever island is cut; with ``to``
    (receiver, layer) the cut begins at that one of its messages, the ones before it delivered."""
    async def main():
        loop = asyncio.get_running_loop()
        keeper = net.syncs["i0"]
        real_round_end = keeper.round_end
        ended = [0]

        async def round_end(r, *a, **kw):
            out = await real_round_end(r, *a, **kw)
            if net.cut and for_s is None:
                ended[0] += 1
                if ended[0] >= for_rounds:
                    net.cut.difference_update(cut)
            return out

        def begin_cut():
            net.cut.update(cut)
            if for_s is not None:
                loop.call_later(for_s, net.cut.difference_update, cut)

        keeper.round_end = round_end
        net.cut_at, net.cut_to, net.begin_cut = ("i1", at_round), to, begin_cut
        return await asyncio.gather(*islands)

    return asyncio.run(main())


def test_a_cut_island_is_left_out_catches_up_and_ends_on_the_same_anchor(monkeypatch):
    monkeypatch.setattr(island_members, "LEAVE_MIN_S", 0.3)
    net, peers, job = _world()
    (s0, l0), (s1, l1) = peers["i0"], peers["i1"]

    done0, done1 = _run_cut(net, [_island(s0, l0, 0, 40, 2, 0.05), _island(s1, l1, 1, 40, 1, 0.1)], {"i1"})
    assert done0 == list(range(40))  # the keeper's island went through every round
    left = [row for row in s0.left_out]
    assert left and all(row["islands"] == [1] for row in left)
    # the cut island caught up (fetching: the cut lost the contributions) and rejoined later on
    assert s1.rejoins and s1.rejoins[0]["dropped"] and s1.rejoins[0]["fetched"]
    assert len(done1) < 40 and done1[-1] == 39
    # once back it was a member again: the last rounds merged both islands
    assert s0.rounds[-1]["members"] == [0, 1] and s1.rounds[-1]["members"] == [0, 1]
    merged0 = [row["round"] for row in s0.rounds]
    assert merged0 == list(range(40))  # each round merged once, in order, by the keeper
    merged1 = [row["round"] for row in s1.rounds]
    assert len(merged1) == len(set(merged1))  # none twice on the cut island either
    assert _digest(s0) == _digest(s1)
    for i in range(LAYERS):  # and the weights are the anchor on both
        assert torch.equal(l0[i][0].detach(), s0.outer.anchor[i]) and torch.equal(l1[i][0].detach(), s1.outer.anchor[i])


def test_a_fetch_slower_than_the_kept_rounds_still_lands(monkeypatch):
    """Each layer's outer state takes 0.4 s to arrive, ~4 of the keeper's rounds: the version being
    fetched outlives the 3 a peer keeps while the fetch goes on (before, the second layer's request
    found it gone and the epoch failed); the cut island merges forward from it and ends on the
    keeper's anchor."""
    monkeypatch.setattr(island_members, "LEAVE_MIN_S", 0.3)
    net, peers, job = _world()
    net.fetch_s = 0.4
    (s0, l0), (s1, l1) = peers["i0"], peers["i1"]

    done0, done1 = _run_cut(net, [_island(s0, l0, 0, 40, 2, 0.05), _island(s1, l1, 1, 40, 1, 0.1)], {"i1"})
    assert done0 == list(range(40)) and s0.left_out
    assert s1.rejoins and any(row["fetched"] for row in s1.rejoins)
    assert s0.rounds[-1]["members"] == [0, 1]
    merged1 = [row["round"] for row in s1.rounds]
    assert len(merged1) == len(set(merged1))
    assert _digest(s0) == _digest(s1)


async def _answers(peer_id: str, timeout_s: float) -> bool:
    """A liveness ping past the emulated link (``swarm.liveness.is_alive``): a live peer answers it."""
    return True


def _keeper_cut(gone: bool):
    """The keeper's island (i0) cut off for 4.5 s, past i1's deadline for an answer (the receive
    timeout, 3 s, plus two rounds); with ``gone`` it is dead meanwhile (its record gone, no ping
    answered), else alive behind the cut link."""
    net, peers, job = _world()
    (s0, l0), (s1, l1) = peers["i0"], peers["i1"]
    if gone:
        async def dead_while_cut(p: str, timeout_s: float) -> bool:
            return not (p == "i0" and "i0" in net.cut)

        s1.peer.data_url_of = lambda p: None if p == "i0" and "i0" in net.cut else p
        s1.peer.swim.ping = dead_while_cut

    return _run_cut(net, [_island(s0, l0, 0, 80, 2, 0.05), _island(s1, l1, 1, 80, 1, 0.1)], {"i0"}, 4.5), s0, s1


def test_a_cut_keeper_still_alive_is_waited_for_past_the_deadline(monkeypatch):
    """The link to the keeper is cut longer than the deadline while it answers a liveness ping (past
    the emulated link, as the planner asks: with SWIM its record leaves the view): i1 waits (failing the epoch would only re-plan the same islands), then catches up."""
    monkeypatch.setattr(island_members, "LEAVE_MIN_S", 0.3)
    (done0, done1), s0, s1 = _keeper_cut(gone=False)
    assert done0 == list(range(80)) and s0.left_out
    assert s1.rejoins and done1[-1] == 79
    assert s0.rounds[-1]["members"] == [0, 1] and _digest(s0) == _digest(s1)


def test_a_keeper_dead_fails_the_epoch_at_the_deadline(monkeypatch):
    monkeypatch.setattr(island_members, "LEAVE_MIN_S", 0.3)
    with pytest.raises(StepFailed, match="the keeper i0 gave no members in time"):
        _keeper_cut(gone=True)


def test_the_peers_of_a_cut_island_catch_up_to_the_same_round(monkeypatch):
    """Island 1 is two peers (one layer each) asking the keeper at different moments: they hear the
    same answers, rejoin at the same round, and every layer ends on the keeper's anchor."""
    monkeypatch.setattr(island_members, "LEAVE_MIN_S", 0.3)
    net, peers, job = _world(split_second=True)
    (s0, l0), (sa, la), (sb, lb) = peers["i0"], peers["i1"], peers["i1b"]

    done0, done_a, done_b = _run_cut(net, [_island(s0, l0, 0, 40, 2, 0.05), _island(sa, la, 1, 40, 1, 0.1),
                                           _island(sb, lb, 1, 40, 1, 0.13)], {"i1", "i1b"})
    assert done0 == list(range(40)) and s0.left_out
    assert done_a == done_b and len(done_a) < 40  # the same rounds, the lost ones skipped by both
    assert [row["caught_up_to"] for row in sa.rejoins] == [row["caught_up_to"] for row in sb.rejoins]
    assert torch.equal(sa.outer.anchor[0], s0.outer.anchor[0]) and torch.equal(sb.outer.anchor[1], s0.outer.anchor[1])


def test_an_island_late_once_is_left_out_merges_the_members_contributions_and_goes_on(monkeypatch):
    """No cut: one island stalls past the keeper's wait for one round. Its contribution is dropped,
    it catches up (merging the contributions it holds, fetching where the keeper ran too far ahead)
    and ends on the keeper's anchor."""
    monkeypatch.setattr(island_members, "LEAVE_MIN_S", 0.3)
    net, peers, job = _world()
    (s0, l0), (s1, l1) = peers["i0"], peers["i1"]
    real_round_end = s1.round_end

    async def slow_round_end(r, *a, **kw):
        if r == 5:
            await asyncio.sleep(0.6)  # past the keeper's wait for round 4... its contribution of 5 is late
        return await real_round_end(r, *a, **kw)

    s1.round_end = slow_round_end

    async def main():
        return await asyncio.gather(_island(s0, l0, 0, 20, 2, 0.05), _island(s1, l1, 1, 20, 1, 0.1))

    done0, done1 = asyncio.run(main())
    assert done0 == list(range(20))
    assert [row["islands"] for row in s0.left_out] == [[1]] * len(s0.left_out) and s0.left_out
    assert s1.rejoins and s1.rejoins[0]["dropped"] and s1.rejoins[0]["round"] in {r["round"] for r in s0.left_out}
    assert _digest(s0) == _digest(s1)


def test_a_replica_that_lost_an_islands_contribution_takes_the_round_as_the_keeper_merged_it(monkeypatch):
    """Island 1 is cut off just as its contribution of round 4 reaches the keeper, i0, and not yet
    i0b, the keeper's replica (its last message): the keeper counts island 1 in, and i0b, lacking it,
    waited until the link was back or the epoch failed, holding its whole island (the cut-off test,
    12 s). It takes the round as the keeper merged it instead, once the keeper's wait for an island
    is over: every round goes on, and every peer ends on the same anchor."""
    monkeypatch.setattr(island_members, "LEAVE_MIN_S", 0.3)
    net, peers, job = _world(replica=True)
    (s0, l0), (sb, lb), (s1, l1) = peers["i0"], peers["i0b"], peers["i1"]
    done0, done_b, done1 = _run_cut(net, [_island(s0, l0, 0, 20, 2, 0.05), _island(sb, lb, 0, 20, 2, 0.05),
                                          _island(s1, l1, 1, 20, 1, 0.1)], {"i1"}, at_round=4, to=("i0b", LAYERS - 1))
    assert done0 == done_b == list(range(20)) and s0.left_out
    fetched = [row["round"] for row in sb.rounds if row.get("fetched")]
    assert fetched == [4], sb.rounds  # the one round it lacked, taken as the keeper merged it
    assert [row["round"] for row in sb.rounds] == [row["round"] for row in s0.rounds]
    assert _digest(s0) == _digest(sb) == _digest(s1)


def test_an_island_caught_up_to_a_decided_round_is_expected_at_the_next_one():
    """A left-out island asks about the round whose state it fetched, returning at the next: where that
    round is decided and the next is not, the keeper expects it there (as where the round is
    undecided). Before, it was given the latest state again, fetched it, and was one round behind
    for good when a fetch took as long as a round of the others (the cut-off test, 1 suite run in 2)."""
    net, peers, job = _world()
    keeper = peers["i0"][0]
    keeper.decisions, keeper.round = {5: [0]}, 6
    header = {"job": "j", "epoch": 1, "round": 5, "island": 1, "returning": 6, "src": "i1"}
    with pytest.raises(Retry):
        asyncio.run(keeper.on_members(header, []))
    assert keeper._returning == {1: 6}
    with pytest.raises(Retry):  # the same question, the same answer
        asyncio.run(keeper.on_members(header, []))
    keeper.decisions.update({6: [0], 7: [0]})  # the next decided too: nothing to wait for there, the latest state instead
    keeper.round, keeper.versions = 8, {7: (70, {})}
    got, _ = asyncio.run(keeper.on_members({**header, "round": 6, "returning": 7}, []))
    assert got["members"] == [0] and got["latest"] == [7, 70]
