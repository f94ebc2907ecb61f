"""What a peer's stage holds, measured, next to what the planner predicted for it (issue 30).

Measured where it is created: the weights and their gradients as the tensors are (read after a
step's backward, before they are dropped), the optimizer's state tensors after its step, and the
activations the executor's ``StashMeter`` saw kept (the most at once in any step). Predicted: the
cost model's ``peak_memory`` of this peer in the stage map in force (``plan.levers.predicted_peaks``),
for the job's model profile (none for a user model without a FLOP model).
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Optional

import torch

log = logging.getLogger("spantrain.train")


def _nbytes(t: Optional[torch.Tensor]) -> int:
    """The bytes ``t`` holds: a tensor subclass (torchao's 8-bit optimizer state) by its inner tensors."""
    if not isinstance(t, torch.Tensor):
        return 0
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None and type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        names, _ = flatten()
        return sum(_nbytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def held_state(params: list, opt) -> dict[str, int]:
    """Bytes of the weights, their gradients and the optimizer's state, as the tensors are now (an
    optimizer offloaded to the host, ``job.offload``: its state and master weights counted apart,
    as ``host``)."""
    weights = sum(_nbytes(p) for p in params)
    grads = sum(_nbytes(p.grad) for p in params)
    state = sum(_nbytes(v) for s in opt.state.values() for v in s.values())
    masters = getattr(opt, "master", None)
    if masters is not None:
        host = state + sum(_nbytes(m) + _nbytes(m.grad) for m in masters.values())
        return {"weights": weights, "grads": grads, "optimizer": 0, "host": host, "state": weights + grads}
    return {"weights": weights, "grads": grads, "optimizer": state, "state": weights + grads + state}


def predicted(job, smap, peer_id: str) -> Optional[dict]:
    """The planner's memory figures for ``peer_id`` in ``smap`` (bytes: state, stash, peak)."""
    from ..pipeline.schedule import resolve_schedule
    from ..plan import levers
    from ..plan import types as pt
    from .planning import model_profile

    try:
        prof = model_profile(job)
        if prof is None:
            return None
        stages = tuple(replace(st, shares=tuple(st.share_of().values())) for st in smap.stages)
        if smap.islands:  # this peer's island's pipeline
            lo, hi = next((a, b) for a, b in smap.island_ranges() if any(peer_id in st.peers for st in stages[a:b]))
            stages = stages[lo:hi]
        plan = pt.Plan(stages, smap.schedule or resolve_schedule(job.schedule), job.micro_batch_size,
                       job.num_micro_batches)
        return levers.predicted_peaks(plan, prof).get(peer_id)
    except Exception as e:  # a figure for people: never stops training
        log.debug("no memory prediction: %r", e)
        return None


def recomputed_flops(layer_flops: list[dict], split: bool) -> list[dict]:
    """Per layer F, B, W FLOPs under full recomputation: the forward again in B (fused BW alike), and
    in W too where the schedule runs W apart (``pipeline.memory``)."""
    return [{**x, "B": x.get("B", 0.0) + x.get("F", 0.0), **({"W": x.get("W", 0.0) + x.get("F", 0.0)} if split else {})}
            for x in layer_flops]


def allocator_peak(device) -> Optional[int]:
    """On a GPU, the most bytes this process's CUDA allocator has handed out (``max_memory_allocated``):
    everything the stage held at once, temporaries and workspaces included; none on the CPU."""
    if device is None or getattr(device, "type", None) != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))


def report(state: Optional[dict], stash_peak: int, prediction: Optional[dict], recompute: str,
           transient: int = 0, device=None, proxy: bool = False) -> dict:
    """``proxy``: the peer runs a small model standing for the job's workload (``models.workload``):
    the prediction is the workload's and the measurement the proxy's, so no ratio is given."""
    measured = None
    if state is not None:
        measured = {**state, "stash": stash_peak + transient, "peak": state["state"] + stash_peak + transient,
                    **({"recompute_transient": transient} if transient else {})}
    out = {"recompute": recompute, "measured": measured, "predicted": prediction, **({"proxy": True} if proxy else {})}
    peak = None if proxy or not prediction else prediction.get("peak")  # what a ratio is taken against
    if measured and peak:
        out["measured_over_predicted"] = round(measured["peak"] / peak, 4)
    cuda = allocator_peak(device)
    if cuda is not None:
        out["cuda_max_allocated"] = cuda
        if peak:
            out["cuda_over_predicted"] = round(cuda / peak, 4)
    return out


def out_of_memory_progress(e: BaseException, predicted: Optional[dict], progress: dict) -> dict:
    """The progress fields of an epoch abandoned because this peer's device ran out of memory
    (``models.devices.is_out_of_memory``: ``torch.OutOfMemoryError`` or a CUDA library's failed
    allocation in its cause): ``oom``, and ``memory_cap``, below what the planner ``predicted`` this
    peer to hold (and below the cap its ``progress`` has), so that the next plan asks less of it
    (``decide.memory_caps``); nothing for another failure."""
    from ..models.devices import is_out_of_memory
    from .decide import CAP_MARGIN

    if not is_out_of_memory(e):
        return {}
    out: dict = {"oom": 1}  # (a record's progress holds numbers and short strings)
    peak = (predicted or {}).get("peak")
    if peak:
        cap = int(CAP_MARGIN * peak)
        old = progress.get("memory_cap")
        out["memory_cap"] = min(cap, old) if isinstance(old, int) else cap
    log.warning("out of memory on this device%s", f": planning within {out['memory_cap'] / 2**20:.1f} MiB from now"
                if "memory_cap" in out else "")
    return out
