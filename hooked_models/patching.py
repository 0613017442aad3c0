"""Activation patching and attribution patching over the standard vocabulary, batched.

    from hooked_models import patching
    metric = patching.logit_diff_metric(answers, wrong_answers)
    result = patching.activation_patch(model, clean, corrupted, metric, "layer_input", over=("layer", "seq"))
    result.top(5); result.plot("out/resid.png")

A sweep patches one value (`layer_input`, `attention_head_outputs`, `attention_keys`, `mlp_neurons`, a
family's own values, or a TransformerLens short name such as `resid_pre` or `z`) at every hook point
that carries it, indexed along the dimensions its layout names (`seq`, `num_heads`, `num_kv_heads`,
`intermediate_size`, `rank`, ...; `pos`, `head`, `neuron` are accepted as TransformerLens-style
aliases). Nothing here knows a family: the sites, dimensions and sizes come from the vocabulary.

Denoising runs the corrupted input and writes in the clean run's activations; noising runs the clean
input and writes in the corrupted run's. A patch cannot reach back: a patch at layer l that first
writes something new at position p leaves every layer below l and every position before p as in the
run it is written into. So a patched run computes only layers l ... and positions p ...: it starts
at layer l (`start_at_layer`) from the unpatched run's residual stream there, its attention reading
the earlier positions' keys and values from a key/value cache filled from the unpatched run, and the
metric gets the unpatched run's logits before p. A patch that writes nothing new is not run at all
(its metric is the unpatched one). Many patches share a forward: each is a copy of the prompts along
the batch with its own patch (a `torch.where` against a per-copy mask), copies join the batch at
their own layer, and the forwards are sized to a memory budget. Attribution patching (Nanda 2023,
"Attribution Patching") estimates every patch at once from one forward and one backward:
effect ≈ Σ grad · (source − base).
"""

import os
import re
import sys
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import groupby, product

import numpy as np
import torch
import torch.nn as nn
from jaxtyping import Float, Int
from torch import Tensor
from tqdm import tqdm

from hooked_models.components.kv_cache import KeyValueCache
from hooked_models.devices import free_memory
from hooked_models.hooks import ValueHook
from hooked_models.vocabulary import POSITION_DIMS, Value, nearest_values

Metric = Callable[[Float[Tensor, "batch seq vocab_size"]], Tensor]

DIRECTIONS = ("denoising", "noising")

# What a sweep indexes when `over` is not given, by layout: the unit an interpretability reader asks about.
DEFAULT_OVER: dict[str, tuple[str, ...]] = {
    "Residual": ("seq",),
    "Logits": ("seq",),
    "Queries": ("num_heads",),
    "Keys": ("num_kv_heads",),
    "Values": ("num_kv_heads",),
    "Pattern": ("num_heads",),
    "HeadOutputs": ("num_heads",),
    "HeadResults": ("num_heads",),
    "PerHeadResidual": ("num_heads",),
    "PerKVHeadResidual": ("num_kv_heads",),
    "Neurons": ("intermediate_size",),
    "Scale": ("seq",),
    "Bottleneck": ("rank",),
}

# TransformerLens's axis names (and plain words) -> the layout dimensions they may mean, in preference order.
AXIS_ALIASES: dict[str, tuple[str, ...]] = {
    "pos": ("seq", "query"),
    "position": ("seq", "query"),
    "dest_pos": ("query", "seq"),
    "src_pos": ("key",),
    "head": ("num_heads", "num_kv_heads"),
    "head_index": ("num_heads", "num_kv_heads"),
    "kv_head": ("num_kv_heads",),
    "neuron": ("intermediate_size",),
}

# How an axis is titled on a plot, and the prefix of its entries' labels ("L3 H5").
AXIS_TITLES = {
    "layer": "layer", "site": "hook point", "seq": "position", "query": "query position",
    "key": "key position", "num_heads": "head", "num_kv_heads": "key/value head",
    "intermediate_size": "neuron", "rank": "bottleneck unit", "hidden_size": "residual dimension",
    "expert": "expert", "vocab_size": "token",
}
_LABEL_PREFIX = {"layer": "L", "num_heads": "H", "num_kv_heads": "KV", "intermediate_size": "N", "rank": "R",
                 "expert": "E", "hidden_size": "D"}

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class Site:
    """One hook point a sweep patches: its standard name, the value it carries, and its layer."""

    name: str
    value: Value
    layer: int | None


@dataclass(frozen=True)
class Patch:
    """One patch: a site and, per non-batch dimension of its value, what to overwrite there.

    Each entry of `index` is None (the whole dimension), an int, or a tuple of ints (a group of
    positions, such as the window an alpha-er expert owns).
    """

    site: str
    index: tuple[int | tuple[int, ...] | None, ...]


def find_sites(model, value: str) -> list[Site]:
    """Every hook point carrying `value`: a standard value name (`layer_input`), a TransformerLens short
    name (`resid_pre`, `z`), one hook's full name (either kind), or a suffix of hook names."""
    points = {name: p for name, p in model.standard_hook_dict.items() if isinstance(p, ValueHook)}
    if value in points or value in model.aliases:
        names = [model.resolve_hook_name(value)[0]]
    else:
        names = [n for n, p in points.items() if p.value.name == value]
        if not names:
            tl = value if value.startswith("hook_") else f"hook_{value}"
            names = [model.aliases[a] for a in model.aliases if a == tl or a.endswith("." + tl)]
        if not names:
            names = [n for n in points if n.endswith("." + value)]
    if not names:
        known = sorted({p.value.name for p in points.values()})
        short = {alias.rpartition(".")[2].removeprefix("hook_") for alias in model.aliases}  # resid_pre, z
        close = nearest_values(value, [*known, *sorted(short - set(known))])
        hint = f"did you mean {' or '.join(map(repr, close))}?" if close else f"it has {', '.join(known)}"
        raise ValueError(f"{type(model).__name__} has no value {value!r}; {hint}")
    sites = []
    for name in names:
        match = _LAYER.search(name)
        sites.append(Site(name, points[name].value, int(match.group(1)) if match else None))
    return sites


def _resolve_axis(axis: str, value: Value, virtual: dict) -> str:
    """A user's axis name -> a dimension of the value's layout, 'layer'/'site', or a virtual axis."""
    dims = value.dims[1:]
    if axis in ("layer", "site") or axis in dims or axis in virtual:
        return axis
    for candidate in AXIS_ALIASES.get(axis, ()):
        if candidate in dims:
            return candidate
    raise ValueError(
        f"cannot sweep {value.name} ({value.layout_text}) over {axis!r}; its dimensions are "
        f"{', '.join(dims)}{', ' + ', '.join(virtual) if virtual else ''} (and 'layer')"
    )


def _virtual_axes(model, value: Value, seq: int) -> dict[str, tuple[str, list[tuple[int, ...]]]]:
    """Axes that stand for groups along a dimension: `expert` -> the positions each expert owns.

    A model with positional experts has a module whose `expert_index(seq)` gives each position's
    expert (alpha-er's floor(t·G/T)); a patch of expert g overwrites the positions it owns.
    """
    position_dim = next((d for d in value.dims[1:] if d in POSITION_DIMS), None)
    router = next((m for m in model.modules() if callable(getattr(m, "expert_index", None))), None)
    if position_dim is None or router is None or seq == 0:
        return {}
    index = router.expert_index(seq).cpu()
    groups = [tuple(torch.nonzero(index == g).flatten().tolist()) for g in range(int(index.max()) + 1)]
    return {"expert": (position_dim, groups)}


@dataclass
class _Grid:
    """The sweep's axes: names, entries' labels, and per entry the (dimension, selector) it sets."""

    axes: list[str] = field(default_factory=list)
    labels: dict[str, list[str]] = field(default_factory=dict)
    entries: dict[str, list] = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(len(self.labels[a]) for a in self.axes)


def plan(
    model,
    sites: list[Site],
    over: Sequence[str] | None,
    select: dict[str, Sequence[int]] | None,
    sizes: dict[str, int] | list[dict[str, int]],
    position_labels: Sequence[str] | None = None,
) -> tuple[_Grid, list[Patch]]:
    """The grid of a sweep and its patches, in row-major order of the grid.

    `sizes` gives each dimension's size (per site, as a list, where the sites may differ).
    """
    value = sites[0].value
    if any(s.value.layout != value.layout for s in sites):
        raise ValueError(f"the sites {[s.name for s in sites]} do not share one layout")
    sizes = sizes if isinstance(sizes, list) else [sizes] * len(sites)
    dims = value.dims[1:]
    virtual = _virtual_axes(model, value, sizes[0].get("seq", sizes[0].get("query", 0)))
    over = DEFAULT_OVER.get(value.layout, ()) if over is None else tuple(over)
    axes = [_resolve_axis(a, value, virtual) for a in over if a not in ("layer", "site")]
    select = {(_resolve_axis(k, value, virtual) if k not in ("layer", "site") else k): list(v)
              for k, v in (select or {}).items()}
    if len(set(axes)) != len(axes):
        raise ValueError(f"over={tuple(over)} names a dimension twice")
    targets = [virtual[a][0] if a in virtual else a for a in axes]
    if len(set(targets)) != len(targets):
        raise ValueError(f"over={tuple(over)} sweeps {sorted(targets)} twice (an expert is a group of positions)")

    grid = _Grid()
    # The site axis: layers when each site has its own, else hook points, absent for one model-level site.
    layered = all(s.layer is not None for s in sites) and len({s.layer for s in sites}) == len(sites)
    site_axis = "layer" if layered else ("site" if len(sites) > 1 else None)
    if site_axis is not None:
        keys = [s.layer if layered else i for i, s in enumerate(sites)]
        wanted = select.pop(site_axis, None) or select.pop("layer" if site_axis == "site" else "site", None)
        chosen = [i for i, k in enumerate(keys) if wanted is None or k in wanted]
        if wanted is not None and len(chosen) != len(set(wanted)):
            raise ValueError(f"select[{site_axis!r}]={wanted} names layers without {value.name}; "
                             f"it is at {keys}")
        grid.axes.append(site_axis)
        grid.labels[site_axis] = [f"L{sites[i].layer}" if layered else _site_label(sites[i]) for i in chosen]
        grid.entries[site_axis] = [sites[i] for i in chosen]
        sites, sizes = [sites[i] for i in chosen], [sizes[i] for i in chosen]
    # A swept dimension must have one size at every site (alpha-er's bottlenecks differ in rank).
    for dim in targets:
        if len({size[dim] for size in sizes}) > 1:
            shapes = {s.name: size[dim] for s, size in zip(sites, sizes)}
            raise ValueError(f"the hook points carrying {value.name} differ in {dim} ({shapes}); name one kind "
                             f"by a longer suffix, such as {'.'.join(sites[-1].name.split('.')[-2:])!r}")
    sizes = sizes[0]
    for axis in axes:
        if axis in virtual:
            dim, groups = virtual[axis]
            indices = select.pop(axis, None) or list(range(len(groups)))
            grid.entries[axis] = [(dim, groups[i]) for i in _checked(indices, len(groups), axis)]
        else:
            indices = select.pop(axis, None) or list(range(sizes[axis]))
            grid.entries[axis] = [(axis, i) for i in _checked(indices, sizes[axis], axis)]
        grid.axes.append(axis)
        grid.labels[axis] = _labels(axis, indices, position_labels)
    if select:
        raise ValueError(f"select names {sorted(select)}, which the sweep over {grid.axes} does not have")

    single_site = sites[0] if site_axis is None else None
    patches = []
    for combo in product(*(grid.entries[a] for a in grid.axes)):
        site, index = single_site, dict.fromkeys(dims)
        for axis, entry in zip(grid.axes, combo):
            if axis in ("layer", "site"):
                site = entry
            else:
                dim, selector = entry
                index[dim] = selector
        patches.append(Patch(site.name, tuple(index[d] for d in dims)))
    return grid, patches


def _site_label(site: Site) -> str:
    """'layers.0.self_attn.qkv_proj.bottleneck' -> 'L0 qkv_proj': short enough for a plot's ticks."""
    path = site.name.removesuffix("." + site.value.name).removesuffix(site.value.name) or site.value.name
    path = re.sub(r"\.(self_attn|mlp)\.", ".", path)
    return re.sub(r"^layers\.(\d+)\.?", r"L\1 ", path).strip()


def _checked(indices: Sequence[int], size: int, axis: str) -> list[int]:
    for i in indices:
        if not 0 <= i < size:
            raise ValueError(f"{AXIS_TITLES.get(axis, axis)} index {i} is outside [0, {size}) for axis {axis!r}")
    return list(indices)


def _labels(axis: str, indices: list[int], position_labels: Sequence[str] | None) -> list[str]:
    if axis in POSITION_DIMS + ("key",) and position_labels is not None:
        return [f"{i} {position_labels[i]}" for i in indices]
    return [f"{_LABEL_PREFIX.get(axis, '')}{i}" for i in indices]


def _mask(indices: list[tuple | None], shape: tuple[int, ...], device) -> Tensor:
    """[copies 1 *dims]: True where copy n is overwritten, by the patch index `indices[n]` (None: not at all).

    Dimensions no patch indexes stay of size 1 (broadcast), so the mask is small.
    """
    given = [index for index in indices if index is not None]
    used = [any(index[d] is not None for index in given) for d in range(len(shape))]
    mask_shape = tuple(s if u else 1 for s, u in zip(shape, used))
    mask = torch.zeros((len(indices), 1, *mask_shape), dtype=torch.bool)
    for n, index in enumerate(indices):
        if index is None:
            continue
        row = torch.ones(mask_shape, dtype=torch.bool)
        for d, selector in enumerate(index):
            if selector is None:
                continue
            keep = torch.zeros(mask_shape[d], dtype=torch.bool)
            keep[list(selector) if isinstance(selector, tuple) else selector] = True
            row &= keep.view([-1 if i == d else 1 for i in range(len(mask_shape))])
        mask[n, 0] = row
    return mask.to(device)


def _write_patches(activation: Tensor, hook, mask: Tensor, source: Tensor) -> Tensor:
    """The batched patch: copy n of the input (rows n·B … n·B+B−1) takes `source` where mask[n] is True."""
    copies = activation.unflatten(0, (mask.shape[0], -1))
    return torch.where(mask, source.to(copies.dtype).unsqueeze(0), copies).flatten(0, 1)


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


def logit_diff_metric(
    answers: Int[Tensor, " batch"] | Sequence[int], wrong: Int[Tensor, " batch"] | Sequence[int], position: int = -1
) -> Metric:
    """A metric: the mean over prompts of logit(answer) − logit(wrong) at `position`."""
    answers, wrong = torch.as_tensor(answers), torch.as_tensor(wrong)

    def metric(logits: Float[Tensor, "batch seq vocab_size"]) -> Tensor:
        last = logits[:, position].float()
        rows = torch.arange(last.shape[0], device=last.device)
        return (last[rows, answers.to(last.device)] - last[rows, wrong.to(last.device)]).mean()

    return metric


def _tokens(model, input) -> Tensor:
    tokens = model.to_tokens(input) if isinstance(input, (str, list)) else input
    if not isinstance(tokens, Tensor) or tokens.ndim != 2:
        raise ValueError("clean and corrupted must be token tensors [batch seq] (or text)")
    device = next(model.parameters()).device
    return tokens.to(device)


def _scalar(out, name: str = "metric") -> Tensor:
    out = torch.as_tensor(out)
    if out.numel() != 1:
        raise ValueError(f"the {name} must return a scalar (average over prompts); got shape {tuple(out.shape)}")
    return out.detach().float().reshape(())


def _runs(model, clean, corrupted, direction: str):
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be 'denoising' or 'noising', not {direction!r}")
    clean, corrupted = _tokens(model, clean), _tokens(model, corrupted)
    if clean.shape != corrupted.shape:
        raise ValueError(f"clean {tuple(clean.shape)} and corrupted {tuple(corrupted.shape)} tokens must have "
                         "one shape: a patch moves an activation between aligned positions")
    return (corrupted, clean) if direction == "denoising" else (clean, corrupted)


def row_bytes(model, tokens: Tensor, start: int = 0) -> int:
    """A rough upper bound on the memory one patched copy of `tokens` needs in a forward that runs
    positions `start` ... (the earlier ones read from a key/value cache): per position the widest
    activations alive at once in a layer, the explicit attention's scores and pattern over every
    key, and the logits; and the cached keys and values of every layer."""
    cfg = model.cfg
    batch, seq = tokens.shape
    itemsize = next(model.parameters()).element_size()
    per_position = itemsize * (8 * cfg.hidden_size + 2 * cfg.intermediate_size + 3 * cfg.num_heads * seq
                               + cfg.vocab_size)
    cached = itemsize * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * seq if start else 0
    return batch * ((seq - start) * per_position + cached)


# A rough model of a device, for the choice of which patches share a forward (never for a result):
# FLOP/s (per thread on a CPU), bytes/s read from memory, and seconds a layer call costs in Python.
# The CPU's are one thread of the 2-core EPYC the benchmarks ran on (benchmarks/README.md).
_DEVICE_SPEED = {"cpu": (5e10, 5e9, 3e-4), "cuda": (1e14, 2e12, 3e-4)}


def layer_call_rows(model) -> float:
    """What running a layer once costs beyond the rows it runs, counted in rows (a row is one
    position of one copy through one layer): reading the layer's weights and the call's own overhead,
    on a roofline of the device (`_DEVICE_SPEED`). Large for a small model (the overhead dominates),
    about 20 for an 8-layer, 1024-wide float32 model on one CPU thread."""
    weight = next(model.parameters())
    flops, bandwidth, overhead = _DEVICE_SPEED["cuda" if weight.is_cuda else "cpu"]
    if not weight.is_cuda:
        flops *= torch.get_num_threads()
    params = sum(p.numel() for p in model.layers[0].parameters())
    row_seconds = 2 * params / flops
    return (overhead + params * weight.element_size() / bandwidth) / row_seconds


def activation_patch(
    model,
    clean,
    corrupted,
    metric: Metric,
    value: str = "layer_input",
    over: Sequence[str] | None = None,
    *,
    direction: str = "denoising",
    select: dict[str, Sequence[int]] | None = None,
    batch_size: int | None = None,
    memory_budget: int | None = None,
    progress: bool | None = None,
    position_labels: Sequence[str] | None = None,
    attention_mask: Int[Tensor, "batch seq"] | None = None,
) -> PatchingResult:
    """Patch `value` at every location of the sweep and return the metric after each patch.

    clean, corrupted: token tensors [batch seq] of one shape (or text). metric: logits -> a scalar.
    value: a standard value name, a TransformerLens short name, or one hook's name.
    over: the value's dimensions to index (default: positions for the residual stream, heads for
      attention values, neurons for MLP values); the layer axis always comes first.
    select: restrict axes to some indices, e.g. {"layer": [3, 4], "seq": [9]}.
    batch_size: patched copies per forward (default: as many as `memory_budget` bytes allow).
    memory_budget: bytes the patched forwards may take, by `row_bytes`'s estimate of a copy (default:
      half the device's free memory, `hooked_models.devices.free_memory`).
    progress: a tqdm bar (default: when stderr is a terminal and the sweep takes several forwards).
    attention_mask: 1 for real tokens, 0 for padding [batch seq], shared by clean and corrupted.

    Each patched run computes only what the patch can change: the layers from the patch's on, the
    positions from the first one it writes something new at on, reading the earlier positions'
    keys and values and the metric's logits there from the unpatched run. The metric still gets
    logits for every position. The result equals one full forward per patch to float32 rounding.
    """
    base, source = _runs(model, clean, corrupted, direction)
    attention_mask = _checked_attention_mask(attention_mask, base)
    for name, number in (("batch_size", batch_size), ("memory_budget", memory_budget)):
        if number is not None and (isinstance(number, bool) or not isinstance(number, int) or number < 1):
            raise ValueError(f"{name}={number!r} must be a positive integer")
    sites = find_sites(model, value)
    names = [s.name for s in sites]
    streams = _streams(model)
    keys_values = _keys_values(model)
    fired: list[str] = []
    with torch.no_grad():
        source_logits, cache = model.run_with_cache(source, names_filter=names, attention_mask=attention_mask)
        # The unpatched run: its values at the sites, the residual stream entering each layer and the
        # final norm, each layer's keys and values, and the order the sites come in among the layers.
        marks = [(n, lambda a, hook: fired.append(hook.name)) for n in dict.fromkeys(names + streams[:-1])]
        read = names + streams + [n for _, keys, values in keys_values for n in (keys, values)]
        with model.hooks(fwd_hooks=marks):
            base_logits, base_cache = model.run_with_cache(base, names_filter=read, attention_mask=attention_mask)
    grid, patches = _plan_from_cache(model, sites, cache, over, select, position_labels)
    base_metric = _scalar(metric(base_logits))
    # A patch that writes what is already there changes nothing (positions before the prompts' first
    # difference, say): its metric is the unpatched one, and it needs no forward.
    jobs = _jobs(patches, sites, cache, base_cache, _stages(sites, fired, streams))
    budget = memory_budget or free_memory(base.device) // 2
    capacity = (lambda start: batch_size) if batch_size else (
        lambda start: max(1, budget // row_bytes(model, base, start)))
    chunks = _chunks(jobs, *base.shape, len(streams) - 1, capacity, layer_call_rows(model))
    show = sys.stderr.isatty() and len(chunks) > 1 if progress is None else progress
    results = base_metric.repeat(len(patches))
    base_run = _BaseRun(base, attention_mask, base_cache, streams, keys_values)
    values = {s.name: s.value for s in sites}
    with torch.no_grad(), tqdm(total=len(patches), disable=not show, desc=f"patching {value}",
                               unit="patch") as bar:
        bar.update(len(patches) - len(jobs))
        for chunk in chunks:
            chunk = sorted(chunk, key=lambda job: job.stage)
            start = min(job.start for job in chunk)
            logits = _run_chunk(model, chunk, start, base_run, cache, values)
            for job, copy in zip(chunk, logits.unflatten(0, (len(chunk), -1))):
                if start:  # positions before the window: the unpatched run's logits (a patch cannot reach back)
                    copy = torch.cat([base_logits[:, :start].to(copy.device), copy], 1)
                results[job.row] = _scalar(metric(copy))
            bar.update(len(chunk))
    return _result(results, grid, value, direction, float(base_metric), float(_scalar(metric(source_logits))))


def _checked_attention_mask(attention_mask: Tensor | None, tokens: Tensor) -> Tensor | None:
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor) or tuple(attention_mask.shape) != tuple(tokens.shape):
        got = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask has shape {got}, but the prompts are {tuple(tokens.shape)}")
    return attention_mask.to(device=tokens.device, dtype=torch.long)


def _plan_from_cache(model, sites: list[Site], cache, over, select, position_labels):
    """`plan` over the sizes the sites' values have in `cache` (the source run's)."""
    sizes = [dict(zip(s.value.dims[1:], cache[s.name].shape[1:])) for s in sites]
    return plan(model, sites, over, select, sizes, position_labels)


def _result(values: Tensor, grid, value: str, direction: str, base_metric: float, source_metric: float,
            **fields) -> PatchingResult:
    """The labelled result; the unpatched runs' metrics named by the direction (denoising patches
    the corrupted run with the clean one's values, noising the other way)."""
    clean_metric, corrupted_metric = ((source_metric, base_metric) if direction == "denoising"
                                      else (base_metric, source_metric))
    return PatchingResult(values=values.reshape(grid.shape).cpu(), axes=tuple(grid.axes), labels=grid.labels,
                          value=value, direction=direction, clean_metric=clean_metric,
                          corrupted_metric=corrupted_metric, **fields)


# ------------------------------------------------------------------------- running what a patch changes
# A patched run has stages: -1, the embedding (from the tokens); k, layer k; L, the final norm and head.
# A patch enters at the stage of its site and changes nothing before it, nor any position before
# the first one it writes something new at.


@dataclass(frozen=True)
class _Job:
    """A patch to run: its row in the result, the stage it enters at, the first position it changes."""

    row: int
    patch: Patch
    stage: int
    start: int


@dataclass(frozen=True)
class _BaseRun:
    """What the patched runs read from the unpatched one: its tokens and mask, and its cache holding
    the residual stream entering each stage (`streams`) and each layer's keys and values."""

    tokens: Tensor
    attention_mask: Tensor | None
    cache: object
    streams: list[str]
    keys_values: list[tuple[nn.Module, str, str]]


def _streams(model) -> list[str]:
    """The residual stream entering each layer, then the final norm: L + 1 hook names."""
    inputs = sorted(find_sites(model, "layer_input"), key=lambda s: s.layer)
    last = max(find_sites(model, "layer_output"), key=lambda s: s.layer)
    return [s.name for s in inputs] + [last.name]


def _keys_values(model) -> list[tuple[nn.Module, str, str]]:
    """Per layer, (its attention module, the hook names of its keys and its values)."""
    keys = sorted(find_sites(model, "attention_keys"), key=lambda s: s.layer)
    values = sorted(find_sites(model, "attention_values"), key=lambda s: s.layer)
    return [(model.get_submodule(k.name.rpartition(".")[0]), k.name, v.name) for k, v in zip(keys, values)]


def _stages(sites: list[Site], fired: list[str], streams: list[str]) -> dict[str, int]:
    """Per site, the stage its patches enter at: a layer's own sites, that layer; a model-level site,
    before the layers (-1) or after them (L), by where it fired among the layers' inputs."""
    num_layers = len(streams) - 1
    stages = {}
    for site in sites:
        if site.layer is not None:
            stages[site.name] = site.layer
            continue
        before = sum(1 for name in fired[:fired.index(site.name)] if name in streams) if site.name in fired else 0
        if before not in (0, num_layers):
            raise ValueError(f"{site.name} is computed between layers {before - 1} and {before}, where no "
                             "partial run can start")
        stages[site.name] = -1 if before == 0 else num_layers
    return stages


def _jobs(patches: list[Patch], sites: list[Site], cache, base_cache, stages: dict[str, int]) -> list[_Job]:
    """The patches that change something, with where they start, sorted by (start, stage)."""
    rows: dict[str, list[int]] = {}
    for row, patch in enumerate(patches):
        rows.setdefault(patch.site, []).append(row)
    values = {s.name: s.value for s in sites}
    jobs = []
    for site, site_rows in rows.items():
        starts = _first_changes(cache[site], base_cache[site], values[site], [patches[r].index for r in site_rows])
        jobs += [_Job(r, patches[r], stages[site], s) for r, s in zip(site_rows, starts) if s is not None]
    return sorted(jobs, key=lambda job: (job.start, job.stage, job.row))


def _first_changes(source: Tensor, base: Tensor, value: Value, indices: list[tuple]) -> list[int | None]:
    """Per patch (its index into `value`'s dimensions), the first position at which it writes
    something the unpatched run does not have there (0 for a value without positions), or None where
    it writes nothing new."""
    dims = value.dims[1:]
    position = None if value.seq_axis is None else len(dims) + value.seq_axis
    indexed = {d for index in indices for d, selector in enumerate(index) if selector is not None}
    keep = sorted(indexed | ({position} if position is not None else set()))
    # Where the two runs differ in any prompt, reduced over the dimensions no patch indexes.
    differs = (source != base).any(0)
    dropped = tuple(d for d in range(len(dims)) if d not in keep)
    if dropped:
        differs = differs.any(dim=dropped)
    table = differs.cpu().numpy()
    axis = keep.index(position) if position is not None else None
    starts = []
    for index in indices:
        picks = [np.arange(table.shape[k]) if index[d] is None else np.atleast_1d(np.asarray(index[d]))
                 for k, d in enumerate(keep)]
        region = table[np.ix_(*picks)] if picks else table
        if axis is None:
            starts.append(0 if region.any() else None)
            continue
        changed = region.any(axis=tuple(a for a in range(region.ndim) if a != axis))
        starts.append(int(picks[axis][changed].min()) if changed.any() else None)
    return starts


def _chunks(jobs: list[_Job], batch: int, seq: int, num_layers: int, capacity: Callable[[int], int],
            call_rows: float) -> list[list[_Job]]:
    """The forwards: groups of jobs (sorted by start) run together from their earliest start.

    Jobs of one start share a forward at no extra cost, each joining the batch at its own stage, up
    to `capacity(start)` copies. Adding the next start's jobs to a forward makes them run the
    positions between the two starts for nothing; it is done when that costs less than a forward of
    their own, counted in rows through a layer, `call_rows` for each layer a forward runs.
    """
    def cost(chunk: list[_Job]) -> float | int:
        window = seq - min(job.start for job in chunk)
        joined = sorted(job.stage for job in chunk)
        return sum(call_rows + batch * window * bisect_right(joined, stage)
                   for stage in range(joined[0], num_layers + 1))

    chunks, current = [], []
    for _, group in groupby(jobs, key=lambda job: job.start):
        group = list(group)
        if current:
            merged = current + group
            if len(merged) <= capacity(current[0].start) and cost(merged) <= cost(current) + cost(group):
                current = merged
                continue
            chunks.append(current)
        size = capacity(group[0].start)
        pieces = [group[i:i + size] for i in range(0, len(group), size)]
        chunks += pieces[:-1]
        current = pieces[-1]
    return chunks + [current] if current else chunks


def _run_chunk(model, jobs: list[_Job], start: int, base: _BaseRun, source_cache, values: dict[str, Value]) -> Tensor:
    """Logits [copies·batch seq-start vocab_size] of the patched copies, `jobs` sorted by stage.

    The batch grows as it goes: the copies patched at a stage join it there, their input the
    unpatched run's residual stream entering that stage; layers between two such stages run in one
    forward. Positions before `start` are read from a key/value cache of the unpatched run's.
    """
    tokens, mask = base.tokens, base.attention_mask
    batch, seq = tokens.shape
    num_layers = len(base.streams) - 1
    joins = sorted({job.stage for job in jobs})
    x, count = None, 0
    for i, stage in enumerate(joins):
        stop = joins[i + 1] if i + 1 < len(joins) else None
        joiners = [job for job in jobs if job.stage == stage]
        count += len(joiners)
        window_mask = None if mask is None else mask[:, start:].repeat(count, 1)
        cache = None
        if start:
            prefix = mask[:, :start] if mask is not None else torch.ones(batch, start, dtype=torch.long,
                                                                          device=tokens.device)
            layers = range(max(stage, 0), num_layers if stop is None else stop)
            cache = KeyValueCache.prefilled(prefix.repeat(count, 1), {
                base.keys_values[layer][0]: tuple(base.cache[name][:, :, :start].repeat(count, 1, 1, 1)
                                                  for name in base.keys_values[layer][1:])
                for layer in layers
            }, room=seq - start)
        hooks = _patch_hooks(jobs[:count], stage, source_cache, values, start)
        with model.hooks(fwd_hooks=hooks):
            if stage < 0:
                x = model(tokens[:, start:].repeat(count, 1), attention_mask=window_mask, stop_at_layer=stop,
                          past_kv_cache=cache)
            else:
                fresh = base.cache[base.streams[stage]][:, start:].repeat(len(joiners), 1, 1)
                x = fresh if x is None else torch.cat([x.to(fresh.device), fresh])
                x = model(x, start_at_layer=stage, stop_at_layer=stop, attention_mask=window_mask,
                          past_kv_cache=cache)
    return x


def _patch_hooks(batch_jobs: list[_Job], stage: int, source_cache, values: dict[str, Value],
                 start: int) -> list[tuple[str, Callable]]:
    """A hook per site patched at `stage`, writing each of its jobs' copies among the `batch_jobs` copies."""
    hooks = []
    for site in dict.fromkeys(job.patch.site for job in batch_jobs if job.stage == stage):
        value = values[site]
        source = _window(source_cache[site], value, start)
        indices = [_shifted(job.patch.index, value, start) if job.stage == stage and job.patch.site == site
                   else None for job in batch_jobs]
        mask = _mask(indices, tuple(source.shape[1:]), source.device)
        hooks.append((site, partial(_write_patches, mask=mask, source=source)))
    return hooks


def _window(tensor: Tensor, value: Value, start: int) -> Tensor:
    """`tensor` from position `start` on, along the value's position axis."""
    if not start or value.seq_axis is None:
        return tensor
    return tensor.narrow(value.seq_axis, start, tensor.shape[value.seq_axis] - start)


def _shifted(index: tuple, value: Value, start: int) -> tuple:
    """A patch's index into the window that begins at `start` (its positions before are no-ops)."""
    if not start or value.seq_axis is None:
        return index
    position = len(index) + value.seq_axis
    selector = index[position]
    if isinstance(selector, tuple):
        selector = tuple(p - start for p in selector if p >= start)
    elif selector is not None:
        selector -= start
    return (*index[:position], selector, *index[position + 1:])


def attribution_patch(
    model,
    clean,
    corrupted,
    metric: Metric,
    value: str = "layer_input",
    over: Sequence[str] | None = None,
    *,
    direction: str = "denoising",
    select: dict[str, Sequence[int]] | None = None,
    position_labels: Sequence[str] | None = None,
) -> PatchingResult:
    """The first-order estimate of `activation_patch`'s result, from one forward and one backward.

    For each patch: metric(base) + Σ over the patched elements (and prompts) of
    ∂metric/∂activation · (source − base), with the gradient taken on the unpatched run the patches
    would be written into. Exact where the metric is linear in the patched value; an estimate
    elsewhere that degrades as the patch grows (Nanda 2023; Syed et al. 2023, "AtP").
    """
    base, source = _runs(model, clean, corrupted, direction)
    sites = find_sites(model, value)
    names = [s.name for s in sites]
    with torch.no_grad():
        source_logits, cache = model.run_with_cache(source, names_filter=names)
    seen: dict[str, Tensor] = {}

    def keep(activation: Tensor, hook) -> None:
        seen[hook.name] = activation

    def leaf(activation: Tensor, hook) -> Tensor | None:
        # With frozen parameters nothing would require grad: start the graph at the embeddings.
        return None if activation.requires_grad else activation.detach().requires_grad_(True)

    hooks = [(n, keep) for n in names]
    if "token_embeddings" in model.hook_dict:
        hooks.insert(0, ("token_embeddings", leaf))
    with torch.enable_grad(), model.hooks(fwd_hooks=hooks):
        base_logits = model(base)
        base_metric = metric(base_logits)
        grads = torch.autograd.grad(base_metric, [seen[n] for n in names], allow_unused=True)
    # Per site, grad · (source − base) summed over prompts: what each element would add.
    contributions = {}
    for name, grad in zip(names, grads):
        delta = (cache[name] - seen[name].detach()).float()
        contributions[name] = torch.zeros_like(delta[0]) if grad is None else (grad.float() * delta).sum(0)
    grid, patches = _plan_from_cache(model, sites, cache, over, select, position_labels)
    estimates = torch.stack([_attribution(contributions[p.site], p.index) for p in patches])
    base_metric = float(_scalar(base_metric))
    return _result(base_metric + estimates.cpu(), grid, value, direction, base_metric,
                   float(_scalar(metric(source_logits))), method="attribution patching")


def _attribution(contribution: Tensor, index: tuple) -> Tensor:
    """The sum of a site's contributions over the elements one patch overwrites."""
    for d, selector in reversed(list(enumerate(index))):
        if selector is None:
            contribution = contribution.sum(d)
        else:
            picked = list(selector) if isinstance(selector, tuple) else [selector]
            contribution = contribution.index_select(d, torch.tensor(picked, device=contribution.device)).sum(d)
    return contribution


# Named sweeps: the common questions, each one value over its usual axes.
def patch_residual_stream(model, clean, corrupted, metric, value: str = "layer_input", **options) -> PatchingResult:
    """The residual stream entering each layer, by layer × position (TransformerLens's resid_pre sweep)."""
    return activation_patch(model, clean, corrupted, metric, value, ("layer", "seq"), **options)


def patch_attention_heads(model, clean, corrupted, metric, value: str = "attention_head_outputs",
                          **options) -> PatchingResult:
    """Each head's output (or queries, pattern, ...: pass `value`), by layer × head, all positions."""
    return activation_patch(model, clean, corrupted, metric, value, ("layer", "head"), **options)


def patch_kv_heads(model, clean, corrupted, metric, value: str = "attention_keys", **options) -> PatchingResult:
    """Keys or values by layer × key/value head: under GQA one patch reaches every query head of its group."""
    return activation_patch(model, clean, corrupted, metric, value, ("layer", "num_kv_heads"), **options)


def patch_mlp_outputs(model, clean, corrupted, metric, value: str = "mlp_output", **options) -> PatchingResult:
    """What each MLP adds to the residual stream, by layer × position."""
    return activation_patch(model, clean, corrupted, metric, value, ("layer", "seq"), **options)


def patch_neurons(model, clean, corrupted, metric, value: str = "mlp_neurons", **options) -> PatchingResult:
    """Single MLP neurons, by layer × neuron, at every position (restrict with select={"layer": [...]})."""
    return activation_patch(model, clean, corrupted, metric, value, ("layer", "neuron"), **options)
