"""The forward decomposition of the residual stream: each node's contribution at every later layer and
position, in the linear replacement model (patterns and norm scales frozen at the prompt's, every MLP
its transcoder's skip connection plus the nodes' writes).

With those frozen, the stream entering each layer is an affine function of what the nodes write (the
embeddings; each feature's activation x decoder row; each error), so it is the sum of each node's
contribution plus a constant, the biases' (norm biases, the transcoders' b_dec, projection biases): run
the model on a batch whose row r carries node r's writes alone, and row 0 none, and node r's
contribution to any value read on the way (a layer's input, its queries, keys, values, head outputs) is
row r minus row 0. One batched forward per `batch_size` nodes, whatever the layers and heads: the
per-head loadings and the QK attributions both read it (hooked_models/attribution/attention.py).

    for chunk in decompose(prompt, components, reads=["layers.1.self_attn.attention_queries"]):
        chunk.values[name]      # [component ...]: each component's contribution (row 0's subtracted)
        chunk.bias[name]        # [...]: the constant part (every node's writes zero; prompt.held kept)
        chunk.total[name]       # [...]: every node's writes at once (the first chunk only, `with_total`)
        chunk.others[name]      # [...]: every node's but the components' (the first chunk only, `others`)
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from hooked_models.attribution.replacement import Prompt, bias_and_skip, is_frozen, written_layers


@dataclass(frozen=True)
class Component:
    """A node that writes to the stream: a feature (`index` into the prompt's active features), an
    error (`layer`, `pos`) or an embedding (`pos`)."""

    kind: str
    layer: int | None = None
    pos: int = 0
    index: int = -1


@dataclass
class Chunk:
    """One batch of components: `values[name]` [n ...] from `start` on, the `bias`, and the `total`
    (the clean frozen forward's value) and the `others`' contribution where asked."""

    start: int
    values: dict[str, Tensor]
    bias: dict[str, Tensor]
    total: dict[str, Tensor] | None = None
    others: dict[str, Tensor] | None = None


_ALL = Component("all")  # every node's writes at once: the frozen forward itself


@dataclass(frozen=True)
class _AllBut:
    """One row carrying every node's writes but those of `excluded`: the nodes not kept, as one component
    whose contribution is one row's (one rounding), not the total less every kept one's (N roundings)."""

    excluded: tuple[Component, ...]


def decompose(prompt: Prompt, components: Sequence[Component], reads: Sequence[str], batch_size: int = 32,
              with_total: bool = False, others: bool = False, on_chunk=None) -> Iterator[Chunk]:
    """Each component's contribution to every value named in `reads` (hook names), `batch_size`
    components per forward; `on_chunk(n)` is called after each with the number done (progress).
    `with_total`: the frozen forward's values too; `others`: the contribution of every node that is not
    one of `components`, from a row of its own (both in the first chunk)."""
    reads = list(reads)
    for start in range(0, max(len(components), 1), batch_size):
        chunk = list(components[start:start + batch_size])
        extra = [None]
        if start == 0:
            extra += [_ALL] * with_total + [_AllBut(tuple(components))] * others
        captured = _run(prompt, extra + chunk, reads)
        n_extra = len(extra)
        bias = {name: value[0] for name, value in captured.items()}
        values = {name: value[n_extra:] - value[:1] for name, value in captured.items()}
        total = {name: value[1] for name, value in captured.items()} if _ALL in extra else None
        rest = {name: value[n_extra - 1] - value[0] for name, value in captured.items()} if others and start == 0 \
            else None
        yield Chunk(start, values, bias, total, rest)
        if on_chunk is not None:
            on_chunk(len(chunk))


def _run(prompt: Prompt, rows: Sequence[Component | _AllBut | None], reads: list[str]) -> dict[str, Tensor]:
    """The frozen model on one row per component (None: no node writes), the `reads` captured."""
    model, tcs = prompt.model, prompt.transcoders
    n, (seq, hidden) = len(rows), prompt.embedding.shape
    dtype = prompt.embedding.dtype
    embedding = torch.zeros(n, seq, hidden, dtype=dtype, device=prompt.embedding.device)
    writes = torch.zeros(tcs.n_layers, n, seq, hidden, dtype=dtype, device=embedding.device)
    for r, c in enumerate(rows):
        if isinstance(c, _AllBut):
            embedding[r], writes[:, r] = _writes_but(prompt, c.excluded)
            continue
        if c is None or c is _ALL:
            continue
        if c.kind == "embedding":
            embedding[r, c.pos] = prompt.embedding[c.pos]
        elif c.kind == "error":
            writes[c.layer, r, c.pos] = prompt.errors[c.layer, c.pos]
        else:
            layer, pos, _ = prompt.active[c.index].tolist()
            for t in written_layers(tcs, layer):
                writes[t, r, pos] = prompt.activations[c.index] * prompt.decoder_row(c.index, t).to(dtype)
    everything = [r for r, c in enumerate(rows) if c is _ALL]
    for r in everything:
        embedding[r] = prompt.embedding
    live, captured = {}, {}

    def embed(t, hook):
        return embedding.to(t.dtype)

    def read(t, hook, layer):
        live[layer] = t

    def write(t, hook, layer):
        # (prompt.held: position 0's MLP writes where those are not nodes, a constant like the biases)
        out = writes[layer] + bias_and_skip(tcs, layer, live[layer].to(dtype)) + prompt.held[layer]
        for r in everything:  # the clean value: the prompt's own MLP output
            out[r] = prompt.mlp_out[layer].to(dtype)
        return out.to(t.dtype)

    def capture(t, hook):
        captured[hook.name] = t.detach().to(dtype)
        if len(captured) == len(reads):  # the rest of the forward would be read by nothing
            raise _AllRead

    hooks = [(is_frozen, lambda t, hook: prompt.constants[hook.name].expand(t.shape).to(t.dtype)),
             ("layers.0.layer_input", embed)]
    for l in range(tcs.n_layers):
        hooks += [(prompt.inputs[l], lambda t, hook, l=l: read(t, hook, l)),
                  (prompt.outputs[l], lambda t, hook, l=l: write(t, hook, l))]
    hooks += [(name, capture) for name in reads]
    with torch.no_grad(), _nothing_discarded(prompt):
        try:
            model.run_with_hooks(prompt.tokens.expand(n, -1), fwd_hooks=hooks, stop_at_layer=model.cfg.num_layers)
        except _AllRead:
            pass
    return {name: captured[name] for name in reads}


class _AllRead(Exception):
    """Raised by the last read's hook: the forward stops there (the hooks are removed as it unwinds)."""


def _writes_but(prompt: Prompt, excluded: Sequence[Component]) -> tuple[Tensor, Tensor]:
    """The embedding [seq hidden] and the MLP outputs' writes [layer seq hidden] of every node but
    `excluded`: the embeddings, errors and active features' decoder writes, summed in float64 and rounded
    once to the prompt's dtype."""
    dtype = prompt.embedding.dtype
    embedding, writes = prompt.embedding.double().clone(), prompt.errors.double().clone()
    keep = torch.ones(len(prompt.active), dtype=torch.bool, device=prompt.active.device)
    for c in excluded:
        if c.kind == "embedding":
            embedding[c.pos] = 0
        elif c.kind == "error":
            writes[c.layer, c.pos] = 0
        else:
            keep[c.index] = False
    for start, _, counts, decoders, where in prompt.feature_writes():
        rows = torch.arange(start, start + sum(counts), device=keep.device)
        rows = rows[keep[rows]]
        scaled = prompt.activations[rows].double()[:, None]
        for target, rows_at in decoders.items():
            at = where[rows - start].to(rows_at.device)
            writes[target].index_add_(0, prompt.active[rows, 1], scaled * rows_at.flatten(0, 1)[at].double())
    return embedding.to(dtype), writes.to(dtype)


@contextmanager
def _nothing_discarded(prompt: Prompt):
    """While the decomposition runs, nothing is computed only to be replaced, so its values are unchanged:
    each MLP whose output `write` replaces (it reads only that output's dtype) returns its output hook
    of zeros instead of multiplying its weights, and each attention layer mixes its values by the
    prompt's frozen pattern, given in advance (`fixed_pattern`), instead of computing the scores the
    frozen pattern replaced. On the 8 x 1024 Arcee the MLPs were three quarters of a chunk's forward;
    on alpha-er at its 512 positions the scores, their soft cap and softmax were 45%."""
    model, undo = prompt.model, []
    try:
        for layer, name in enumerate(prompt.outputs):
            mlp = getattr(model.layers[layer], "mlp", None)
            point = getattr(mlp, "mlp_output", None)
            if point is None or point is not model.hook_dict.get(name) or "forward" in vars(mlp):
                continue
            mlp.forward = lambda x, inputs=None, point=point: point(torch.zeros_like(x))
            undo.append(lambda mlp=mlp: delattr(mlp, "forward"))
        for layer, block in enumerate(model.layers):
            attention = getattr(block, "self_attn", None)
            pattern = prompt.constants.get(f"layers.{layer}.self_attn.attention_probabilities")
            if pattern is None or not hasattr(attention, "fixed_pattern") or attention.fixed_pattern is not None:
                continue
            attention.fixed_pattern = pattern
            undo.append(lambda attention=attention: setattr(attention, "fixed_pattern", None))
        yield
    finally:
        for step in undo:
            step()
