"""Per-head loadings, the first reader of the forward decomposition: each kept edge's weight split over
each attention layer's heads, plus the part that skips that layer.

Edge (target t, source s) through head h of layer L is the target's gradient at L's head outputs
(through every later path: one backward pass per `batch_size` targets, on the replica) dotted with
the source's contribution to those head outputs (the decomposition: its stream at L mixed by the frozen
pattern through h's values). Linear in the head outputs, so for each L the heads' parts plus the part
that skips L's attention are the edge; the skip is computed as that difference. Stored for the kept
edges only: [edge layer head], never [node node layer head].
"""

from collections.abc import Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor


def target_gradients(gradients_of, n_targets: int, batch_size: int, on_batch=None) -> list[Tensor]:
    """Each target's gradient at each layer's head outputs, per layer as [head target (seq head_dim)] (one
    matrix per head, the layout the loadings multiply in), each batch written in place: the gradients are
    held once, never beside a concatenated or permuted copy. `gradients_of(start, stop)` gives those of
    targets [start, stop), [batch seq head head_dim] per layer (`Replica.head_gradients` of their
    directions, or `LinearBackward.head_gradients`)."""
    per_layer: list[Tensor] = []
    for start in range(0, n_targets, batch_size):
        stop = min(start + batch_size, n_targets)
        grads = gradients_of(start, stop)
        if not per_layer:
            per_layer = [g.new_zeros(g.shape[2], n_targets, g.shape[1] * g.shape[3], device="cpu") for g in grads]
        for layer, g in enumerate(grads):  # g [batch seq head head_dim]
            per_layer[layer][:, start:stop] = g[:stop - start].permute(2, 0, 1, 3).flatten(2).cpu()
        del grads
        if on_batch is not None:
            on_batch(stop - start)
    return per_layer


class HeadLoadings:
    """Accumulates the kept edges' loadings as the decomposition's chunks of sources arrive.

    `edges [edge 2]`: (target, source) as rows of the gradients and indices of the decomposition's
    components; `gradients`: `target_gradients`' per-layer [head target (seq head_dim)] tensors."""

    def __init__(self, edges: Int[Tensor, "edge 2"], gradients: Sequence[Tensor], n_heads: int,
                 dtype=torch.float32):
        self.edges, self.n_layers = edges, len(gradients)
        self.gradients = gradients  # one matrix product per head and chunk
        self.values = torch.zeros(len(edges), self.n_layers, n_heads, dtype=dtype)

    def name(self, layer: int) -> str:
        return f"layers.{layer}.self_attn.attention_head_outputs"

    def reads(self) -> list[str]:
        return [self.name(layer) for layer in range(self.n_layers)]

    def read(self, start: int, values: dict[str, Tensor]) -> None:
        """One chunk of sources: `values[name]` [n seq head head_dim], components start ... start + n. Every
        (target, chunk source) pair in one product per head ([head target n], small), the kept edges read off
        it: no per-edge copy of [seq head head_dim]."""
        n = next(iter(values.values())).shape[0]
        at = ((self.edges[:, 1] >= start) & (self.edges[:, 1] < start + n)).nonzero().flatten()
        if not at.numel():
            return
        targets, sources = self.edges[at, 0], self.edges[at, 1] - start
        for layer, g in enumerate(self.gradients):
            z = values[self.name(layer)].to(g.dtype)  # [n seq head head_dim]
            z = z.permute(2, 1, 3, 0).reshape(g.shape[0], -1, n)  # [head (seq head_dim) n]
            pairs = torch.bmm(g, z)  # [head target n]
            self.values[at, layer] = pairs[:, targets, sources].T.to(self.values.dtype)

    def skips(self, weights: Float[Tensor, " edge"]) -> Float[Tensor, "edge layer"]:
        """The part of each edge that skips each layer's attention: the edge less its heads' parts."""
        return weights[:, None].to(self.values.dtype) - self.values.sum(-1)
