"""The statistical gate at stage boundaries (robust.gate) and the evictions it leads to
(train.defence: receivers, gate_evictions; the planner reading them): pure logic, no peers."""
import math
import statistics

import pytest

import torch

from spantrain_p2p.robust import attacks
from spantrain_p2p.robust.gate import Gate
from spantrain_p2p.train.defence import Accusation as A, gate_evictions, receivers


def _act(seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(seed)) * scale


def test_honest_tensors_pass_an_odd_one_is_named_and_what_no_data_gives_is_refused():
    g = Gate()
    for i in range(40):  # an honest stream, drifting slowly (x 1.02 a tensor: x 2.2 in all)
        assert g.judge("act", "b", _act(i, 1.02 ** i)) is None
    what, why = g.judge("act", "b", _act(98, 2.2 * 12))  # an odd one (an honest gradient was seen 17x)
    assert what == "suspect" and why.startswith("an act of RMS 2") and "above its own recent ones" in why
    assert g.judge("act", "b", attacks.forge_boundary("scaleact", _act(99, 2.2)), step=5, mb=1)[0] == "refuse"
    assert g.judge("act", "b", attacks.forge_boundary("zeroact", _act(100)), step=5, mb=2) == ("refuse", "an all-zero act")
    assert g.refused == {"b": 2} and g.suspected == {"b": 1}
    assert g.judge("act", "b", _act(101, 2.2)) is None  # refused tensors are not remembered


def test_a_checker_asks_whether_an_input_lies_past_the_limit_without_the_gate_remembering_it():
    """A replica checking another's micro-batch recomputes it from the input it fetched; where that
    input lies past the refusal limit the receiver refused it or took it scaled (pardoned), so the
    check is skipped: ``beyond`` answers that and changes nothing."""
    g = Gate()
    for i in range(20):
        assert g.judge("act", "b", _act(i)) is None
    before = (dict(g.refused), g.accepted, list(g.hist[("act", "b")]))
    assert g.beyond("act", "b", attacks.forge_boundary("scaleact", _act(50)))
    assert not g.beyond("act", "b", _act(51)) and not g.beyond("act", "b", _act(52, 3.0))  # odd, not past the limit
    assert g.beyond("act", "b", torch.zeros(4, 16, 32))
    assert (dict(g.refused), g.accepted, list(g.hist[("act", "b")])) == before
    assert not Gate().beyond("act", "b", _act(53, 1000.0))  # no reference yet: nothing to hold it against


def test_a_refused_tensor_is_taken_when_its_step_is_redone_with_another_sender():
    """The step redone after the planner evicted its first sender: the same data, the same odd
    tensor, another peer: it was the data, not the sender (the run must not stall)."""
    g = Gate()
    for i in range(8):
        g.judge("grad", "b", _act(i))
        g.judge("grad", "c", _act(20 + i))
    assert g.judge("grad", "b", _act(9, 100.0), step=45, mb=0)[0] == "refuse"
    assert g.judge("grad", "b", _act(9, 100.0), step=45, mb=0)[0] == "refuse"  # the same sender again
    assert g.judge("grad", "c", _act(9, 100.0), step=45, mb=0) is None


def test_a_tensor_refused_twice_from_a_sender_the_swarm_keeps_is_taken_at_the_limit():
    """A loss spike (seen live: a gradient 57x its sender's recent ones at one step, every redo the
    same): the planner keeps the sender (one receiver of two accuses it), so refusing it for ever
    would hold the run at that step. The third time it is taken, scaled down to the refuse limit (and the step's other odd micro-batches);
    the stream goes on at its old level; its odd ones of the next PARDON_STEPS steps are taken so at
    once; a too-small one is taken as it is."""
    import math

    from spantrain_p2p.robust.gate import PARDON_AFTER, PARDON_STEPS, REFUSE

    g = Gate()
    for i in range(8):
        assert g.judge("grad", "b", _act(i)) is None
    spike = _act(9, 57.0)
    for _ in range(PARDON_AFTER):  # the step, redone by the same sender after each re-plan
        assert g.judge("grad", "b", spike, step=34, mb=0)[0] == "refuse"
    what, why = g.judge("grad", "b", spike, step=34, mb=0)
    assert what == "pardon" and "refused 2 times" in why
    scale = g.pardoned[("grad", 34, 0)]
    own = statistics.median(math.log(float(_act(i).pow(2).mean().sqrt())) for i in range(8))
    taken = math.log(float((spike * scale).pow(2).mean().sqrt()))
    assert abs(taken - own - math.log(REFUSE)) < 1e-4  # at the limit, not above it
    assert g.suspected == {"b": 1} and 34 in g.odd
    # the step's other micro-batches, as odd: taken at once (one re-plan per refusal, not per micro-batch)
    assert g.judge("grad", "b", _act(13, 90.0), step=34, mb=1)[0] == "pardon"
    assert g.judge("grad", "b", _act(10), step=35, mb=0) is None  # back at its level: passes
    # odd again soon after: the swarm kept it through the re-plans once, taken at once (no two more a step)
    what, why = g.judge("grad", "b", _act(11, 57.0), step=35, mb=1)
    assert what == "pardon" and "pardoned at step 34" in why and g.pardoned[("grad", 35, 1)] < 1.0
    later = 34 + PARDON_STEPS + 1  # past the window, a step counts on its own again
    assert g.judge("grad", "b", _act(11, 57.0), step=later, mb=1)[0] == "refuse"
    tiny = _act(12, 1 / 57)
    assert [g.judge("grad", "b", tiny, step=later + 1, mb=0)[0] for _ in range(3)] == ["refuse", "refuse", "pardon"]
    assert g.pardoned[("grad", later + 1, 0)] == 1.0  # never scaled up


def test_a_sender_pardoned_step_after_step_does_not_set_the_level_and_an_evicted_one_is_forgotten():
    """An attacker kept through the re-plans once is taken (at the limit) at every later step, but
    its odd level does not become its own reference nor, once evicted, the others': before, an
    evicted attacker's pardoned gradients (50x) stood as "the others' level" at its boundary, and
    the honest senders there were refused (184x below) and evicted next (CI-like run, 2026-11-28)."""
    from spantrain_p2p.robust.gate import PARDON_AFTER

    g = Gate()
    for i in range(8):
        for src in ("a", "b", "c"):
            assert g.judge("grad", src, _act(10 * i + ord(src))) is None
        assert g.judge("grad", "x", _act(100 + i)) is None
    odd = [g.judge("grad", "x", _act(200, 50.0), step=1, mb=0)[0] for _ in range(PARDON_AFTER + 1)]
    assert odd == ["refuse"] * PARDON_AFTER + ["pardon"]
    for step in range(2, 12):  # odd at every step: pardoned at once, its level not taken
        assert g.judge("grad", "x", _act(200 + step, 50.0), step=step, mb=0)[0] == "pardon"
    assert statistics.median(g.hist[("grad", "x")]) < 1.0  # still its honest level, not 50x
    g.forget(["x"])
    assert ("grad", "x") not in g.hist and all("x" not in by for by in g.shared_by.values())
    for src in ("a", "b", "c"):  # the honest ones pass as before
        assert g.judge("grad", src, _act(999 + ord(src)), step=20, mb=1) is None


def test_a_sender_refused_or_pardoned_lately_is_no_reference_for_the_others_nor_in_what_is_shared():
    """For ``PARDON_STEPS`` steps after one of its tensors is refused or pardoned, a sender is neither
    one of "the others" its fellow senders are judged against nor in the median its receiver shares
    with its replicas. In a suite run (tests/test_robust.py, 2026-12-01) an attacker scaling its
    gradients 100x stood as the others' level at receivers fed by few senders; the honest replicas'
    gradients were refused 183x below it and two honest peers were evicted."""
    from spantrain_p2p.robust.gate import PARDON_AFTER, PARDON_STEPS

    # (``shared()``: [median, count] of activations, then of gradients: [2] is the gradients' median)

    # an attacker at 50x from its first tensor, taken while nothing could judge it, then refused
    g = Gate()
    for i in range(8):
        assert g.judge("grad", "x", _act(100 + i, 50.0), step=0, mb=i) is None  # no reference yet
        assert g.judge("grad", "a", _act(10 * i), step=0, mb=i) is None
    honest = math.log(float(_act(0).pow(2).mean().sqrt()))
    fellow = Gate()
    for i in range(6):
        fellow.judge("grad", "s", _act(50 + i))
    g.take_shared({r: fellow.shared() for r in ("r1", "r2", "r3")})
    assert g.judge("grad", "x", _act(120, 50.0), step=1, mb=0)[0] == "refuse"  # against the replicas' level
    assert g.shared()[2] == pytest.approx(honest, abs=0.5)  # a's median alone, not half-way to x's
    _own, others = g.references("grad", "a")
    assert others == pytest.approx(honest, abs=0.5)  # the replicas', x left out
    assert g.judge("grad", "a", _act(300), step=1, mb=1) is None
    g.step = 1 + PARDON_STEPS + 1  # long past: x's median counts again in what this receiver shares
    assert g.shared()[2] > honest + 1.0

    # pardoned (its third refusal at one step): remembered as it came, but no reference either
    g = Gate()
    for i in range(8):
        assert g.judge("grad", "a", _act(10 * i)) is None
        assert g.judge("grad", "x", _act(100 + i)) is None
    for _ in range(PARDON_AFTER + 1):
        what = g.judge("grad", "x", _act(200, 50.0), step=1, mb=0)
    assert what[0] == "pardon"
    for _ in range(3):  # x's level now 50x in its own window too (a level that stays)
        g.judge("grad", "x", _act(201, 50.0), step=1, mb=1)
    assert g.shared()[2] == pytest.approx(honest, abs=0.5)


def test_an_attacker_scaling_from_its_first_tensor_is_refused_against_the_others_at_the_boundary():
    g = Gate()
    for i in range(8):  # it alone feeds this receiver: its own past is the attack
        assert g.judge("act", "b", _act(i, 100.0)) is None
    # the receiver's replicas share their medians (three honest ones): from then on, it is refused
    shared = {r: Gate() for r in ("r1", "r2", "r3")}
    for r, other in shared.items():
        for i in range(6):
            other.judge("act", f"s-{r}", _act(50 + i))
    g.take_shared({r: other.shared() for r, other in shared.items()})
    what, why = g.judge("act", "b", _act(9, 100.0))
    assert what == "refuse" and "above the others' at this boundary" in why


def test_one_lying_replica_does_not_move_the_shared_reference():
    honest = Gate()
    for i in range(6):
        honest.judge("act", "s", _act(i))
    g = Gate()
    for i in range(6):
        g.judge("act", "me", _act(10 + i))
    liar = [50.0, 1.0, 0.0, 0.0, 0.0]  # log RMS e^50
    g.take_shared({"r1": honest.shared(), "r2": honest.shared(), "r3": liar, "r4": [float("nan")] * 5})
    assert g.judge("act", "me", _act(20)) is None and g.judge("act", "new", _act(21)) is None


def test_fp16_overflow_zeros_pass_where_allowed():
    assert Gate(zeros_ok=True).judge("grad", "b", torch.zeros(8)) is None
    assert Gate().judge("grad", "b", torch.zeros(8)) == ("refuse", "an all-zero grad")


def test_noise_of_the_same_norm_passes_the_gate():
    """What norms cannot see (spot recomputation's job): the forgery keeps the norm within sqrt 2."""
    g = Gate()
    for i in range(8):
        g.judge("act", "b", _act(i))
    assert g.judge("act", "b", attacks.forge_boundary("noiseact", _act(9), torch.Generator().manual_seed(0))) is None


def test_receivers_follow_the_micro_batches_through_the_stages():
    # 2 stages x 2 replicas, 4 micro-batches: a0 a0 a1 a1 | b0 b1 b0 b1
    rx = receivers([["a0", "a0", "a1", "a1"], ["b0", "b1", "b0", "b1"]])
    assert rx == {"a0": {"b0", "b1"}, "a1": {"b0", "b1"}, "b0": {"a0", "a1"}, "b1": {"a0", "a1"}}
    assert receivers([["a", "a"], ["b", "b"], ["c", "c"]])["b"] == {"a", "c"}


def test_the_gate_evicts_by_most_receivers_and_a_lone_accuser_evicts_once():
    rx = {"x": {"r1", "r2", "r3"}, "y": {"r1"}, "z": {"r1"}}
    acc = {"r1": A("job", [], ["x", "y", "z"]), "r2": A("job", [], ["x"])}
    got = gate_evictions(acc, rx, "job")
    assert got == {"x": ["r1", "r2"], "y": ["r1"]}  # r1 alone: one eviction, not two
    assert gate_evictions(acc, rx, "job", spent={"r1"}) == {"x": ["r1", "r2"]}
    assert gate_evictions({"r1": A("job", [], ["x"])}, rx, "job") == {}  # 1 of 3
    assert gate_evictions({"r1": A("other", [], ["y"])}, rx, "job") == {}


async def test_the_planner_reads_no_accusations_in_a_job_without_the_robust_defences(monkeypatch):
    """Only the robust defences accuse (a replica's verdicts, the gate, verification): in a job that
    sums plainly the planner does not read the key every second; in a robust one it does, and evicts."""
    import types

    import spantrain_p2p.train.coordinator as coordinator
    from spantrain_p2p.plan.stagemap import StageMap
    from spantrain_p2p.plan.types import Stage

    reads = []

    async def read(peer, log_bad):
        reads.append(1)
        return {"a": A("job", ["b"], []), "c": A("job", ["b"], [])}

    monkeypatch.setattr(coordinator, "read_accusations", read)
    c = coordinator.Coordinator.__new__(coordinator.Coordinator)
    c.peer = types.SimpleNamespace(evicted=set())
    c._accusations_read, c._lone_seen, c._lone_accusers, c.log_bad = 0.0, {}, set(), None
    smap = StageMap(1, "job", (Stage(("a", "b", "c"), (0, 2)),))
    c.job = types.SimpleNamespace(aggregate="sum", num_micro_batches=3)
    assert await c._evictions(smap) == "" and await c._evictions(smap, force=True) == "" and reads == []
    c.job = types.SimpleNamespace(aggregate="robust", num_micro_batches=3)
    assert "accused by 2 peers" in await c._evictions(smap) and reads == [1] and c.peer.evicted == {"b"}
