"""The batched runner: which patches share a forward, and a forward that computes only what its patches change.

Many patches share a forward: each is a copy of the prompts along the batch with its own patch (a
`torch.where` against a per-copy mask), copies join the batch at their own layer, and the forwards are
sized to a memory budget.
"""

from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from itertools import groupby

import numpy as np
import torch
import torch.nn as nn
from torch import Tensor

from hooked_models.components.kv_cache import KeyValueCache
from hooked_models.patching.sites import Patch, Site, find_sites
from hooked_models.vocabulary import Value


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
