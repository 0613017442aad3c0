"""Where a sweep patches: the hook points carrying a value, the sweep's axes, and its patches in grid order."""

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import product

import torch

from hooked_models.hooks import ValueHook
from hooked_models.vocabulary import POSITION_DIMS, Value, nearest_values


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


def _plan_from_cache(model, sites: list[Site], cache, over, select, position_labels):
    """`plan` over the sizes the sites' values have in `cache` (the source run's)."""
    sizes = [dict(zip(s.value.dims[1:], cache[s.name].shape[1:])) for s in sites]
    return plan(model, sites, over, select, sizes, position_labels)
