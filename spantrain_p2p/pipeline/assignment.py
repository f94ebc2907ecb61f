"""Per-peer action lists when a stage holds several data-parallel peers.

Each peer of stage k runs the stage's whole action list filtered to the micro-batches it owns;
sends and receives go to whichever peer of the neighbouring stage holds that micro-batch. The
stage lists use warm-ups scaled to the number of replicas and never growing downstream
(``plan.layout.stage_warmups``): a sub-sequence of a deadlock-free stage list, run by more
devices, cannot deadlock. ``check_deadlock_free`` proves it for given lists by executing them
abstractly: every peer runs its list in order, receives block until the matching send happened.
"""
from __future__ import annotations

from . import schedule as sched


def peer_actions(assignments: list[list[str]], schedule_name: str) -> dict[tuple[int, str], list[sched.Action]]:
    """{(stage, peer): actions with global micro-batch numbers}; assignments[k][mb] = peer of mb at stage k."""
    from ..plan.layout import stage_actions, stage_warmups

    n = len(assignments)
    m = len(assignments[0]) if assignments else 0
    shares = [[assign.count(p) / m for p in dict.fromkeys(assign)] for assign in assignments]
    warmups = stage_warmups(schedule_name, shares, m)
    out: dict[tuple[int, str], list[sched.Action]] = {}
    for k, assign in enumerate(assignments):
        for peer in dict.fromkeys(assign):
            out[(k, peer)] = []
        for a in stage_actions(schedule_name, n, k, m, warmups[k]):
            out[(k, assign[a.mb])].append(a)
    return out


def check_deadlock_free(assignments: list[list[str]], actions: dict[tuple[int, str], list[sched.Action]]) -> None:
    """ValueError naming where the peers would wait for each other forever."""
    sent: set[tuple[str, int, int]] = set()  # (kind, destination stage, mb)
    pos = {key: 0 for key in actions}
    progress = True
    while progress:
        progress = False
        for (k, peer), acts in actions.items():
            while pos[(k, peer)] < len(acts):
                a = acts[pos[(k, peer)]]
                if a.op is sched.Op.RECV_F and ("F", k, a.mb) not in sent:
                    break
                if a.op is sched.Op.RECV_B and ("B", k, a.mb) not in sent:
                    break
                if a.op is sched.Op.SEND_F:
                    sent.add(("F", k + 1, a.mb))
                elif a.op is sched.Op.SEND_B:
                    sent.add(("B", k - 1, a.mb))
                pos[(k, peer)] += 1
                progress = True
    stuck = [f"stage {k} peer {peer[:12]} at {actions[(k, peer)][i]}" for (k, peer), i in pos.items()
             if i < len(actions[(k, peer)])]
    if stuck:
        raise ValueError("deadlock: " + "; ".join(stuck[:4]))
