"""A live swarm agrees on its region groups and its planner; a killed planner is replaced."""
import os
import signal
import time

import pytest

from spantrain_p2p.launch import wait_until

SCENARIO = "peers/trace-drop.toml"  # 2 regions of 2 peers


@pytest.mark.heavy
def test_peers_agree_on_groups_and_planner_and_replace_a_killed_planner(peers):
    swarm = f"agree-{os.getpid()}"
    common = ["--swarm", swarm, "--emulate-t0", str(time.monotonic() + 1e6)]  # no trace drop during the test
    names = ["west-1", "west-2", "east-1", "east-2"]
    first = peers(names[0], "--emulate", f"{SCENARIO}:{names[0]}", *common, "--steps", "1000000", "--peers", "4")
    first.wait_ready(60)
    everyone = [first] + [peers(n, "--emulate", f"{SCENARIO}:{n}", *common, "--join", first.info["address"])
                          for n in names[1:]]
    for p in everyone:
        p.wait_ready(60)

    def agreed(procs, same_digest=True):
        trains = [p.status()["train"] for p in procs]
        digests = {t["groups_digest"] for t in trains}
        planners = {(t["planner"], t["term"]) for t in trains}
        epochs = {t["plan"]["epoch"] if t["plan"] else None for t in trains}
        ok = len(planners) == 1 and None not in next(iter(planners))
        if same_digest:
            ok = ok and len(digests) == 1 and None not in digests
        return (trains[0], planners.pop(), epochs) if ok else None

    regions = [["east-1", "east-2"], ["west-1", "west-2"]]

    seen = {}

    def agreed_on_regions():
        # the peers may first agree on a snapshot where a link is not probed yet (a loaded machine):
        # it splits a region; they agree again once every link is in
        for p in everyone:
            t = p.status()["train"]
            seen[p.name] = {k: t.get(k) for k in ("groups", "groups_digest", "planner", "term")}
        r = agreed(everyone)
        return r if r is not None and sorted(map(sorted, r[0]["groups"])) == regions else None

    try:
        first_view, (planner, term), epochs = wait_until(agreed_on_regions, 90, what="agreed regions")
    except TimeoutError:
        print("each peer's last view:", seen)
        raise
    assert sorted(map(sorted, first_view["groups"])) == regions
    in_map = lambda p: (p.status()["train"]["stage"] is not None)
    wait_until(lambda: any(in_map(p) for p in everyone) and
               all(p.status()["state"] == "training" for p in everyone if in_map(p)), 60)

    victim = next(p for p in everyone if p.name == planner)
    t0 = time.monotonic()
    victim.proc.send_signal(signal.SIGKILL)
    rest = [p for p in everyone if p is not victim]

    def successor():
        got = agreed(rest, same_digest=False)  # the digest changes as the dead peer's records expire
        if got is None:
            return None
        view, (new_planner, new_term), new_epochs = got
        if new_planner != planner and new_term > term and all(e is not None and e >= 2 for e in new_epochs):
            return new_planner, new_term
        return None

    new_planner, new_term = wait_until(successor, 30)
    took = time.monotonic() - t0
    assert took <= 15, f"new planner and epoch after {took:.1f}s"
    print(f"\nplanner {planner} (term {term}) killed: {new_planner} took term {new_term} and a new "
          f"stage-map epoch was adopted after {took:.1f}s")
