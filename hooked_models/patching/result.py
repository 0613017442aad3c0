"""A sweep's result: the metric after each patch over named, labelled axes, normalised, ranked and plotted."""

import os
from dataclasses import dataclass
from itertools import product

import torch
from torch import Tensor

from hooked_models.patching.sites import AXIS_TITLES


@dataclass
class PatchingResult:
    """A sweep's metric after each patch, with named axes and labelled entries.

    `values[i, j, ...]` is the metric with the patch at (`labels[axes[0]][i]`, `labels[axes[1]][j]`, ...).
    `clean_metric` and `corrupted_metric` are the unpatched runs; `normalized()` maps the corrupted
    run to 0 and the clean run to 1 in either direction, so denoising asks "how much does this
    restore?" and noising "how much survives when this is corrupted?".
    """

    values: Tensor
    axes: tuple[str, ...]
    labels: dict[str, list[str]]
    value: str
    direction: str
    clean_metric: float
    corrupted_metric: float
    method: str = "activation patching"

    @property
    def baseline(self) -> float:
        """The metric of the run the patches are written into."""
        return self.corrupted_metric if self.direction == "denoising" else self.clean_metric

    def effect(self) -> Tensor:
        """values − the unpatched run's metric: what each patch changes."""
        return self.values - self.baseline

    def normalized(self) -> Tensor:
        """(values − corrupted) / (clean − corrupted): 0 is the corrupted run, 1 the clean one."""
        span = self.clean_metric - self.corrupted_metric
        if span == 0:
            raise ValueError("the clean and corrupted metrics are equal; there is nothing to normalize by")
        return (self.values - self.corrupted_metric) / span

    def top(self, k: int = 10) -> list[tuple[str, float]]:
        """The k locations whose patch moves the metric most (by |effect|), as (label, value)."""
        scores = self.effect().abs()
        order = scores.flatten().argsort(descending=True)[:k]
        return [(self.location(int(i)), float(self.values.flatten()[i])) for i in order]

    def location(self, flat_index: int) -> str:
        """The label of one cell, its axes' labels joined: "L1 H3"."""
        index = torch.unravel_index(torch.tensor(flat_index), self.values.shape) if self.axes else ()
        return " ".join(self.labels[a][int(i)] for a, i in zip(self.axes, index)) or self.value

    def __str__(self) -> str:
        head = (f"{self.method} of {self.value} ({self.direction}) over {' × '.join(self.axes) or 'nothing'}: "
                f"clean {self.clean_metric:.4g}, corrupted {self.corrupted_metric:.4g}")
        return "\n".join([head] + [f"  {label:<24} {v:.4g}" for label, v in self.top(5)])

    def plot(self, path: "str | os.PathLike | None" = None, ax=None, normalized: bool = True, title: str | None = None):
        """A labelled heatmap (a bar chart for one axis); the last axis runs across, the rest down.

        Shows `normalized()` when asked and the clean and corrupted runs differ, else `effect()` (the
        change each patch makes), on a diverging scale centred on 0. Saves to `path` when given.
        Returns the matplotlib Figure.
        """
        try:
            import matplotlib

            if ax is None and path is not None:
                matplotlib.use("Agg", force=False)
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError("PatchingResult.plot needs matplotlib (pip install matplotlib)") from None
        use_norm = normalized and self.clean_metric != self.corrupted_metric
        data = (self.normalized() if use_norm else self.effect()).detach().float().cpu()
        if data.ndim == 0:
            data = data.reshape(1, 1)
        rows_axes, cols_axis = self.axes[:-1], (self.axes[-1] if self.axes else None)
        table = data.reshape(-1, data.shape[-1]) if data.ndim > 1 else data.reshape(1, -1)
        row_labels = [" ".join(parts) for parts in product(*(self.labels[a] for a in rows_axes))] or [""]
        col_labels = self.labels[cols_axis] if cols_axis else [self.value]
        if ax is None:
            width = min(3.5 + 0.4 * table.shape[1], 24)
            height = min(2.5 + 0.3 * table.shape[0], 22)
            fig, ax = plt.subplots(figsize=(max(width, 6), max(height, 4)))
        fig = ax.figure
        scale = "restored (0: corrupted, 1: clean)" if use_norm else "change in metric"
        if table.shape[0] == 1 and len(self.axes) <= 1:
            ax.bar(range(table.shape[1]), table[0].numpy(), color="tab:blue")
            ax.set_ylabel(scale)
        else:
            limit = float(table.abs().max()) or 1.0
            image = ax.imshow(table.numpy(), cmap="RdBu", vmin=-limit, vmax=limit, aspect="auto",
                              interpolation="nearest")
            fig.colorbar(image, ax=ax, label=scale)
            ax.set_yticks(range(len(row_labels)), row_labels, fontsize=7 if len(row_labels) > 24 else 9)
            ax.set_ylabel(" × ".join(AXIS_TITLES.get(a, a) for a in rows_axes))
        step = max(1, len(col_labels) // 48)
        crowded = len(col_labels[::step]) * max(map(len, col_labels)) > 60  # labels would overlap: turn them
        ax.set_xticks(range(0, len(col_labels), step), col_labels[::step], rotation=90 if crowded else 0, fontsize=8)
        ax.set_xlabel(AXIS_TITLES.get(cols_axis, cols_axis) if cols_axis else "")
        ax.set_title(title or f"{self.method}: {self.value} ({self.direction})")
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=120)
        return fig


def _result(values: Tensor, grid, value: str, direction: str, base_metric: float, source_metric: float,
            **fields) -> PatchingResult:
    """The labelled result; the unpatched runs' metrics named by the direction (denoising patches
    the corrupted run with the clean one's values, noising the other way)."""
    clean_metric, corrupted_metric = ((source_metric, base_metric) if direction == "denoising"
                                      else (base_metric, source_metric))
    return PatchingResult(values=values.reshape(grid.shape).cpu(), axes=tuple(grid.axes), labels=grid.labels,
                          value=value, direction=direction, clean_metric=clean_metric,
                          corrupted_metric=corrupted_metric, **fields)
