"""The attention half of a graph: per-head loadings and QK attributions, both read from one forward
decomposition of the kept sources (hooked_models/attribution/decomposition.py).

For the edges asked (the pruned graph's by default): one backward pass per `batch_size` kept targets
gives their gradients at every layer's head outputs; then one batched forward per `batch_size` kept
sources gives each source's contribution to every layer's head outputs (read by the loadings) and
queries and keys (read by the QK attributions). Nothing grows as layers x heads passes, and nothing is
held per node pair but the kept edges.
"""

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from jaxtyping import Int
from torch import Tensor

from hooked_models.attribution.decomposition import Component, decompose
from hooked_models.attribution.graph import AttributionGraph
from hooked_models.attribution.heads import HeadLoadings, target_gradients
from hooked_models.attribution.qk import QKReader
from hooked_models.attribution.replacement import Prompt, freezing_hooks
from hooked_models.attribution.targets import Target
from hooked_models.progress import Tracker


def split_attention(prompt: Prompt, head_gradients: Callable[[list[Target]], list[Tensor]], graph: AttributionGraph,
                    edges: Int[Tensor, "edge 2"],
                    kept: Tensor, target_of: Callable[[int], Target], feature_rows: Tensor,
                    qk: int | Sequence[tuple[int, int, int, int]], batch_size: int,
                    track: Tracker) -> AttributionGraph:
    """`graph` with the loadings of `edges` ([edge 2]: target, source node) and the QK attributions of
    `qk` entries (a number of them, chosen by flow, or a list), over the components that `kept` (a node
    mask) and the edges' sources name. `head_gradients(targets)`: their gradients at each layer's head
    outputs, [batch seq head head_dim] per layer (targets ordered by layer); `target_of(node)`: a target
    node's input direction;
    `feature_rows`: each feature node's row among the prompt's active features."""
    model = prompt.model
    edges = edges.long().reshape(-1, 2)
    if not len(edges):  # nothing kept through attention: empty loadings, no QK table
        n_layers, n_heads = model.cfg.num_layers, model.cfg.n_heads
        return replace(graph, loading_edges=edges, loading_heads=torch.zeros(0, n_layers, n_heads),
                       loading_skips=torch.zeros(0, n_layers), qk_tables={})
    targets, target_index = edges[:, 0].unique(return_inverse=True)
    # The components: every source of an edge asked and every kept node that writes (for the QK tables).
    writers = torch.cat([edges[:, 1], kept[:graph.logit_start].nonzero().flatten()]).unique()
    component_of = torch.full((graph.n_nodes,), -1, dtype=torch.long)
    component_of[writers] = torch.arange(len(writers))
    components = [_component(graph, int(node), feature_rows) for node in writers]

    track.reset(len(targets), "gradients")
    gradients = target_gradients(lambda a, b: head_gradients([target_of(int(t)) for t in targets[a:b]]),
                                 len(targets), batch_size, track.advance)
    cfg = model.cfg
    attention = [model.layers[layer].self_attn for layer in range(cfg.num_layers)]
    groups = cfg.n_heads // attention[0].num_kv_heads
    loadings = HeadLoadings(torch.stack([target_index, component_of[edges[:, 1]]], 1), gradients, cfg.n_heads)
    entries, flows = _entries(prompt, gradients, groups, qk)
    reader = QKReader(entries, len(components), groups, attention[0].head_dim) if entries else None

    track.reset(len(components), "decomposition")
    reads = loadings.reads() + (reader.reads() if reader else [])
    for chunk in decompose(prompt, components, reads, batch_size, others=reader is not None,
                           on_chunk=track.advance):
        loadings.read(chunk.start, chunk.values)
        if reader:
            reader.read(chunk.start, chunk.values, chunk.bias, chunk.others)
    weights = graph.adjacency_matrix[edges[:, 0], edges[:, 1]]
    tables = {}
    if reader:
        names = [graph.node_name(int(node)) for node in writers]
        scales = [float(a.scale) for a in attention]
        caps = [float(getattr(a.score_mod, "cap", 0.0) or 0.0) for a in attention]
        for table in reader.tables(names, scales, caps, _model_scores(prompt, entries), flows):
            tables[(table.layer, table.head, table.query_pos, table.key_pos)] = table
    return replace(graph, loading_edges=edges, loading_heads=loadings.values, loading_skips=loadings.skips(weights),
                   qk_tables=tables)


def _component(graph: AttributionGraph, node: int, feature_rows: Tensor) -> Component:
    kind = graph.node_kind(node)
    layer, pos = graph.node_position(node)
    if kind == "feature":
        return Component("feature", layer, pos, int(feature_rows[node]))
    return Component(kind, layer, pos)


def _entries(prompt: Prompt, gradients: list[Tensor], groups: int, qk) -> tuple[list[tuple], list[float]]:
    """The QK entries asked, or the `qk` strongest by flow: |pattern[h, q, k] x (gradient at q, head h) .
    (value at k)| summed over the kept targets, the share of the targets' inputs carried through that
    entry by the clean values."""
    n_layers = len(gradients)
    flow = []
    for layer in range(n_layers):
        pattern = prompt.constants[f"layers.{layer}.self_attn.attention_probabilities"][0].float()
        values = prompt.values[layer].float().repeat_interleave(groups, 0)  # [head seq head_dim]
        g = gradients[layer]  # [head target (seq head_dim)]
        total = torch.zeros_like(pattern)
        for start in range(0, g.shape[1], 64):  # a block of targets at a time: no [target head seq seq] whole
            block = g[:, start:start + 64].float().unflatten(-1, (values.shape[1], values.shape[2]))
            total += (torch.einsum("htqd,hkd->thqk", block, values) * pattern).abs().sum(0)
        flow.append(total)
    flow = torch.stack(flow)  # [layer head query key]
    if isinstance(qk, int):
        order = flow.flatten().argsort(descending=True)[:qk]
        entries = [tuple(int(i) for i in torch.unravel_index(i, flow.shape)) for i in order if flow.flatten()[i] > 0]
    else:
        entries = [check_entry(prompt, entry) for entry in qk]
    return entries, [float(flow[entry]) for entry in entries]


def check_entry(prompt: Prompt, entry) -> tuple[int, int, int, int]:
    """A (layer, head, query_pos, key_pos) inside the model and the prompt, the key not after the query."""
    cfg, seq = prompt.model.cfg, prompt.tokens.shape[1]
    layer, head, q, k = (int(x) for x in entry)
    for name, value, limit in (("layer", layer, cfg.num_layers), ("head", head, cfg.n_heads),
                               ("query_pos", q, seq), ("key_pos", k, seq)):
        if not 0 <= value < limit:
            raise ValueError(f"QK entry {tuple(entry)}: {name}={value} outside [0, {limit})")
    if k > q:
        raise ValueError(f"QK entry {tuple(entry)}: key_pos={k} comes after query_pos={q}: attention is causal, "
                         f"so that entry is masked, with no score to attribute")
    return layer, head, q, k


def _model_scores(prompt: Prompt, entries: list[tuple]) -> list[float]:
    """The model's own raw scores at the entries (before any soft cap), from one frozen forward."""
    model = prompt.model

    def name(layer: int) -> str:
        raw = f"layers.{layer}.self_attn.score_mod.attention_raw_scores"
        return raw if raw in model.hook_dict else f"layers.{layer}.self_attn.attention_scores"

    wanted = {name(layer) for layer, *_ in entries}
    with torch.no_grad(), model.hooks(fwd_hooks=freezing_hooks()):
        _, cache = model.run_with_cache(prompt.tokens, names_filter=lambda n: n in wanted)
    return [float(cache[name(layer)][0, head, q, k]) for layer, head, q, k in entries]
