"""--device: where a peer's layers live. Without CUDA only the CPU can be named (a CUDA device
fails at once, saying what there is); with CUDA a stage on the GPU computes what it computes on
the CPU, and everything it sends or saves is in host memory."""
import subprocess
import sys

import pytest
import torch

from spantrain_p2p.models import state as layer_state
from spantrain_p2p.models.devices import resolve_device

CUDA = torch.cuda.is_available()


def test_device_names_resolve_or_fail_saying_what_this_machine_has():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == (torch.device("cuda", 0) if CUDA else torch.device("cpu"))
    with pytest.raises(ValueError, match="want auto, cpu, cuda or cuda:N"):
        resolve_device("gpu0")
    with pytest.raises(ValueError, match="no CUDA device" if not CUDA else "CUDA device"):
        resolve_device("cuda:99")


@pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without CUDA")
def test_a_peer_told_to_use_a_gpu_it_does_not_have_stops_at_once():
    r = subprocess.run([sys.executable, "-m", "spantrain_p2p", "peer", "--device", "cuda", "--steps", "5"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "no CUDA device that torch can use" in r.stderr, r.stderr[-800:]


def test_a_layer_state_keeps_adam_s_step_count_on_the_host_and_the_moments_with_the_parameter():
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(layer.parameters())
    layer(torch.randn(4, 3)).sum().backward()
    opt.step()
    state = layer_state.capture(layer, opt)
    assert all(t.device.type == "cpu" for _, t in state)
    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.Adam(fresh.parameters())
    layer_state.apply(fresh, fresh_opt, state)
    st = fresh_opt.state[fresh.weight]
    assert st["step"].device.type == "cpu" and st["exp_avg"].device == fresh.weight.device
    assert torch.equal(st["exp_avg"], opt.state[layer.weight]["exp_avg"])


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_a_stage_on_the_gpu_computes_what_it_computes_on_the_cpu_and_sends_host_tensors():
    """The first stage of two (F, SEND_F, RECV_B, BW): the same loss-free arithmetic on the GPU as
    on the CPU, and the activation it sends arrives in (pinned) host memory, copied on a side stream;
    a spot check's recomputation (on the GPU) compares with it (on the host)."""
    import asyncio

    from spantrain_p2p.pipeline import schedule as sched
    from spantrain_p2p.pipeline.executor import StageExecutor
    from spantrain_p2p.job.spec import JobSpec, ModelHandle
    from spantrain_p2p.robust import verify as vf

    job = JobSpec(seq_len=16)
    handle = ModelHandle(job)
    ids = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    half = handle.num_layers // 2
    grad = torch.randn(handle.boundary_shapes()[half], generator=torch.Generator().manual_seed(1))

    def run(device):
        layers = [layer.to(device) for layer in handle.build(0, half)]
        sent = []

        async def send(*args):
            sent.append(args[-1])

        async def recv(*args):
            return grad

        ex = StageExecutor(layers, True, False, 1, batch=lambda s, m: (ids[:, :-1], ids[:, 1:]), recv=recv, send=send)
        actions = [sched.Action(sched.Op.F, 0), sched.Action(sched.Op.SEND_F, 0), sched.Action(sched.Op.RECV_B, 0),
                   sched.Action(sched.Op.BW, 0)]
        asyncio.run(ex.run_step(0, actions))
        # a replica's spot check recomputes on its device and compares with what arrived (on the host)
        mine = asyncio.run(ex.recompute(0, 0, None, None))
        assert vf.relative_error(sent[0], mine["send/act"]) <= 1e-6
        ex.close()
        return sent, [p.grad.cpu() for p in ex.params]

    cpu_sent, cpu_grads = run("cpu")
    gpu_sent, gpu_grads = run("cuda")
    assert gpu_sent[0].device.type == "cpu" and gpu_sent[0].is_pinned()
    assert float((cpu_sent[0] - gpu_sent[0]).abs().max() / cpu_sent[0].abs().max()) <= 1e-3
    assert max(float((a - b).abs().max() / a.abs().max().clamp_min(1e-12)) for a, b in zip(cpu_grads, gpu_grads)) <= 1e-3


def _adam_stage(layers, x):
    """Adam over ``layers`` and a training step of theirs on ``x``, taken once (the state exists)."""
    opt = torch.optim.Adam([p for layer in layers for p in layer.parameters()], lr=1e-2)

    def train_step():
        h = x
        for layer in layers:
            h = layer(h)
        h.square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    train_step()
    return opt, train_step


def _assert_same_states(states, expected):
    """``states`` ((layer, state) pairs) hold exactly the ``expected`` states, entry by entry."""
    for (idx, got), want in zip(states, expected):
        assert [n for n, _ in got] == [n for n, _ in want]
        for (n, a), (_, b) in zip(got, want):
            assert torch.equal(a, b), (idx, n)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gpu_stage_s_snapshot_copies_while_it_trains_on_and_keeps_the_state_it_was_taken_at(dtype):
    """A CUDA stage's snapshot after a step is copied to pinned host memory on a side stream (the
    trainer goes on at once); the optimizer steps after it wait for those copies on the device
    (``before_update``), so the snapshot holds exactly the state after the step it was taken at. In
    bf16 the optimizer state is converted to fp32 on the device first: the copy waits for that too."""
    import asyncio
    import types

    from spantrain_p2p.plan.stagemap import Stage, StageMap
    from spantrain_p2p.train.recovery import Recovery

    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.GELU()).to("cuda", dtype) for _ in range(4)]
    opt, train_step = _adam_stage(layers, torch.randn(256, 2048, device="cuda", dtype=dtype))
    expected = [layer_state.capture(layer, opt) for layer in layers]  # synchronous copies
    rec = Recovery(types.SimpleNamespace(peer_id="a"), lambda p: 0.0, lambda e: None)
    smap = StageMap(1, "j", (Stage(("a",), (0, 4), (1.0,)),))
    states = rec.snapshot(smap, 0, layers, opt, 0, 1, [])
    assert rec._copied is not None and all(t.is_pinned() for _, st in states for n, t in st
                                           if n[:2] in ("p:", "o:") and not n.endswith(":step"))  # Adam's count: host
    for _ in range(3):  # the weights and moments change on the device while the copies may still run
        rec.before_update()
        train_step()
    asyncio.run(rec.settled())
    _assert_same_states(states, expected)
    assert not torch.equal(states[0][1][0][1], layers[0][0].weight.detach().cpu())  # trained on since


def test_a_cpu_stage_s_snapshot_is_taken_on_its_thread_and_keeps_the_state_it_was_taken_at(monkeypatch):
    """A CPU stage's snapshot after a step is copied on the snapshot thread (the trainer goes on at
    once); the optimizer steps after it wait for that thread (``before_update``), so the snapshot
    holds exactly the state after the step it was taken at, the run's scalars included; what the
    thread raises reaches ``settled``."""
    import asyncio
    import types

    from spantrain_p2p.plan.stagemap import Stage, StageMap
    from spantrain_p2p.train import recovery as rec_mod

    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) for _ in range(4)]
    opt, train_step = _adam_stage(layers, torch.randn(64, 256))
    run = [("s:loss_scale", torch.tensor(8.0))]
    expected = [layer_state.capture(layer, opt, run) for layer in layers]  # on this thread
    rec = rec_mod.Recovery(types.SimpleNamespace(peer_id="a"), lambda p: 0.0, lambda e: None)
    smap = StageMap(1, "j", (Stage(("a",), (0, 4), (1.0,)),))
    states = rec.snapshot(smap, 0, layers, opt, 0, 1, [], run)
    assert isinstance(rec._copied, rec_mod._Behind)
    assert [rec.store.get(i, 1) is st for i, st in states] == [True] * 4  # in the store at once
    for _ in range(3):  # the weights and moments change once the snapshot thread is done
        rec.before_update()
        train_step()
    asyncio.run(rec.settled())
    _assert_same_states(states, expected)
    assert not torch.equal(states[0][1][0][1], layers[0][0].weight.detach())  # trained on since

    def no_room(tensors):
        raise MemoryError("no room for the copies")
    monkeypatch.setattr(layer_state, "clone_all", no_room)
    rec.snapshot(smap, 0, layers, opt, 0, 2, [])
    with pytest.raises(MemoryError, match="no room"):
        asyncio.run(rec.settled())
    with pytest.raises(MemoryError, match="no room"):
        rec.before_update()


def test_settled_wakes_once_when_the_snapshot_thread_is_done_not_polling_it(monkeypatch):
    """``settled`` on a CPU stage's snapshot waits for the snapshot thread's work without a timer
    (polled like a CUDA event, the loop woke every millisecond of the copy)."""
    import asyncio
    import concurrent.futures
    import threading
    import types

    from spantrain_p2p.train import recovery as rec_mod

    rec = rec_mod.Recovery(types.SimpleNamespace(peer_id="a"), lambda p: 0.0, lambda e: None)
    gate = threading.Event()
    pool = concurrent.futures.ThreadPoolExecutor(1)
    rec._copied = rec_mod._Behind(pool.submit(gate.wait, 10))
    timers = []

    async def main():
        loop = asyncio.get_running_loop()
        loop.call_later(0.2, gate.set)
        real = loop.call_later
        monkeypatch.setattr(loop, "call_later", lambda *a, **k: timers.append(a[0]) or real(*a, **k))
        await rec.settled()  # (the thread waits 10 s at most)
    asyncio.run(main())
    pool.shutdown()
    assert gate.is_set() and timers == []


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_a_gpu_peers_step_tail_is_its_optimizer_step_on_the_device_alone():
    """``profile.step_tail`` on a GPU: the optimizer steps copies of the layers' parameters on the
    device, synchronized (the snapshot's copies overlap the next step): a rate, finite, far under the
    host's for the same layers, and the layers themselves stay where and as they were."""
    from spantrain_p2p.profile import step_tail

    torch.manual_seed(0)
    layers = [torch.nn.Linear(1024, 1024) for _ in range(4)]
    before = [p.detach().clone() for layer in layers for p in layer.parameters()]
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True)  # noqa: E731
    gpu = min(step_tail.measure(layers, adam, torch_device=torch.device("cuda")) for _ in range(3))
    cpu = min(step_tail.measure(layers, adam) for _ in range(3))
    assert 0 < gpu <= step_tail.MAX_S_PER_BYTE and 0 < cpu <= step_tail.MAX_S_PER_BYTE
    assert gpu < cpu / 5, (gpu, cpu)  # a GPU's step over 16 MB is tens of us; the host's, ms
    after = [p.detach() for layer in layers for p in layer.parameters()]
    assert all(a.device.type == "cpu" and torch.equal(a, b) for a, b in zip(after, before))
