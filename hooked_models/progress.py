"""Progress and cancellation, one mechanism for every long function of the library.

A long function (a patching sweep, edge attribution, `attribute`, feature statistics, a harvest) takes
`progress=`: `False` (silent), `True` (a tqdm bar), `None` (a bar when stderr is a terminal and the work
is long), or a callable. A callable is handed a `Step` after every batch: the work done and the work
in all, in the function's unit, and its phase ("logits", "features", ...). A tqdm bar is such a callable
too, so the library's bars and the explorer's jobs read the same numbers.

To stop a run, a callable raises `Cancelled`. The function stops at that batch boundary: its hooks are
removed as on any exception (`model.hooks()` cleans up in `finally`), nothing it wrote to the model stays,
and `Cancelled` reaches the caller.

    def report(step):                    # step.done / step.total, step.phase, step.unit
        if stop_requested():
            raise Cancelled("stopped by the user")
    activation_patch(model, clean, corrupted, metric, "layer_input", progress=report)
"""

import sys
from collections.abc import Callable
from dataclasses import dataclass

from tqdm import tqdm


class Cancelled(Exception):
    """Raised by a progress callable to stop a long function at its next batch boundary."""


@dataclass(frozen=True)
class Step:
    """Where a long function stands: `done` of `total` units of work (`unit`), in `phase`."""

    done: int
    total: int
    phase: str = ""
    unit: str = "it"

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total else 1.0

    @property
    def left(self) -> int:
        return self.total - self.done


Callback = Callable[[Step], None]
ProgressArg = bool | None | Callback


class Tracker:
    """What a long function reports through: `advance(n)` after each batch, `reset(total, phase)` when a
    phase starts. Forwards every step to the callable and to the tqdm bar (whichever are on)."""

    def __init__(self, callback: Callback | None, bar: tqdm | None, total: int, phase: str, unit: str):
        self.callback, self.bar = callback, bar
        self.total, self.phase, self.unit, self.done = total, phase, unit, 0

    def reset(self, total: int, phase: str | None = None) -> None:
        """A new phase (or the total now known): the count starts again from 0."""
        self.total, self.done = total, 0
        if phase is not None:
            self.phase = phase
        if self.bar is not None:
            self.bar.reset(total=total)
            if phase:
                self.bar.set_description(f"{self.bar.desc.split(':')[0]}: {phase}")
        self._report()

    def advance(self, n: int = 1) -> None:
        """`n` more units done; a callable that raises `Cancelled` stops the work here."""
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        self._report()

    def _report(self) -> None:
        if self.callback is not None:
            self.callback(Step(self.done, self.total, self.phase, self.unit))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def tracker(progress: ProgressArg, *, total: int, desc: str, unit: str = "it", phase: str = "",
            long: bool = True, unit_scale: bool = False) -> Tracker:
    """The `Tracker` for a function's `progress=` argument. `long`: whether the work is long enough for a
    bar when `progress` is None (then shown only on a terminal). `unit_scale`: the bar counts in k, M, ...
    (tqdm's). Close it when done (or use `with`)."""
    callback = progress if callable(progress) else None
    show = (sys.stderr.isatty() and long) if progress is None else progress is True
    bar = (tqdm(total=total, desc=f"{desc}: {phase}" if phase else desc, unit=unit, unit_scale=unit_scale)
           if show else None)
    return Tracker(callback, bar, total, phase, unit)

