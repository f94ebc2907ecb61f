import pytest

from spantrain_p2p.launch.chaos import Chaos, parse

PEERS, REGIONS = ["cloud-1", "edge-1"], ["cloud", "edge", "end"]


@pytest.mark.parametrize("spec,want", [
    ("kill:edge-1@step=20", Chaos("kill", "edge-1", at_step=20)),
    ("kill:planner@step=5", Chaos("kill", "planner", at_step=5)),
    ("join:cloud-1@step=3", Chaos("join", "cloud-1", at_step=3)),
    ("degrade:cloud-edge:0.1@t=20", Chaos("degrade", "cloud-edge", at_t=20.0, factor=0.1)),
    ("restore:cloud-edge@t=40.5", Chaos("restore", "cloud-edge", at_t=40.5)),
    ("degrade:cloud-edge:0@step=8", Chaos("degrade", "cloud-edge", at_step=8, factor=0.0)),
    ("restore:cloud-edge@after=12", Chaos("restore", "cloud-edge", after_s=12.0)),
])
def test_chaos_specs_parse(spec, want):
    assert parse(spec, PEERS, REGIONS) == want


@pytest.mark.parametrize("spec,reason", [
    ("kill:nobody@step=2", "no peer 'nobody'"),
    ("kill:edge-1@t=2", "at a step"),
    ("kill:edge-1@after=2", "at a step"),
    ("degrade:cloud-mars:0.5@step=1", "REGION-REGION"),
    ("degrade:cloud-edge@step=1", "needs a factor"),
    ("explode:edge-1@step=1", "want kill"),
    ("join:planner@step=1", "no peer 'planner'"),
])
def test_bad_chaos_specs_say_what_is_wrong(spec, reason):
    with pytest.raises(ValueError, match=reason):
        parse(spec, PEERS, REGIONS)


def test_the_launcher_sends_link_changes_as_the_kind_the_peer_handles():
    from spantrain_p2p.launch.chaos import CHAOS_KIND as sent
    from spantrain_p2p.peer.emulation import CHAOS_KIND as handled

    assert sent == handled


def test_an_after_event_needs_an_event_before_it():
    from spantrain_p2p.launch.chaos import check_order

    check_order([parse("degrade:cloud-edge:0@step=3", PEERS, REGIONS), parse("restore:cloud-edge@after=5", PEERS, REGIONS)])
    with pytest.raises(ValueError, match="listed before it"):
        check_order([parse("restore:cloud-edge@after=5", PEERS, REGIONS)])


def test_link_changes_fire_at_their_step_at_training_s_start_and_after_the_event_before(monkeypatch):
    """The follower fires a cut at its step, not while the swarm is still forming, and its restore a
    set time after the cut, however long the start took."""
    import spantrain_p2p.launch.follow as follow

    clock = [1000.0]
    monkeypatch.setattr(follow.time, "monotonic", lambda: clock[0])
    sent = []
    monkeypatch.setattr(follow, "set_link_factor", lambda urls, regions, factor, operator="": sent.append(factor) or [None])

    class Proc:
        name, info, proc = "a1", {"data_url": "http://x"}, object()

    chaos = [parse("degrade:cloud-edge:0@step=3", PEERS, REGIONS), parse("restore:cloud-edge@after=5", PEERS, REGIONS),
             parse("degrade:cloud-edge:0.5@t=2", PEERS, REGIONS)]
    f = follow.RunFollower([Proc()], None, lambda *a: None, chaos)

    def tick(seconds: float, steps_done, plan: bool = True):
        clock[0] += seconds
        if plan:
            f.plans.setdefault(1, {"epoch": 1})
        train = {"stage": 0, "steps_done": steps_done, "step": steps_done} if steps_done is not None else {}
        f.fire_chaos([(Proc(), {"train": train})])

    tick(60, None, plan=False)  # a minute of forming: nothing fires
    tick(5, 0)  # a stage map, no step done yet: training has not started
    assert sent == []
    tick(1, 1)  # the first step: t counts from here
    tick(1.5, 2)
    assert sent == []
    tick(1, 3)  # step 3 (cut) and t=2.5 (the @t=2 change) both due
    assert sent == [0.0, 0.5]
    tick(4.9, 9)
    assert sent == [0.0, 0.5]
    tick(0.2, 10)  # 5.1 s after the cut: restored
    assert sent == [0.0, 0.5, 1.0] and not f.chaos
