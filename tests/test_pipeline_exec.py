"""The executor follows GPipe, 1F1B and ZB-H1 schedules in-process and matches single-process training."""
import asyncio
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from spantrain_p2p.osproc import ThreadCoreWait
from spantrain_p2p.pipeline import schedule as sched
from spantrain_p2p.pipeline.executor import StageExecutor, StepFailed
from spantrain_p2p.pipeline.messages import Inbox
from spantrain_p2p.pipeline.assignment import assign_microbatches, peer_actions
from spantrain_p2p.data import generated as data
from spantrain_p2p.job.spec import JobSpec, ModelHandle
from spantrain_p2p.job.reference import reference_run
from spantrain_p2p.job.inprocess import run_pipeline

JOB = JobSpec(model_args={"dim": 32, "depth": 4, "heads": 2}, seq_len=16, micro_batch_size=2, num_micro_batches=4,
              steps=4, lr=1e-3)


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
async def test_every_schedule_gives_the_single_process_gradients_and_losses(schedule):
    from dataclasses import replace

    job = replace(JOB, schedule=schedule)
    ref_losses, ref_grads = reference_run(job, 4, grads_at=0)
    losses, grads = await run_pipeline(job, 3, 4)
    assert grads.keys() == ref_grads.keys()
    worst = max(max_rel_err(grads[k], ref_grads[k]) for k in ref_grads)
    assert worst < 1e-5, f"worst relative gradient error {worst:.2e}"
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= 1e-4 * abs(want)


@pytest.mark.heavy
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
async def test_every_schedule_with_replicated_stages_gives_the_single_process_gradients(schedule):
    from dataclasses import replace

    job = replace(JOB, schedule=schedule, num_micro_batches=6)
    ref_losses, ref_grads = reference_run(job, 50, grads_at=0)
    losses, grads = await run_pipeline(job, 3, 50, widths=[2, 1, 3], shares=[3.0, 1.0, 2.0])
    worst = max(max_rel_err(grads[k], ref_grads[k]) for k in ref_grads)
    assert worst < 1e-5, f"worst relative gradient error {worst:.2e}"
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= 1e-4 * abs(want)


async def test_a_receive_past_its_deadline_fails_the_step_and_leaves_no_gradient():
    handle = ModelHandle(JOB)
    inbox = Inbox(8)

    async def recv(kind, step, mb):
        return await inbox.get((kind, step, mb), 0.3)

    async def send(kind, step, mb, t):
        return None

    ex = StageExecutor(handle.build(0, 3), True, False, 2,
                       lambda s, m: data.batch(0, s, m, 2, JOB.seq_len), recv, send)
    with pytest.raises(StepFailed, match="no grad for step 0 micro-batch 0 within"):
        await ex.run_step(0, sched.schedule("gpipe", 2, 2, 0))
    assert all(p.grad is None for p in ex.params)
    ex.close()


async def test_an_op_whose_tensors_are_here_goes_to_the_compute_thread_before_the_one_ahead_ends():
    """With ``arrived``, the next op is handed to the compute thread with the one ahead of it, so the
    thread goes on to it without waiting for a turn of the event loop; without it, one op at a time.
    Seen with the thread held: what the step queued on it before its first op could run (by count,
    not by time). The same losses and gradients either way."""
    handle = ModelHandle(JOB)
    runs = {}
    for ahead in (False, True):
        torch.manual_seed(0)
        ex = StageExecutor(handle.build(0, handle.num_layers), True, True, 4,
                           lambda s, m: data.batch(0, s, m, JOB.micro_batch_size, JOB.seq_len), None, None,
                           arrived=(lambda kind, step, mb: True) if ahead else None)
        holding, held = threading.Event(), threading.Event()
        ex._pool.submit(lambda: holding.set() or held.wait())
        assert holding.wait(30)  # (the thread runs it: nothing else is queued)
        step = asyncio.create_task(ex.run_step(0, sched.schedule("1f1b", 1, 4, 0)))
        for _ in range(3):  # (the step hands its ops, then waits for the first one's result)
            await asyncio.sleep(0)
        queued = ex._pool._work_queue.qsize()
        held.set()
        r = await step
        runs[ahead] = (queued, r.losses, [p.grad.clone() for p in ex.params])
        ex.close()
    assert runs[False][0] == 1 and runs[True][0] == 2
    assert runs[True][1] == runs[False][1]
    assert all(torch.equal(a, b) for a, b in zip(runs[True][2], runs[False][2]))


async def test_an_op_whose_tensor_comes_while_the_op_ahead_computes_is_handed_before_that_op_ends():
    """A last stage's F of micro-batch 1, whose activation comes while the backward of micro-batch 0
    computes: it is queued on the compute thread before that backward ends (the thread goes on to it,
    not idle until the event loop has had its turn), seen from inside the backward, which files the
    activation and then waits for the queue; without ``arrived``, it is handed after. The same losses
    and gradients either way."""
    handle = ModelHandle(JOB)
    dim = JOB.model_args["dim"]
    acts = [torch.randn(JOB.micro_batch_size, JOB.seq_len, dim, generator=torch.Generator().manual_seed(m))
            for m in range(2)]
    actions = sched.schedule("1f1b", 2, 2, 1)
    assert [a.op.name for a in actions if a.op.name in ("RECV_F", "F", "BW")] == \
        ["RECV_F", "F", "BW", "RECV_F", "F", "BW"]
    runs = {}
    for early in (False, True):
        torch.manual_seed(0)
        inbox = Inbox(8)

        async def recv(kind, step, mb):
            return await inbox.get((kind, step, mb), 30)

        async def send(kind, step, mb, t):
            return None

        ex = StageExecutor(handle.build(2, handle.num_layers), False, True, 2,
                           lambda s, m: data.batch(0, s, m, JOB.micro_batch_size, JOB.seq_len), recv, send,
                           arrived=(lambda kind, step, mb: inbox.arrived((kind, step, mb))) if early else None)
        loop, seen = asyncio.get_running_loop(), []
        backward = ex._backward_full

        def first_backward_files_the_next_activation(st, done=None):
            if not seen:
                loop.call_soon_threadsafe(inbox.put, ("act", 0, 1), acts[1].clone())
                until = time.monotonic() + (10 if early else 0.5)
                while not ex._pool._work_queue.qsize() and time.monotonic() < until:
                    time.sleep(0.001)
                seen.append(ex._pool._work_queue.qsize())
            return backward(st, done)
        ex._backward_full = first_backward_files_the_next_activation
        inbox.put(("act", 0, 0), acts[0].clone())
        r = await ex.run_step(0, actions)
        runs[early] = (seen, r.losses, [p.grad.clone() for p in ex.params])
        ex.close()
    assert runs[True][0] == [1] and runs[False][0] == [0]
    assert runs[True][1] == runs[False][1]
    assert all(torch.equal(a, b) for a, b in zip(runs[True][2], runs[False][2]))


async def test_a_step_failing_while_an_op_is_handed_ahead_leaves_no_gradient():
    """A received tensor refused (raised by ``recv``) while the thread computes a backward handed
    ahead: the step fails once that backward has ended, and no gradient of it is left behind."""
    handle = ModelHandle(JOB)

    async def recv(kind, step, mb):
        if mb == 1:
            raise ValueError("tensor refused")
        return torch.ones(JOB.micro_batch_size, JOB.seq_len, JOB.model_args["dim"])

    async def send(kind, step, mb, t):
        return None

    ex = StageExecutor(handle.build(0, 3), True, False, 2,
                       lambda s, m: data.batch(0, s, m, JOB.micro_batch_size, JOB.seq_len), recv, send,
                       arrived=lambda kind, step, mb: True)
    actions = sched.schedule("gpipe", 2, 2, 0)
    assert [a.op.name for a in actions if a.op.name.startswith("RECV")] == ["RECV_B", "RECV_B"]
    assert [a.mb for a in actions if a.op.name == "RECV_B"] == [0, 1]  # mb 0's backward runs as mb 1's is refused
    with pytest.raises(StepFailed, match="tensor refused"):
        await ex.run_step(0, actions)
    await ex.on_compute_thread(lambda: None)  # (after whatever the thread still had)
    assert all(p.grad is None for p in ex.params)
    ex.close()


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
async def test_each_layer_is_reported_done_during_the_last_backward_with_its_final_gradients(schedule):
    """``on_layer_done`` comes last layer first, while the step's last backward op still runs on a
    slow virtual device, and the gradients it saw are the step's final ones."""
    from spantrain_p2p.profile.virtual import VirtualDevice, stage_layer_flops

    handle = ModelHandle(JOB)
    layers = handle.build(0, handle.num_layers)
    ids, tgt = data.batch(0, 0, 0, JOB.micro_batch_size, JOB.seq_len)
    per_layer = stage_layer_flops(layers, ids, tgt)
    w_flops = sum(x["W"] for x in per_layer)
    device = VirtualDevice(1.0, scale=w_flops / 1e12 / 0.2)  # a weight-grad op takes 0.2 s
    ex = StageExecutor(layers, True, True, 2, lambda s, m: data.batch(0, s, m, JOB.micro_batch_size, JOB.seq_len),
                       None, None, device=device, layer_flops=per_layer)
    loop = asyncio.get_running_loop()
    seen = []

    def done(i):
        seen.append((i, loop.time(), [p.grad.clone() for p in ex._layer_params[i]]))

    actions = peer_actions([assign_microbatches(["a"], [1.0], 2)], schedule)[(0, "a")]
    await ex.run_step(0, actions, on_layer_done=done)
    end = loop.time()
    assert [i for i, _, _ in seen] == list(reversed(range(len(layers))))
    heavy = [i for i, x in enumerate(per_layer) if x["W"] > 0.1 * w_flops]
    at = {i: t for i, t, _ in seen}
    assert end - at[heavy[-1]] > 0.02  # the last big layer's gradients were out well before the end
    for i, _, grads in seen:
        for g, p in zip(grads, ex._layer_params[i]):
            assert torch.equal(g, p.grad)
    ex.close()


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="Linux scheduler statistics")
async def test_a_step_counts_what_its_compute_thread_waited_for_a_core():
    """A busy process pinned to the compute thread's one core takes about half of it: the thread's
    kernel counter says so, and the step's compute ops (``core_wait_s``) count the part of that wait
    that fell within their time: some, never more than the whole, nor than their time. By the
    kernel's counters, not by wall time against a threshold: a loaded host only waits longer."""
    handle = ModelHandle(JOB)
    ex = StageExecutor(handle.build(0, handle.num_layers), True, True, 4,
                       lambda s, m: data.batch(0, s, m, JOB.micro_batch_size, JOB.seq_len), None, None)
    cpu = min(os.sched_getaffinity(0))
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(ex._pool, os.sched_setaffinity, 0, {cpu})  # its thread
    thread = ThreadCoreWait(await loop.run_in_executor(ex._pool, threading.get_native_id))
    actions = sched.schedule("gpipe", 1, 4, 0)
    alone = await ex.run_step(0, actions)  # (warm: the first step allocates)
    assert alone.core_wait_s is not None and alone.core_wait_s >= 0.0
    spin = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    try:
        time.sleep(0.2)  # (it runs: the interpreter started)
        total0 = thread.read()
        busy = [await ex.run_step(s, actions) for s in range(1, 6)]
        total = thread.read() - total0  # all the thread waited, its turns between ops among it
    finally:
        spin.kill()
        spin.wait()
        thread.close()
    waited = sum(r.core_wait_s for r in busy)
    computed = sum(r.compute_s for r in busy)
    assert total > 0.2 * computed, (total, computed)  # about half: the spinner's share of the core
    assert 0.0 < waited <= total, (waited, total)
    assert waited < computed, (waited, computed)
    print(f"\nwith a spinner on its core: {waited:.3f} s of {computed:.3f} s of compute waited for it "
          f"({total:.3f} s in all)")
    ex.close()


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
async def test_the_last_stage_has_its_losses_once_its_last_forward_is_done_before_the_backward_ends(schedule):
    """``on_losses`` comes once, after the step's last forward and before its last backward op, with
    the losses the step returns: a replica's loss can go to the others beside the backward."""
    handle = ModelHandle(JOB)
    ex = StageExecutor(handle.build(0, handle.num_layers), True, True, 2,
                       lambda s, m: data.batch(0, s, m, JOB.micro_batch_size, JOB.seq_len), None, None)
    got, layers = [], []
    actions = peer_actions([assign_microbatches(["a"], [1.0], 2)], schedule)[(0, "a")]
    result = await ex.run_step(0, actions, on_layer_done=lambda i: layers.append(i),
                               on_losses=lambda losses: got.append((list(losses), len(layers))))
    assert got == [(result.losses, 0)] and len(result.losses) == 2  # before any layer of the last backward
    ex.close()


async def test_a_peer_without_micro_batches_reports_every_layer_done():
    handle = ModelHandle(JOB)
    ex = StageExecutor(handle.build(0, 3), True, False, 2, lambda s, m: data.batch(0, s, m, 2, JOB.seq_len), None, None)
    seen = []
    await ex.run_step(0, [], on_layer_done=seen.append)
    assert seen == [2, 1, 0]
    ex.close()


def test_gradient_buckets_follow_layers_and_split_big_ones():
    from spantrain_p2p.train.gradsum import layer_buckets

    b = layer_buckets([[10, 20], [], [300, 5, 5]], bucket_bytes=4 * 100)
    assert b == [(0, [(0, 10), (1, 20)]), (2, [(2, 300)]), (2, [(3, 5), (4, 5)])]


async def test_bf16_trains_like_fp32_with_two_byte_values_between_stages():
    """bf16 autocast with fp32 master weights: 3 stages, 30 steps; the loss stays within 2 % of fp32
    and every activation and gradient between stages is bfloat16."""
    from dataclasses import replace

    job = replace(JOB, steps=30, schedule="1f1b")
    fp32, _ = await run_pipeline(job, 3, 30)
    sent = set()
    bf16, _ = await run_pipeline(job, 3, 30, compute_dtype=torch.bfloat16, sent_dtypes=sent)
    assert sent == {torch.bfloat16}
    gap = abs(sum(bf16[-5:]) / sum(fp32[-5:]) - 1)
    print(f"\nbf16 vs fp32 over 30 steps: loss {bf16[0]:.4f} -> {bf16[-1]:.4f} vs {fp32[0]:.4f} -> {fp32[-1]:.4f}, "
          f"last-5 mean {gap:.2%} apart")
    assert bf16[-1] < bf16[0] - 0.3 and gap < 0.02
