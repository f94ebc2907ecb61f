import itertools

import pytest

from spantrain_p2p.pipeline.assignment import check_deadlock_free, peer_actions
from spantrain_p2p.pipeline.assignment import assign_microbatches


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_replicated_stages_never_deadlock_whatever_the_shares(schedule):
    shapes = [[1, 2], [2, 1, 3], [3, 3], [1, 1, 1, 1], [2, 2, 2], [1, 3, 1], [3, 1, 2, 1]]
    for widths, M in itertools.product(shapes, [1, 3, 4, 8, 13]):
        for shares in ([1.0], [3.0, 1.0], [1.0, 2.0, 5.0]):
            assigns = []
            for k, w in enumerate(widths):
                peers = [f"s{k}p{i}" for i in range(w)]
                sh = (shares * w)[:w]
                assigns.append(assign_microbatches(peers, sh, M))
            acts = peer_actions(assigns, schedule)
            check_deadlock_free(assigns, acts)
            for k, assign in enumerate(assigns):  # every micro-batch runs exactly once per stage
                fs = sorted(a.mb for (kk, _), al in acts.items() if kk == k for a in al if a.op.name == "F")
                assert fs == list(range(M))


def test_a_broken_plan_is_reported_as_a_deadlock():
    from spantrain_p2p.pipeline import schedule as sched

    assigns = [["a", "a"], ["b", "b"]]
    acts = peer_actions(assigns, "1f1b")
    acts[(0, "a")] = [x for x in acts[(0, "a")] if not (x.op is sched.Op.SEND_F and x.mb == 1)]
    with pytest.raises(ValueError, match="deadlock"):
        check_deadlock_free(assigns, acts)
