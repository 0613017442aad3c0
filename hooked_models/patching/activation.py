"""`activation_patch`: every patch of a sweep run exactly, batched to a memory budget."""

from collections.abc import Sequence

import torch
from jaxtyping import Int
from torch import Tensor

from hooked_models.devices import free_memory
from hooked_models.patching.inputs import Metric, _checked_attention_mask, _runs, _scalar
from hooked_models.patching.result import PatchingResult, _result
from hooked_models.patching.runner import (
    _BaseRun,
    _chunks,
    _jobs,
    _keys_values,
    _run_chunk,
    _stages,
    _streams,
    layer_call_rows,
    row_bytes,
)
from hooked_models.patching.sites import _plan_from_cache, find_sites
from hooked_models.progress import ProgressArg, tracker


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
    progress: ProgressArg = None,
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
    progress: False, True (a tqdm bar), None (a bar when stderr is a terminal and the sweep takes several
      forwards), or a callable handed a `hooked_models.progress.Step` in patches after each forward; it
      may raise `Cancelled` to stop there (the model is left as it was).
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
    results = base_metric.repeat(len(patches))
    base_run = _BaseRun(base, attention_mask, base_cache, streams, keys_values)
    values = {s.name: s.value for s in sites}
    with torch.no_grad(), tracker(progress, total=len(patches), desc=f"patching {value}", unit="patch",
                                  long=len(chunks) > 1) as steps:
        steps.advance(len(patches) - len(jobs))  # the patches that change nothing are done
        for chunk in chunks:
            chunk = sorted(chunk, key=lambda job: job.stage)
            start = min(job.start for job in chunk)
            logits = _run_chunk(model, chunk, start, base_run, cache, values)
            for job, copy in zip(chunk, logits.unflatten(0, (len(chunk), -1))):
                if start:  # positions before the window: the unpatched run's logits (a patch cannot reach back)
                    copy = torch.cat([base_logits[:, :start].to(copy.device), copy], 1)
                results[job.row] = _scalar(metric(copy))
            steps.advance(len(chunk))
    return _result(results, grid, value, direction, float(base_metric), float(_scalar(metric(source_logits))))
