"""Edge patching: each chosen reader's input gets its chosen writers' corrupted outputs, batched by edge set;
path patching on top of it."""

import difflib
import fnmatch
from collections.abc import Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from hooked_models.circuits.layout import _check_runs, _Layout, _slots, _stream_bytes, _writer_outputs
from hooked_models.patching.inputs import Metric, _scalar
from hooked_models.patching.runner import row_bytes
from hooked_models.progress import ProgressArg, tracker


def edge_patch(
    model,
    clean,
    corrupted,
    metric: Metric,
    edge_sets: Sequence,
    *,
    batch_size: int | None = None,
    memory_budget: int = 2**30,
    progress: ProgressArg = None,
) -> Float[Tensor, " sets"]:
    """The metric with the edges of each set patched: the ground truth the estimates are judged against.

    In the clean run, each edge's reader gets its writer's corrupted output in place of the writer's output
    in this run; every other reader reads what it would (module docstring). One value per set, batched:
    `batch_size` sets per forward (default: as many as `memory_budget` bytes allow). `[[e] for e in
    graph(model).edges]` patches every edge alone; `[[]]` is the clean run. [len(edge_sets)]
    `progress`: False, True (a tqdm bar), None (a bar on a terminal when it takes several forwards), or a
    callable handed a `hooked_models.progress.Step` in sets after each forward (raising `Cancelled` stops it).
    """
    layout = _Layout(model)
    values, _, _ = _edge_patch(model, clean, corrupted, metric, edge_sets, layout, batch_size=batch_size,
                               memory_budget=memory_budget, progress=progress)
    return values


def _edge_patch(model, clean, corrupted, metric, edge_sets, layout: _Layout, batch_size=None,
                memory_budget=2**30, progress=None) -> tuple[Tensor, float, float]:
    """`edge_patch`'s values, and the clean and corrupted runs' metrics."""
    clean, corrupted = _check_runs(model, clean, corrupted)
    name = type(model).__name__

    def is_set(s) -> bool:  # an edge itself, ("input", "logits"), is a common slip for [("input", "logits")]
        return isinstance(s, (list, tuple, set, frozenset)) and not any(isinstance(e, str) for e in s)

    if isinstance(edge_sets, (str, tuple)) or not all(is_set(s) for s in edge_sets):
        raise ValueError("edge_sets is a list of edge sets, each a list of (writer, reader) pairs: [[edge], ...]")
    sets = [[layout.check(e, name) for e in s] for s in edge_sets]
    batch, seq = clean.shape
    device = clean.device
    corrupted_logits, corrupted_out = _writer_outputs(model, corrupted, layout)
    with torch.no_grad():
        clean_metric = _scalar(metric(model(clean)))
    endpoints = (float(clean_metric), float(_scalar(metric(corrupted_logits))))
    results = clean_metric.repeat(len(sets))
    # One mask over (writer node, reader node) per set.
    masks = torch.zeros(len(sets), len(layout.writers), len(layout.readers), dtype=torch.bool)
    for n, edges in enumerate(sets):
        for w, r in edges:
            masks[n, layout.writer_index[w], layout.reader_index[r]] = True
    todo = [n for n in range(len(sets)) if masks[n].any()]  # an empty set is the clean run
    writer_nodes = [h.nodes_at(seq) for h in layout.writer_hooks]
    slots = sum(n.shape[0] for n in writer_nodes)
    # A patched copy of the prompts holds a forward's activations, every writer's delta, and the split inputs.
    per_set = row_bytes(model, clean) + _stream_bytes(model, clean) * (slots + 6 * model.cfg.n_heads)
    per_forward = batch_size or max(1, memory_budget // per_set)
    with torch.no_grad(), tracker(progress, total=len(todo), desc="edge patching", unit="set",
                                  long=len(todo) > per_forward) as steps:
        for start in range(0, len(todo), per_forward):
            rows = todo[start:start + per_forward]
            chunk = masks[rows].to(device)
            hooks = _edge_patch_hooks(layout, chunk, corrupted_out, writer_nodes, batch, seq, device)
            with model.hooks(fwd_hooks=hooks):
                logits = model(clean.repeat(len(rows), 1))
            for row, copy in zip(rows, logits.unflatten(0, (len(rows), -1))):
                results[row] = _scalar(metric(copy))
            steps.advance(len(rows))
    return (results.cpu(), *endpoints)


def _edge_patch_hooks(layout: _Layout, masks: Tensor, corrupted_out: dict, writer_nodes: list[Tensor],
                      batch: int, seq: int, device) -> list:
    """Hooks for one chunk of sets: writers record (corrupted - live) per slot; each reader whose edges some
    set patches adds the sum over its chosen writers."""
    copies = masks.shape[0]
    deltas: list[Tensor] = []  # per writer hook in forward order: [copies batch seq slots hidden_size]
    last = max((h.step for h in layout.reader_hooks if masks[:, :, _flat(h.nodes)].any()), default=-1)
    hooks = []
    for writer in layout.writer_hooks:
        if writer.step >= last:
            break

        def record(value, hook, h=writer):
            live = _slots(value, h).unflatten(0, (copies, batch))
            deltas.append(_slots(corrupted_out[h.name], h).to(live.dtype) - live)

        hooks.append((writer.name, record))
    for reader in layout.reader_hooks:
        reader_nodes = reader.nodes_at(seq, device)
        available = [i for i, w in enumerate(layout.writer_hooks) if w.step < reader.step]
        w_nodes = torch.cat([writer_nodes[i] for i in available]).to(device)  # [writer_slots seq]
        # [copies writer_slots reader_slots seq]: whether each set patches that slot pair at that position.
        chosen = masks[:, w_nodes[:, None, :], reader_nodes[None, :, :]]
        if not chosen.any():
            continue

        def patch(value, hook, h=reader, chosen=chosen, count=len(available)):
            delta = torch.cat(deltas[:count], dim=-2)  # [copies batch seq writer_slots hidden_size]
            moved = torch.einsum("nbswd,nwrs->nbsrd", delta, chosen.to(delta.dtype))
            shaped = _slots(value, h).unflatten(0, (copies, batch))
            out = (shaped + moved).flatten(0, 1)
            return out if h.head_axis else out.squeeze(-2)

        hooks.append((reader.name, patch))
    return hooks


def _flat(nodes: list) -> list[int]:
    return [i for n in nodes for i in (n if isinstance(n, list) else [n])]


def path_patch(model, clean, corrupted, metric: Metric, senders, receivers, **options) -> Tensor:
    """Path patching as in the IOI paper (Wang et al. 2022): the senders' corrupted outputs reach only the
    receivers' inputs, directly through the residual stream; everything else stays at the clean run (no
    other component sees the senders' change, so no path through another head or an MLP counts).

    `senders`: writer names or glob patterns ("layers.0.self_attn.head.*"); a string is one group patched
    together, a list gives one result per entry (each entry a name, a pattern, or a list of them).
    `receivers`: reader names or patterns ("layers.1.self_attn.head.*.q", "logits"). A pair whose reader
    reads before the sender writes carries nothing. Returns the metric per sender entry (a scalar for a
    string). Options go to `edge_patch`.
    """
    layout = _Layout(model)
    groups = [senders] if isinstance(senders, str) else list(senders)
    readers = _match(receivers, layout.readers, "receiver")
    sets = []
    for group in groups:
        writers = _match(group, layout.writers, "sender")
        sets.append([(w, r) for w in writers for r in readers if (w, r) in layout.edge_index])
    values = edge_patch(model, clean, corrupted, metric, sets, **options)
    return values[0] if isinstance(senders, str) else values


def _match(patterns, names: list[str], role: str) -> list[str]:
    """The names that a name, a glob pattern, or a list of them match, in the model's order."""
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    chosen = set()
    for pattern in patterns:
        found = fnmatch.filter(names, pattern)
        if not found:
            close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise ValueError(f"no {role} node matches {pattern!r}{hint}")
        chosen.update(found)
    return [n for n in names if n in chosen]
