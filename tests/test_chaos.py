import pytest

from spantrain_p2p.launch.chaos import Chaos, parse

PEERS, REGIONS = ["cloud-1", "edge-1"], ["cloud", "edge", "end"]


@pytest.mark.parametrize("spec,want", [
    ("kill:edge-1@step=20", Chaos("kill", "edge-1", at_step=20)),
    ("kill:planner@step=5", Chaos("kill", "planner", at_step=5)),
    ("join:cloud-1@step=3", Chaos("join", "cloud-1", at_step=3)),
    ("degrade:cloud-edge:0.1@t=20", Chaos("degrade", "cloud-edge", at_t=20.0, factor=0.1)),
    ("restore:cloud-edge@t=40.5", Chaos("restore", "cloud-edge", at_t=40.5)),
])
def test_chaos_specs_parse(spec, want):
    assert parse(spec, PEERS, REGIONS) == want


@pytest.mark.parametrize("spec,reason", [
    ("kill:nobody@step=2", "no peer 'nobody'"),
    ("kill:edge-1@t=2", "at a step"),
    ("degrade:cloud-mars:0.5@t=1", "REGION-REGION"),
    ("degrade:cloud-edge@t=1", "needs a factor"),
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
