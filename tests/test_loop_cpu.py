"""The loop's CPU by coroutine and role (``train/loop_cpu``, ``SPANTRAIN_LOOP_CPU``)."""
import asyncio
import json
import time

import uvloop

from spantrain_p2p.train import loop_cpu


async def module_level() -> None:
    await asyncio.sleep(0)


def test_roles_sort_the_loop_s_coroutines_and_the_rest_is_the_loop_s_own():
    assert loop_cpu.role("StageExecutor._send.<locals>.send") == "data plane"
    assert loop_cpu.role("SecureProtocol.buffer_updated") == "data plane"
    assert loop_cpu.role("GradientSum._bucket") == "gradient sum"
    assert loop_cpu.role("Trainer._train") == "schedule"
    assert loop_cpu.role("Election.run") == "control plane"
    assert loop_cpu.role("find_values.call") == "control plane"
    assert loop_cpu.role("RequestHandler._handle_request") == "status pages"
    assert loop_cpu.role("something_else") == "other"
    fig = {"loop_cpu_s": 1.0, "coroutines": {"Trainer._train": [0.3, 10], "Election.run": [0.1, 2],
                                             "Peer._heartbeat_loop": [0.05, 1], "mystery": [0.05, 1]}}
    roles = loop_cpu.by_role(fig)
    assert roles["schedule"] == 0.3 and abs(roles["control plane"] - 0.15) < 1e-9 and roles["other"] == 0.05
    assert abs(roles["loop"] - 0.5) < 1e-9 and abs(sum(roles.values()) - 1.0) < 1e-9


def test_a_timed_loop_counts_each_coroutine_s_cpu_from_begin_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv(loop_cpu.ENV, str(tmp_path))
    monkeypatch.setattr(loop_cpu, "_M", loop_cpu._Meter())
    monkeypatch.setattr(loop_cpu, "_time_callbacks", lambda: None)  # (the classes stay as they are)
    assert loop_cpu.wrap_loop_factory(None) is not None

    def burn(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    async def busy(turns: int) -> None:  # 2 ms of CPU a turn
        for _ in range(turns):
            burn(0.002)
            await asyncio.sleep(0)

    async def idle() -> None:
        await asyncio.sleep(0.05)

    async def outside(seconds: float) -> None:
        burn(seconds)

    async def main():
        await asyncio.create_task(busy(10))  # before begin: not counted
        loop_cpu.begin()
        errors = []
        try:
            await asyncio.gather(asyncio.create_task(busy(50)), asyncio.create_task(idle()),
                                 asyncio.create_task(outside(0.03)))
            await asyncio.create_task(module_level())  # named with its module's last part
            task = asyncio.create_task(asyncio.sleep(10))
            await asyncio.sleep(0)
            task.cancel()  # a cancelled task's throw() is timed too, and it still raises
            try:
                await task
            except asyncio.CancelledError:
                errors.append("cancelled")
        finally:
            path = loop_cpu.end("p0")
        return path, errors

    runner_factory = loop_cpu.wrap_loop_factory(uvloop.new_event_loop)
    with asyncio.Runner(loop_factory=runner_factory) as runner:
        path, errors = runner.run(main())
    assert errors == ["cancelled"] and path == str(tmp_path / "p0.loop_cpu.json")
    fig = json.loads((tmp_path / "p0.loop_cpu.json").read_text())
    cor = fig["coroutines"]
    name = "test_a_timed_loop_counts_each_coroutine_s_cpu_from_begin_to_end.<locals>.busy"
    assert 0.1 <= cor[name][0] <= 0.15 and cor[name][1] == 51  # its 50 turns' 0.1 s (and the last), not the 10 before
    assert cor[name.replace("busy", "idle")][0] < 0.01
    assert cor[name.replace("busy", "outside")][0] >= 0.029
    assert fig["loop_cpu_s"] >= sum(v[0] for v in cor.values()) and 0.13 <= fig["wall_s"] < 10
    assert cor["test_loop_cpu.module_level"][1] == 2
    assert loop_cpu.end("p0") is None  # not counting any more


def test_figures_that_cannot_be_written_leave_the_peer_running(tmp_path, monkeypatch):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(loop_cpu.ENV, str(blocked / "under-a-file"))
    monkeypatch.setattr(loop_cpu, "_M", loop_cpu._Meter())
    loop_cpu.begin()
    assert loop_cpu.end("p0") is None


def test_without_the_variable_the_loop_is_left_as_it_is(monkeypatch):
    monkeypatch.delenv(loop_cpu.ENV, raising=False)
    assert loop_cpu.wrap_loop_factory(uvloop.new_event_loop) is uvloop.new_event_loop
    assert loop_cpu.wrap_loop_factory(None) is None
    loop_cpu.begin()
    assert loop_cpu.end("p0") is None
