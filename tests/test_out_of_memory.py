"""A device that runs out of memory under a plan (issue 30): a virtual device with memory refuses a
stage that does not fit as a real allocation would; the peer says so in its record, with the most
it can hold; the planner asks less of it next (its cap; for a fixed plan, activation recomputation),
and stops the run with a clear error where nothing is left to try, instead of failing forever."""
from __future__ import annotations

import json
import types

import pytest
import torch

from spantrain_p2p.data import generated as data
from spantrain_p2p.job.spec import JobSpec, ModelHandle
from spantrain_p2p.pipeline import schedule as sched
from spantrain_p2p.pipeline.executor import StageExecutor, StepFailed
from spantrain_p2p.plan.stagemap import Stage, StageMap
from spantrain_p2p.profile.virtual import VirtualDevice
from spantrain_p2p.train.decide import MAX_MEMORY_CAP, memory_caps, out_of_memory, refit_fixed
from tests._helpers import run_swarm_exit

MAP = StageMap(4, "j", (Stage(("a", "b"), (0, 2), (0.5, 0.5)), Stage(("c",), (2, 4), (1.0,))))


def _rec(state="training", **progress):
    return types.SimpleNamespace(state=state, progress=progress)


def test_only_a_sane_cap_of_its_own_counts():
    live = {"a": _rec(memory_cap=5 << 20), "b": _rec(memory_cap=True), "c": _rec(memory_cap=-1),
            "d": _rec(memory_cap=MAX_MEMORY_CAP + 1), "e": _rec(memory_cap=1.5e6), "f": _rec()}
    assert memory_caps(live) == {"a": 5 << 20}


def test_the_peers_that_ran_out_under_this_map_are_named():
    live = {"a": _rec("recovering", failed_epoch=4, oom=1), "b": _rec("recovering", failed_epoch=4),
            "c": _rec("recovering", failed_epoch=3, oom=1)}
    assert out_of_memory(MAP, live) == ["a"]  # b failed otherwise; c ran out under an older map


def test_a_fixed_plan_recomputes_where_a_peer_ran_out_and_stops_when_that_was_tried():
    new = StageMap(5, "j", MAP.stages)
    fitted, error = refit_fixed(MAP, new, ["c"], "auto")
    assert not error and [st.recompute for st in fitted.stages] == ["none", "full"]
    again, error = refit_fixed(fitted, StageMap(6, "j", MAP.stages), ["a"], "auto")
    assert not error and [st.recompute for st in again.stages] == ["full", "full"]  # the lever stays on
    _, error = refit_fixed(again, StageMap(7, "j", MAP.stages), ["c"], "auto")
    assert "c ran out of memory on layers [2,4) with activation recomputation full" in error
    _, error = refit_fixed(MAP, new, ["c"], "none")
    assert "with activation recomputation none" in error
    same, error = refit_fixed(MAP, new, [], "auto")
    assert not error and same == new


def test_a_cuda_librarys_failed_allocation_counts_as_out_of_memory_where_it_is_the_cause():
    """On a GPU shared by several peers cuBLAS failed to create its handle (a RuntimeError, not torch's
    OutOfMemoryError) and the peer crashed instead of asking the planner for less."""
    from spantrain_p2p.models.devices import is_out_of_memory

    cublas = RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
    try:
        raise StepFailed("step 11 failed") from cublas
    except StepFailed as e:
        assert is_out_of_memory(e)
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert not is_out_of_memory(StepFailed("step 3 failed: no activation"))
    assert not is_out_of_memory(RuntimeError("Expected all tensors to be on the same device"))


def test_a_virtual_device_refuses_a_stage_that_does_not_fit_as_an_allocation_would():
    job = JobSpec(model="hf:llama-tiny", seq_len=64, micro_batch_size=4)
    handle = ModelHandle(job)
    actions = sched.schedule("1f1b", 1, 2, 0)
    batch = lambda s, m: data.batch(0, s, m, job.micro_batch_size, job.seq_len)  # noqa: E731
    roomy = StageExecutor(handle.build(0, handle.num_layers), True, True, 2, batch, None, None,
                          device=VirtualDevice(1e6, memory_bytes=1 << 30))
    tight = StageExecutor(handle.build(0, handle.num_layers), True, True, 2, batch, None, None,
                          device=VirtualDevice(1e6, memory_bytes=1 << 20))
    import asyncio

    async def both():
        ok = await roomy.run_step(0, actions)
        with pytest.raises(StepFailed, match="virtual device out of memory") as e:
            await tight.run_step(0, actions)
        return ok, e.value

    ok, failure = asyncio.run(both())
    assert len(ok.losses) == 2 and isinstance(failure.__cause__, torch.OutOfMemoryError)
    roomy.close()
    tight.close()


def _swarm(tmp_path, *flags):
    run = tmp_path / "run"
    code, summary = run_swarm_exit("--scenario", "peers/tight-memory.toml", "--model", "hf:llama-tiny", "--seq-len", "128",
                                   "--micro-batch-size", "8", "--steps", "6", "--seed", "1", "--plan", "even",
                                   "--stages", "2", "--run-dir", str(run), *flags)
    return code, summary, run


@pytest.mark.heavy
def test_a_fixed_plan_that_runs_out_of_memory_turns_recomputation_on_and_loses_no_step(tmp_path, capfd):
    """peers/tight-memory.toml (12 MB devices), 2 fixed stages of the tiny Llama at 8 x 128 tokens:
    neither stage fits as it is; each peer's first step fails on its virtual device, and the next maps
    recompute its stage. Then 6 steps, none lost, each peer under its device's memory."""
    code, summary, run = _swarm(tmp_path)
    assert code == 0, capfd.readouterr().err[-2000:]
    assert summary["steps"] == 6 and summary["lost_steps"] == 0
    assert [st["recompute"] for st in summary["plans"][-1]["stages"]] == ["full", "full"]
    logs = "".join(p.read_text() for p in run.glob("*.log"))
    assert "virtual device out of memory" in logs and "out of memory on this device: planning within" in logs
    for path in sorted((run / "reports").glob("*.json")):
        mem = json.loads(path.read_text())["memory"]
        assert mem["recompute"] == "full" and mem["measured"]["peak"] < 0.0112 * 2**30, (path.name, mem)


@pytest.mark.heavy
def test_a_fixed_plan_without_recomputation_stops_saying_who_ran_out(tmp_path, capfd):
    code, _, _ = _swarm(tmp_path, "--recompute", "none")
    err = capfd.readouterr().err
    assert code != 0
    assert "ran out of memory on layers" in err and "this fixed plan does not fit its device" in err, err[-2000:]


def test_the_planner_sees_a_capped_peer_with_its_cap_and_the_others_as_measured():
    from spantrain_p2p.train.planning import snapshot

    prof = {"profile": {"effective_tflops": 1.0, "memory_bytes": 8 << 30}}
    snap = snapshot({"a": prof, "b": prof}, {}, ["a", "b"], {"a": 3 << 30})
    assert snap.peer("a").memory_bytes == 3 << 30 and snap.peer("b").memory_bytes == 8 << 30
