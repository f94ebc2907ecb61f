"""The launcher's progress display: a live bar (rich) on a terminal, a line a second otherwise.

Step, loss, the swarm's tokens/s and the ETA, counted from training's start (the first stage map),
not from the launch: the minutes of start-up and measuring say nothing of the steps to come. The
ETA shows ``--`` until a step has been timed (never ``nan``). Plans and re-plans are printed above
the bar as they happen (``note``).
"""
from __future__ import annotations

import math
import sys
import time
from typing import Callable, Optional


def eta_text(done: int, total: int, seconds: float) -> str:
    """``"1m05s"`` for the time left at the rate so far; ``"--"`` while no step has been timed."""
    if done <= 0 or seconds <= 0 or total <= done:
        return "0s" if total <= done and done > 0 else "--"
    left = (total - done) * seconds / done
    if not math.isfinite(left):
        return "--"
    m, s = divmod(int(round(left)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def line(done: int, total: int, loss: Optional[float], tokens_per_s: Optional[float], epoch: int,
         seconds: float) -> str:
    """The plain progress line (what a terminal's bar says, too)."""
    out = f"step {done:>4}/{total}"
    if loss is not None and math.isfinite(loss):
        out += f"  loss {loss:.4f}"
    if tokens_per_s:
        out += f"  {tokens_per_s:,.0f} tokens/s"
    if epoch > 1:
        out += f"  epoch {epoch}"
    return out + f"  ETA {eta_text(done, total, seconds)}"


class ProgressDisplay:
    """``update(...)`` as the run goes, ``note(text)`` for plans and events, ``close()`` at the end."""

    def __init__(self, total: int, say: Callable[[str], None], live: Optional[bool] = None):
        self.total, self.say = total, say
        self.t_train: Optional[float] = None
        self._last, self._last_print = "", 0.0
        self._bar = None
        if sys.stderr.isatty() if live is None else live:
            from rich.progress import BarColumn, Progress, TextColumn

            self._bar = Progress(TextColumn("[bold]training"), BarColumn(), TextColumn("{task.description}"),
                                 transient=False)
            self._task = self._bar.add_task("", total=total)
            self._bar.start()

    def started(self) -> None:
        if self.t_train is None:
            self.t_train = time.monotonic()

    def update(self, done: int, loss: Optional[float], tokens_per_s: Optional[float], epoch: int,
               finished: bool = False) -> None:
        seconds = time.monotonic() - self.t_train if self.t_train is not None else 0.0
        text = line(done, self.total, loss, tokens_per_s, epoch, seconds)
        if self._bar is not None:
            self._bar.update(self._task, completed=done, description=text.split("  ", 1)[-1])
            return
        key = text.rsplit("  ETA", 1)[0]
        if key != self._last and (time.monotonic() - self._last_print > 1.0 or finished):
            self.say(text)
            self._last, self._last_print = key, time.monotonic()

    def note(self, text: str) -> None:
        if self._bar is not None:
            self._bar.console.print(text, highlight=False, markup=False)
        else:
            self.say(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
