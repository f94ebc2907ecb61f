"""The replicas' gradient sum (``train.gradsum``): what it sends, to whom, and under which map."""
import asyncio
from types import SimpleNamespace

import torch

from spantrain_p2p.pipeline.messages import GSUM
from spantrain_p2p.train.gradsum import GradientSum, layer_buckets


class _Transport:
    """Records sends; ``smap`` is the map in force (the trainer's transport changes it at a re-plan)."""

    def __init__(self, epoch: int):
        self.smap = SimpleNamespace(epoch=epoch)
        self.sent: list[tuple] = []

    async def send_to(self, dst, kind, step, mb, t, epoch=None):
        self.sent.append((dst, kind, step, mb, self.smap.epoch if epoch is None else epoch))

    async def receive(self, key, kind, src):  # nothing comes in (the sum is cancelled)
        await asyncio.Event().wait()


def _params():
    ps = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    for p in ps:
        p.grad = torch.full_like(p, 2.0)
    return ps


async def test_a_part_the_compute_thread_finishes_after_a_re_plan_is_not_sent_as_the_new_maps():
    """A step abandoned for a new map: its compute thread may still say a layer is done (the call
    reaches the loop later). A part sent then would carry the new map's epoch and be summed into the
    new map's step, with other micro-batches in it (a 2.6 % loss deviation in a churn test, seen
    once): after ``cancel`` nothing is sent, and a part always says the epoch it was computed in."""
    transport, params = _Transport(epoch=1), _params()
    buckets = layer_buckets([[3], [2]])
    gsum = GradientSum(transport, "me", 7, params, buckets, ["other"])
    gsum.layer_done(1)
    await asyncio.sleep(0.01)
    transport.smap = SimpleNamespace(epoch=2)  # the re-plan: the transport takes the new map
    gsum.layer_done(0)  # started under epoch 1, sent after the switch: still epoch 1's
    await asyncio.sleep(0.01)
    assert sorted(transport.sent) == [("other", GSUM, 7, 0, 1), ("other", GSUM, 7, 1, 1)]
    await gsum.cancel()
    transport.sent.clear()
    late = GradientSum(transport, "me", 8, params, buckets, ["other"])
    await late.cancel()
    late.layer_done(0)  # the thread's call after the step was abandoned
    late.layer_done(1)
    await asyncio.sleep(0.01)
    assert transport.sent == []


async def test_a_host_memory_part_starts_its_send_before_what_the_loop_had_queued_after_its_layer():
    """The compute thread tells the loop a layer is done, then that its op is over (the step's
    continuation, which runs up to the sum's first wait): a part already in host memory begins its
    send before that continuation, not behind it (as the turn of a task started by another task, the
    step's last bucket left a median 1 ms later on cee-3region); its local part is there at once."""
    order: list[str] = []

    class Recording(_Transport):
        async def send_to(self, dst, kind, step, mb, t, epoch=None):
            order.append(f"send {mb}")
            await super().send_to(dst, kind, step, mb, t, epoch)

    gsum = GradientSum(Recording(epoch=1), "me", 3, _params(), layer_buckets([[3], [2]]), ["other"])
    loop = asyncio.get_running_loop()
    op = loop.create_future()  # the compute op, as ``run_in_executor`` hands its end to the loop

    async def step():  # the step awaiting its op, then going on
        await op
        order.append("continuation")
    waiting = asyncio.create_task(step())
    await asyncio.sleep(0)
    loop.call_soon(gsum.layer_done, 0)  # as the compute thread's ``call_soon_threadsafe`` calls, in order
    loop.call_soon(op.set_result, None)
    await waiting
    await asyncio.sleep(0.01)
    assert order == ["send 0", "continuation"]
    assert gsum.local[0].done() and torch.equal(gsum.local[0].result(), torch.full((3,), 2.0))
    await gsum.cancel()


def test_a_sharded_stages_buckets_hold_one_owners_parameters_each():
    """Owners by parameter (``train.shard``): a layer's parameters split into one bucket per owner."""
    assert layer_buckets([[3, 2, 4], [5]], owners=["a", "b", "a", "b"]) == \
        [(0, [(0, 3), (2, 4)]), (0, [(1, 2)]), (1, [(3, 5)])]
    assert layer_buckets([[3, 2, 4], [5]]) == [(0, [(0, 3), (1, 2), (2, 4)]), (1, [(3, 5)])]


class _Inbox(_Transport):
    """The other replicas' parts, each bucket's from ``parts[k][src]``, as they would come in."""

    def __init__(self, parts: list[dict[str, torch.Tensor]]):
        super().__init__(epoch=1)
        self.parts = parts

    async def receive(self, key, kind, src):
        await asyncio.sleep(0)
        return self.parts[key[2]][src]


async def test_too_few_replicas_to_judge_are_summed_bucket_by_bucket_as_the_whole_gradient_would_be():
    """With fewer than robust.aggregate.MIN_PEERS replicas the robust sum is the plain one: taken
    bucket by bucket as the parts come in (no copy of the whole gradient), it equals robust_sum over
    the whole gradient bit for bit, and reports the same: nothing judged, a part of weight 0 that is
    not zeros idle."""
    from spantrain_p2p.robust.aggregate import robust_sum

    g = torch.Generator().manual_seed(0)
    sizes = [5, 7, 3]
    # (a replica with no weight at all sent a part: counted idle; one of weight 0 is left out before)
    for weights, peers, idle in (({"a": 3.0, "b": 1.0, "z": 0.0}, "abz", False), ({"a": 2.0, "b": 2.0}, "abc", True)):
        buckets = [{p: torch.randn(n, generator=g) * 1e3 for p in peers} for n in sizes]
        buckets[1]["b"][:] = 0.0
        params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
        for p, b in zip(params, buckets):
            p.grad = b["a"].clone()
        gsum = GradientSum(_Inbox(buckets), "a", 3, params, layer_buckets([[n] for n in sizes]),
                           [p for p in peers if p != "a"], weights=weights)
        for layer in reversed(range(len(sizes))):
            gsum.layer_done(layer)
        await gsum.finish()
        whole = {p: torch.cat([b[p] for b in buckets]) for p in peers if weights.get(p, 1) > 0}
        want, report = robust_sum(whole, weights)
        assert torch.equal(torch.cat([p.grad for p in params]), want)
        assert gsum.reports == [report]
        assert (report.clipped == ("c",)) == idle


async def test_each_bucket_is_summed_as_its_parts_come_in_not_all_after_the_backward():
    """The step's last bucket (the first layer's, done last) is all that is left when the backward
    ends: the other buckets were summed while it went on. All after it, the sums held the loop
    3.2-3.4 ms on each cee-3region replica, the later replica's last send queued behind them. The
    sum is the same: every replica's part added up in peer-id order."""
    sizes = [4, 6]
    mine = [torch.arange(n, dtype=torch.float32) for n in sizes]
    theirs = [{"b": torch.full((n,), 0.5)} for n in sizes]
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    for p, t in zip(params, mine):
        p.grad = t.clone()
    gsum = GradientSum(_Inbox(theirs), "a", 3, params, layer_buckets([[n] for n in sizes]), ["b"])
    gsum.layer_done(1)  # the backward runs from the last layer down
    await asyncio.sleep(0.01)
    assert gsum.work[1].done(), "the last layer's bucket is summed while the backward goes on"
    gsum.layer_done(0)
    await gsum.finish()
    for p, t, o in zip(params, mine, theirs):
        assert torch.equal(p.grad, t + o["b"])


async def test_the_last_stages_loss_goes_to_the_other_replicas_with_its_last_forward_not_after_the_backward():
    """``losses_done`` sends this replica's loss (sum, count) as soon as its last forward ends;
    ``finish``, given the same, sends nothing more and returns the whole step's loss."""
    params = _params()
    theirs = [{"b": torch.ones(3)}, {"b": torch.ones(2)}, {"b": torch.tensor([5.0, 2.0])}]
    transport = _Inbox(theirs)
    gsum = GradientSum(transport, "a", 3, params, layer_buckets([[3], [2]]), ["b"])
    gsum.losses_done([1.5, 2.5])
    await asyncio.sleep(0.01)
    assert transport.sent == [("b", GSUM, 3, 2, 1)]  # the loss's part, before any layer's
    gsum.layer_done(1)
    gsum.layer_done(0)
    assert await gsum.finish((4.0, 2)) == (9.0, 4)
    assert sorted(mb for _, _, _, mb, _ in transport.sent) == [0, 1, 2]
