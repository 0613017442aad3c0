"""The backward pass of an Arcee's linear replacement model, written out: what `Replica.columns` asks of
autograd, in the products it needs and no others.

The frozen replacement model (replacement.py) is linear, and for a model of pre-norm blocks with
grouped-query attention, RMSNorms and per-layer transcoders its transpose is short: per block, from the
top, with G the gradient at the block's output [batch pos hidden_size] and c = weight / frozen scale,

    at the MLP output (a leaf):          G
    at the MLP input (the transcoder's): G @ W_skip, plus each target of this layer's direction at its position
    at the attention's output:           g_h = G + (MLP input's gradient) * c2
    at each head's mix, then its values: z = g_h @ W_O;  v_j = sum over query heads h of group j: A_h^T z_h
    at the block's input:                g_h + (v @ W_V) * c1

(c: each norm's weight over its frozen scale at the position)

and above the top block, a logit target's direction @ W_U * c_final at its position. Autograd over one
frozen forward runs every target of a batch through every layer and position of its replica; here a
target starts where it reads (a layer-l feature at block l, nothing above it), the positions are those up
to the batch's last target (causal: nothing later reaches it, and no forward of a prefix is needed), and
a target's first block, where its gradient is one position's, takes the cheaper order: its per-head
vectors (g_h[p] @ W_O_h) @ W_V_h mixed by the pattern's row p, never the [pos hidden_size] products.
Same sums as autograd's, in other orders: the rows agree to float32 rounding
(tests/hooked_models/attribution/test_linear_backward.py), not bit for bit.

`LinearBackward.refusal(model, transcoders)` says why a model or transcoder set is not of that form
(alpha-er's factored projections, a cross-layer transcoder, a hook on the model, dtypes that differ);
`attribute` then runs autograd's backward over replicas, which serves every model.
"""

from collections.abc import Callable, Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from hooked_models.attribution.replacement import Prompt, RowWriter


def refusal(model, transcoders) -> str | None:
    """Why the written-out backward does not serve this model and these transcoders (None: it does)."""
    from hooked_models.components.attention import GroupedQueryAttention
    from hooked_models.components.block import PreNormBlock
    from hooked_models.components.norms import RMSNorm
    from hooked_models.families.arcee import HookedArcee
    from hooked_models.hooks import ValueHook  # (imports TransformerLens: only when a model is given)
    from hooked_models.transcoders import TranscoderSet

    if type(model) is not HookedArcee:
        return f"{type(model).__name__} is not an Arcee model"
    if not isinstance(transcoders, TranscoderSet):
        return f"{type(transcoders).__name__} is not a per-layer TranscoderSet"
    for i, layer in enumerate(model.layers):
        if not (type(layer) is PreNormBlock and type(layer.self_attn) is GroupedQueryAttention
                and type(layer.input_layernorm) is RMSNorm and type(layer.post_attention_layernorm) is RMSNorm):
            return f"layer {i} is not a pre-norm block of grouped-query attention and RMSNorms"
        if layer.self_attn.o_proj.bias is not None or layer.self_attn.v_proj.bias is not None:
            return f"layer {i}'s attention has a bias"
    if type(model.norm) is not RMSNorm or model.lm_head.bias is not None:
        return "the final norm is not an RMSNorm or the unembedding has a bias"
    dtypes = {p.dtype for p in model.parameters()} | {transcoders.dtype}
    if dtypes != {torch.float32} and dtypes != {torch.float64}:
        return f"the model and transcoders compute in {sorted(map(str, dtypes))}, not one float32 or float64"
    if any(m.has_hooks() for m in model.modules() if isinstance(m, ValueHook)):
        return "the model carries hooks, which the written-out backward would not apply"
    return None


class LinearBackward:
    """The rows of a prompt's targets (`rows(targets, out=)`, as `target_rows` gives them) by the written-out
    backward pass (see the module docstring). Holds the prompt's frozen patterns and scales, read once."""

    def __init__(self, prompt: Prompt):
        model, tcs = prompt.model, prompt.transcoders
        self.prompt, self.model = prompt, model
        constants = prompt.constants
        self.blocks = []
        for l, layer in enumerate(model.layers):
            attn, w1, w2 = layer.self_attn, layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()
            # Each norm: its weight, and 1 / its frozen scale per position [seq 1]. The model's matrices as
            # they are (no folded copies: a copy of every skip would be layers x d_in x d_out more memory).
            inv1 = 1 / constants[f"layers.{l}.input_layernorm.norm_scale"][0]
            inv2 = 1 / constants[f"layers.{l}.post_attention_layernorm.norm_scale"][0]
            pattern = constants[f"layers.{l}.self_attn.attention_probabilities"][0]  # [head seq seq]
            skip = tcs.skip_weight(l).detach() if tcs.has_skip else None  # [d_out d_in]
            self.blocks.append((inv1, inv2, w1, w2, pattern, attn.o_proj.weight.detach(), attn.v_proj.weight.detach(),
                                skip, attn.num_kv_heads, attn.groups, attn.head_dim))
        self.final = model.norm.weight.detach() / constants["norm.norm_scale"][0]  # [seq hidden_size]
        self.unembedding = model.lm_head.weight.detach()  # [vocab hidden_size]
        self.zero_values = None if prompt.keep_position_zero else self._position_zero_values()

    def _position_zero_values(self) -> list[Tensor]:
        """Per layer, the values [kv_head head_dim] that position 0's embedding makes there, forward through
        position 0's own blocks (it attends to itself alone; its MLP outputs are constants of the prompt but
        for the skip): where position 0's features and errors are not nodes, its embedding is the one node
        there, and a target's edge from it is its gradient at each layer's values at position 0 dotted with
        these, so position 0 is never carried through the position-by-position products."""
        x, values = self.prompt.embedding[0].to(self.final.dtype), []
        with torch.no_grad():
            for inv1, inv2, w1, w2, pattern, w_o, w_v, skip, kv, groups, head_dim in self.blocks:
                v = ((x * w1) @ w_v.T) * inv1[0]
                values.append(v.view(kv, head_dim))
                mixed = (pattern[:, 0, 0].view(kv, groups, 1) * v.view(kv, 1, head_dim)).flatten()
                h = x + mixed @ w_o.T
                x = h if skip is None else h + (h * w2 * inv2[0]) @ skip.T
            return values

    def rows(self, targets: Sequence, out: Tensor | None = None) -> Float[Tensor, "target source"]:
        """The targets' rows (each a `targets.Target`): features, errors, embeddings; into `out` where given.
        The targets must be ordered by layer (the logits' last), as `attribute`'s chunks are."""
        tops = self._tops(targets)
        n = max(t.pos for t in targets) + 1
        # Position 0 left out of the products where its embedding is its one node and no target reads it.
        first = int(self.zero_values is not None and min(t.pos for t in targets) > 0)
        with torch.no_grad():
            writer = RowWriter(self.prompt, n, len(targets), self.final.device, out)
            zero_edges = self._gradients(targets, tops, n, first, writer.add)
            rows = writer.done()[:len(targets)]
            if first:
                n_layers, seq = self.prompt.errors.shape[:2]
                rows[:, rows.shape[1] - seq] = zero_edges.to(rows.dtype)  # position 0's embedding
            return rows

    def _tops(self, targets: Sequence) -> list[int]:
        """Each target's layer (the logits': the layer count), refused unless ascending."""
        n_layers = len(self.blocks)
        tops = [n_layers if t.layer is None else t.layer for t in targets]
        if tops != sorted(tops):
            raise ValueError(f"targets by layer {tops}: the written-out backward takes them ordered by layer")
        return tops

    def head_gradients(self, targets: Sequence) -> list[Tensor]:
        """The targets' gradients at each layer's head outputs (`attention_head_outputs`), [batch seq head
        head_dim] per layer, as `Replica.head_gradients` gives them (position 0 carried: its heads too)."""
        n_layers, seq = len(self.blocks), self.prompt.tokens.shape[1]
        tops = self._tops(targets)
        _, _, _, _, _, w_o, _, _, kv, groups, head_dim = self.blocks[0]
        heads = [w_o.new_zeros(len(targets), seq, kv * groups, head_dim) for _ in range(n_layers)]
        with torch.no_grad():
            self._gradients(targets, tops, max(t.pos for t in targets) + 1, 0, None, heads)
        return heads

    def _gradients(self, targets: Sequence, tops: list[int], n: int, first: int,
                   leaf: Callable[[int, Tensor], None] | None, heads: list | None = None) -> Tensor:
        """The gradients at the leaves [batch n hidden_size], each handed to `leaf` as made (`RowWriter.add`'s
        numbering: 0 the stream entering layer 0, l + 1 layer l's MLP output), so that two are held at a
        time; from position `first` on (1: position 0 not carried, its embedding's edges returned).
        `heads`: per layer a zero [batch seq head head_dim], the gradients at the head outputs written in."""
        n_layers, batch = len(self.blocks), len(targets)
        c = self.final
        dtype, device = c.dtype, c.device
        d = c.shape[-1]
        position = torch.tensor([t.pos for t in targets], device=device)
        g = torch.zeros(batch, n, d, dtype=dtype, device=device)
        zero_edges = torch.zeros(batch, dtype=dtype, device=device)
        first_logit = next((i for i, top in enumerate(tops) if top == n_layers), batch)
        if first_logit < batch:
            directions = torch.stack([t.direction for t in targets[first_logit:]]).to(dtype=dtype, device=device)
            at = position[first_logit:]
            g[torch.arange(first_logit, batch, device=device), at] = (directions @ self.unembedding) * c[at]
        factors, above = None, batch  # the last fresh targets' factors, and where the older ones start
        for l in reversed(range(n_layers)):
            # Targets whose gradient has passed an attention layer ([mid:]), and those meeting their first
            # ([start:mid]: this layer's features, and at the top block the logits), one position each; of
            # the first, [mid:above] met theirs at the block above (its factors, where they pay).
            start = next((i for i, top in enumerate(tops) if top >= l), batch)
            mid = next((i for i, top in enumerate(tops) if min(top, n_layers - 1) > l), batch)
            if start == batch:
                continue
            if leaf is not None:
                leaf(l + 1, g)
            below = torch.zeros_like(g)
            head = (lambda a, b: None) if heads is None else (lambda a, b: heads[l][a:b])
            split = mid
            if factors is not None and mid < above and self._factors_pay(position[mid:above], first):
                split = above
                below[mid:above], zero_edges[mid:above] = self._through_block_from_factors(
                    l, g[mid:above], *factors, position[mid:above], n, first, zero_edges[mid:above], head(mid, above))
            if split < batch:
                below[split:], zero_edges[split:] = self._through_block(
                    l, g[split:], position[split:], n, first, zero_edges[split:], head(split, batch))
            factors = None
            if start < mid:
                fresh = range(start, mid)
                injected = [(i - start, t.direction) for i, t in zip(fresh, targets[start:mid]) if tops[i] == l]
                below[start:mid], zero_edges[start:mid], factors = self._through_block_from_one_position(
                    l, g[start:mid], position[start:mid], injected, n, first, zero_edges[start:mid], head(start, mid))
            g, above = below, mid
        if leaf is not None:
            leaf(0, g)
        return zero_edges

    def _factors_pay(self, position: Tensor, first: int) -> bool:
        """Whether targets one block below their first take the factored products: per target (heads + 1)
        skip products and twice as many output projections, against one of each per position carried."""
        _, _, _, _, _, w_o, _, skip, kv, groups, head_dim = self.blocks[0]
        rank, d, width = kv * groups + 1, w_o.shape[0], w_o.shape[1]
        carried = float((position + 1 - first).sum())
        dense = carried * (d * width + (0 if skip is None else skip.numel()))
        factored = len(position) * rank * ((2 if skip is not None else 1) * d * width + (0 if skip is None else skip.numel()))
        return factored < dense

    def _through_block(self, l: int, g: Tensor, position: Tensor, n: int, first: int, zero_edges: Tensor,
                       heads: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Block l's transpose for gradients g [batch n hidden_size] at its output: at its input. The
        products position by position run over each target's positions `first` ... its own (the rest are
        zero: nothing later reaches it), packed [(target, position) hidden_size]; only the mix is padded.
        With `first`, the value gradients at position 0 dotted with its embedding's values, added to
        `zero_edges`. `heads` [batch seq head head_dim]: the gradients at the head outputs, written in."""
        inv1, inv2, w1, w2, pattern, w_o, w_v, skip, kv, groups, head_dim = self.blocks[l]
        batch = g.shape[0]
        target, at = _packed(position, first)
        packed = g[target, at]
        g_h = packed if skip is None else torch.addcmul(packed, (packed @ skip) * w2, inv2[at])
        # Written straight into the mix's layout [kv_head group n batch head_dim], seen as [batch n ...].
        z = g.new_zeros(kv, groups, n, batch, head_dim).permute(3, 2, 0, 1, 4)
        z[target, at] = (g_h @ w_o).view(-1, kv, groups, head_dim)
        v, zero_edges = self._mixed(l, z, n, first, zero_edges, heads)
        below = torch.zeros_like(g)
        below[target, at] = torch.addcmul(g_h, (v[target, at].flatten(1) @ w_v) * w1, inv1[at])
        return below, zero_edges

    def _mixed(self, l: int, z: Tensor, n: int, first: int, zero_edges: Tensor, heads: Tensor | None
               ) -> tuple[Tensor, Tensor]:
        """From the gradients z [batch n kv_head group head_dim] at block l's head outputs (written into
        `heads` where given), those at its values [batch n kv_head head_dim]: each head's pattern
        transposed, summed over each key/value head's group, as one product per key/value head (its
        group's patterns side by side, [n (group n)], times their gradients [(group n) (batch head_dim)]);
        with `first`, position 0's dotted with its embedding's values and added to `zero_edges`."""
        pattern, kv, groups, head_dim = self.blocks[l][4], *self.blocks[l][8:]
        batch = z.shape[0]
        if heads is not None:
            heads[:, :n].unflatten(2, (kv, groups)).copy_(z)
        mix = pattern[:, :n, :n].reshape(kv, groups, n, n).permute(0, 3, 1, 2).reshape(kv, n, groups * n)
        v = torch.bmm(mix, z.permute(2, 3, 1, 0, 4).reshape(kv, groups * n, batch * head_dim))
        v = v.view(kv, n, batch, head_dim).permute(2, 1, 0, 3)  # [batch n kv_head head_dim]
        if first:
            zero_edges = zero_edges + (v[:, 0] * self.zero_values[l]).flatten(1).sum(-1)
        return v, zero_edges

    def _through_block_from_one_position(self, l: int, g: Tensor, position: Tensor, injected: list, n: int,
                                         first: int, zero_edges: Tensor, heads: Tensor | None = None
                                         ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
        """Block l's transpose for gradients g [batch n hidden_size] that are nonzero only at each target's
        position (plus `injected`: (row, direction) at the MLP input there): per head, the vector
        (g_h[p] @ W_O_h) @ W_V_h, spread over the positions by row p of the head's pattern (from `first`;
        position 0's share, with `first`, dotted with its embedding's values into `zero_edges`). Also returns
        the gradient below in factors, for `_through_block_from_factors` at the next block down."""
        inv1, inv2, w1, w2, pattern, w_o, w_v, skip, kv, groups, head_dim = self.blocks[l]
        batch = g.shape[0]
        rows = torch.arange(batch, device=g.device)
        at = g[rows, position]  # [batch hidden_size]
        into_mlp = torch.zeros_like(at) if skip is None else at @ skip
        for row, direction in injected:
            into_mlp[row] += direction.to(into_mlp.dtype)
        g_h = torch.addcmul(at, into_mlp * w2, inv2[position])
        z = (g_h @ w_o).view(batch, kv, groups, head_dim)
        if heads is not None:
            heads[rows, position] = z.view(batch, kv * groups, head_dim)
        per_head = torch.einsum("bkge,ked->bkgd", z, w_v.view(kv, head_dim, -1)).reshape(batch, kv * groups, -1)
        spread = pattern[:, position, :n].permute(1, 2, 0)  # [batch n head]: row p of each head's pattern
        if first:
            reads = torch.einsum("bkge,ke->bkg", z, self.zero_values[l]).flatten(1)  # [batch head]
            zero_edges = zero_edges + (spread[:, 0] * reads).sum(-1)
            spread = spread.clone()
            spread[:, 0] = 0
        # The gradient below as coefficients [batch n head+1] of vectors [batch head+1 hidden_size]: each
        # head's vector spread by the pattern's row (over the norm's scale), and g_h at the position.
        coefficients = torch.cat([spread * inv1[:n], torch.zeros_like(spread[..., :1])], -1)
        coefficients[rows, position, -1] = 1
        vectors = torch.cat([per_head * w1, g_h[:, None]], 1)
        below = torch.bmm(coefficients, vectors)
        return below, zero_edges, (coefficients, vectors)

    def _through_block_from_factors(self, l: int, g: Tensor, coefficients: Tensor, vectors: Tensor, position: Tensor,
                                    n: int, first: int, zero_edges: Tensor, heads: Tensor | None = None
                                    ) -> tuple[Tensor, Tensor]:
        """`_through_block` for targets one block below their first, whose gradient g is the block above's
        `coefficients @ vectors` (head + 1 vectors each): the skip and output projections of the vectors,
        not of every position (fewer products where a target carries more positions than twice its heads)."""
        inv1, inv2, w1, w2, pattern, w_o, w_v, skip, kv, groups, head_dim = self.blocks[l]
        batch = g.shape[0]
        if skip is None:
            g_h, z = g, coefficients @ (vectors @ w_o)
        else:
            skipped = (vectors @ skip) * w2  # [batch head+1 d_in]
            g_h = g + (coefficients @ skipped) * inv2[:n]
            z = coefficients @ (vectors @ w_o) + (coefficients @ (skipped @ w_o)) * inv2[:n]
        z = z.view(batch, n, kv, groups, head_dim)
        v, zero_edges = self._mixed(l, z, n, first, zero_edges, heads)
        target, at = _packed(position, first)
        below = torch.zeros_like(g)
        below[target, at] = torch.addcmul(g_h[target, at], (v[target, at].flatten(1) @ w_v) * w1, inv1[at])
        return below, zero_edges


def _packed(position: Tensor, first: int) -> tuple[Tensor, Tensor]:
    """(target, position) of every position each target carries, `first` ... its own, in order."""
    counts = position + 1 - first
    target = torch.repeat_interleave(torch.arange(len(position), device=position.device), counts)
    at = (torch.arange(int(counts.sum()), device=position.device) + first
          - torch.repeat_interleave(counts.cumsum(0) - counts, counts))
    return target, at
