"""The default job's single-process losses, computed once a suite run and shared by its test processes.

Seven swarm tests check their losses against one process training the default job (``JobSpec()``
through ``reference_run``): 40 to 400 steps each, 38 ms of CPU a step here, and every xdist worker
that ran one computed its own: about 1,000 steps, 35-45 CPU-s of a suite run (2026-12-02). A step's
loss does not depend on how many steps the job has (a constant learning rate, step ``s``'s batch
drawn from ``(seed, s, index)``: the first 40 of a 400-step run equal a 40-step run's, bit for bit),
so the first process to ask computes ``CACHED_STEPS`` (more if asked for more) under a lock and
writes them down, and the others read them.

The file lives in the run's own folder (``SPANTRAIN_TEST_RUN_DIR``, which ``conftest`` sets in xdist's
workers to their shared ``pytest-N``), so a run never reads losses an older version of the model or
optimizer wrote. Outside xdist each process keeps its own, in memory.
"""
from __future__ import annotations

import fcntl
import functools
import json
import os

CACHED_STEPS = 400  # the most a test asks for (test_hostile's fuzzed run)


def default_losses(steps: int) -> list[float]:
    """The default job's first ``steps`` losses, as ``reference_run(JobSpec(steps=steps), steps)[0]``."""
    folder = os.environ.get("SPANTRAIN_TEST_RUN_DIR")
    if not folder:
        return list(_in_memory(max(steps, CACHED_STEPS))[:steps])
    path = os.path.join(folder, "default-job-losses.json")
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed (or when this process dies)
        try:
            with open(path) as f:
                losses = json.load(f)
        except FileNotFoundError:
            losses = []
        if len(losses) < steps:
            losses = _compute(max(steps, CACHED_STEPS))
            with open(path + ".tmp", "w") as f:
                json.dump(losses, f)  # floats round-trip exactly through JSON
            os.replace(path + ".tmp", path)
    return losses[:steps]


@functools.lru_cache(maxsize=1)
def _in_memory(steps: int) -> tuple[float, ...]:
    return tuple(_compute(steps))


def _compute(steps: int) -> list[float]:
    from spantrain_p2p.job.reference import reference_run
    from spantrain_p2p.job.spec import JobSpec

    return reference_run(JobSpec(steps=steps), steps)[0]
