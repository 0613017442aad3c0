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
vectors (g_h[p] @ W_O_h) @ W_V_h mixed by the pattern's row p, never the [pos hidden_size] products;
and the bottom block, whose gradient below is read only dotted with the embedding at each position,
takes it as g against a few columns per position made once per prompt (W_O_h W_V e_j per head and key
position j, and their skip images) instead of the block's products, where those columns are fewer.
Same sums as autograd's, in other orders: the rows agree to float32 rounding
(tests/hooked_models/attribution/test_linear_backward.py), not bit for bit.

`LinearBackward.refusal(model, transcoders)` says why a model or transcoder set is not of that form
(alpha-er's factored projections, a cross-layer transcoder, a hook on the model, dtypes that differ);
`attribute` then runs autograd's backward over replicas, which serves every model.
"""

from collections.abc import Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from hooked_models.attribution.replacement import Prompt, RowWriter, position_dots


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
            # Each norm: 1 / its frozen scale per position [seq 1], and the second's weight (the first's is
            # folded into W_V). The skips as they are (a copy of every skip with the norm's weight folded in
            # would be layers x d_in x d_out more memory).
            inv1 = 1 / constants[f"layers.{l}.input_layernorm.norm_scale"][0]
            inv2 = 1 / constants[f"layers.{l}.post_attention_layernorm.norm_scale"][0]
            pattern = constants[f"layers.{l}.self_attn.attention_probabilities"][0]  # [head seq seq]
            skip = tcs.skip_weight(l).detach() if tcs.has_skip else None  # [d_out d_in]
            # W_V with the input norm's weight folded in (kv_heads x head_dim x hidden_size: small beside W_O).
            w_v = attn.v_proj.weight.detach() * w1
            self.blocks.append((inv1, inv2, w2, pattern, attn.o_proj.weight.detach(), w_v,
                                skip, attn.num_kv_heads, attn.groups, attn.head_dim))
        self.final = model.norm.weight.detach() / constants["norm.norm_scale"][0]  # [seq hidden_size]
        self.unembedding = model.lm_head.weight.detach()  # [vocab hidden_size]
        self.zero_values = None if prompt.keep_position_zero else self._position_zero_values()
        self._reads: tuple | None = None  # the bottom block's embedding reads (`_embedding_reads`), once made

    def _position_zero_values(self) -> list[Tensor]:
        """Per layer, the values [kv_head head_dim] that position 0's embedding makes there, forward through
        position 0's own blocks (it attends to itself alone; its MLP outputs are constants of the prompt but
        for the skip): where position 0's features and errors are not nodes, its embedding is the one node
        there, and a target's edge from it is its gradient at each layer's values at position 0 dotted with
        these, so position 0 is never carried through the position-by-position products."""
        x, values = self.prompt.embedding[0].to(self.final.dtype), []
        with torch.no_grad():
            for inv1, inv2, w2, pattern, w_o, w_v, skip, kv, groups, head_dim in self.blocks:
                v = (x @ w_v.T) * inv1[0]  # (w_v: W_V with the norm's weight folded in)
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
            zero_edges = self._gradients(targets, tops, n, first, writer)
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
        _, _, _, _, w_o, _, _, kv, groups, head_dim = self.blocks[0]
        heads = [w_o.new_zeros(len(targets), seq, kv * groups, head_dim) for _ in range(n_layers)]
        with torch.no_grad():
            self._gradients(targets, tops, max(t.pos for t in targets) + 1, 0, None, heads)
        return heads

    def _gradients(self, targets: Sequence, tops: list[int], n: int, first: int, writer: RowWriter | None,
                   heads: list | None = None) -> Tensor:
        """The gradients at the leaves [batch n-first hidden_size] (positions `first` ... n-1: with 1,
        position 0 not carried, its embedding's edges returned), each handed to `writer` as made (`add`'s
        numbering: 0 the stream entering layer 0, l + 1 layer l's MLP output), so that two are held at a
        time; the bottom block's, where it pays, only as its dots with the embedding (`_bottom`). `heads`:
        per layer a zero [batch seq head head_dim], the gradients at the head outputs written in."""
        n_layers, batch = len(self.blocks), len(targets)
        c = self.final
        dtype, device = c.dtype, c.device
        d = c.shape[-1]
        position = torch.tensor([t.pos for t in targets], device=device)
        g = torch.zeros(batch, n - first, d, dtype=dtype, device=device)
        zero_edges = torch.zeros(batch, dtype=dtype, device=device)
        first_logit = next((i for i, top in enumerate(tops) if top == n_layers), batch)
        if first_logit < batch:
            directions = torch.stack([t.direction for t in targets[first_logit:]]).to(dtype=dtype, device=device)
            at = position[first_logit:]
            g[torch.arange(first_logit, batch, device=device), at - first] = (directions @ self.unembedding) * c[at]
        factors, above = None, batch  # the last fresh targets' factors, and where the older ones start
        for l in reversed(range(n_layers)):
            # Targets whose gradient has passed an attention layer ([mid:]), and those meeting their first
            # ([start:mid]: this layer's features, and at the top block the logits), one position each; of
            # the first, [mid:above] met theirs at the block above (its factors, where they pay).
            start = next((i for i, top in enumerate(tops) if top >= l), batch)
            mid = next((i for i, top in enumerate(tops) if min(top, n_layers - 1) > l), batch)
            if start == batch:
                continue
            if writer is not None:
                writer.add(l + 1, g, first)
            if l == 0 and writer is not None and heads is None and self._embedding_reads() is not None:
                return self._bottom_rows(g, targets, tops, position, n, first, zero_edges, mid, writer)
            below = torch.empty_like(g)  # each path writes its rows whole; those not started yet are zero
            below[:start] = 0
            head = (lambda a, b: None) if heads is None else (lambda a, b: heads[l][a:b])
            split = mid
            if factors is not None and mid < above and self._factors_pay(position[mid:above], first):
                split = above
                zero_edges[mid:above] = self._through_block_from_factors(
                    l, g[mid:above], *factors, position[mid:above], n, first, zero_edges[mid:above],
                    below[mid:above], head(mid, above))
            if split < batch:
                zero_edges[split:] = self._through_block(
                    l, g[split:], position[split:], n, first, zero_edges[split:], below[split:], head(split, batch))
            factors = None
            if start < mid:
                fresh = range(start, mid)
                injected = [(i - start, t.direction) for i, t in zip(fresh, targets[start:mid]) if tops[i] == l]
                zero_edges[start:mid], factors = self._through_block_from_one_position(
                    l, g[start:mid], position[start:mid], injected, n, first, zero_edges[start:mid],
                    below[start:mid], head(start, mid))
            g, above = below, mid
        if writer is not None:
            writer.add(0, g, first)
        return zero_edges

    def _bottom_rows(self, g: Tensor, targets: Sequence, tops: list[int], position: Tensor, n: int, first: int,
                     zero_edges: Tensor, mid: int, writer: RowWriter) -> Tensor:
        """The embedding's columns from the gradients g [batch n-first hidden_size] at the bottom block's
        output: of the targets that passed a block ([mid:]) by `_bottom`, of layer 0's features ([:mid])
        through their one position; returns `zero_edges` with the bottom block's share added."""
        dots = g.new_empty(g.shape[:2])
        if mid:
            below = torch.empty_like(g[:mid])
            injected = [(i, t.direction) for i, t in enumerate(targets[:mid]) if tops[i] == 0]
            zero_edges[:mid], _ = self._through_block_from_one_position(
                0, g[:mid], position[:mid], injected, n, first, zero_edges[:mid], below)
            dots[:mid] = position_dots(below, self.prompt.embedding[first:n].to(g.dtype))
        if mid < len(targets):
            zero_edges[mid:], dots[mid:] = self._bottom(g[mid:], n, first, zero_edges[mid:])
        writer.add_embedding(dots, first)
        return zero_edges

    def _embedding_reads(self) -> tuple[Tensor, Tensor] | None:
        """What the bottom block's transpose reads of the embedding, where a gradient below it is wanted
        only dotted with the embedding e_j at each position j: per position and head h, the vector
        u = W_O_h (W_V (w1 e_j)) (a query's gradient at h's output dotted with it is what reaches key j's
        embedding through the values), and with a skip also skip (w2 u) (the same through the MLP input
        first), [seq (1 or 2)*head hidden_size]; and e_j with skip (w2 e_j), [seq hidden_size (1 or 2)] (the
        residual path at j). Made once per prompt; None where those columns are as many as the block's
        products per position (d_in + the heads' width + the values' width): long prompts."""
        if self._reads is None:
            if not self._reads_pay():
                self._reads = ()
                return None
            inv1, inv2, w2, pattern, w_o, w_v, skip, kv, groups, head_dim = self.blocks[0]
            d, heads = w_o.shape[0], kv * groups
            e = self.prompt.embedding.to(w_o.dtype)
            seq = e.shape[0]
            values = (e @ w_v.T).view(seq, kv, 1, head_dim).expand(seq, kv, groups, head_dim).reshape(seq, heads, head_dim)
            u = torch.einsum("jhe,dhe->jhd", values, w_o.view(d, heads, head_dim))
            residual = e[:, :, None]
            if skip is not None:
                u = torch.cat([u, (u * w2) @ skip.T], 1)
                residual = torch.cat([residual, ((e * w2) @ skip.T)[:, :, None]], 2)
            self._reads = (u.contiguous(), residual.contiguous())
        return self._reads or None

    def _reads_pay(self) -> bool:
        """Whether `_embedding_reads`' columns a query position is dotted with, (1 or 2) x heads x its keys
        (on average those of its block of queries, `_query_blocks`), are fewer than the bottom block's
        products per position (its skip's d_in, the heads' width, the values' width)."""
        _, _, _, _, w_o, _, skip, kv, groups, head_dim = self.blocks[0]
        seq, parts = self.prompt.tokens.shape[1], 1 if skip is None else 2
        keys = sum((stop - start) * stop for start, stop in _query_blocks(0, seq)) / seq
        return parts * kv * groups * keys < (0 if skip is None else skip.shape[1]) + w_o.shape[1] + kv * head_dim

    def _bottom(self, g: Tensor, n: int, first: int, zero_edges: Tensor) -> tuple[Tensor, Tensor]:
        """The bottom block's transpose for gradients g [batch n-first hidden_size] at its output, dotted
        with the embedding at each position, [batch n-first], without the block's products: g against
        `_embedding_reads`' columns for the key positions up to each block of queries' last (causal: a
        query reads no later key; `_query_blocks`) (with the skip's: g_h = g + c2 (g W_skip) w2), mixed by
        each head's pattern onto its keys, plus the residual path's dot at each position; with `first`,
        position 0's key added to `zero_edges` (its values' share, as `_mixed` adds it)."""
        inv1, inv2, w2, pattern, w_o, w_v, skip, kv, groups, head_dim = self.blocks[0]
        reads, residual = self._embedding_reads()
        batch, m, d = g.shape
        heads, parts = kv * groups, residual.shape[2]
        keys = g.new_zeros(batch, n)
        for start, stop in _query_blocks(first, n):  # queries start ... stop-1 read keys 0 ... stop-1
            q = g[:, start - first:stop - first].reshape(-1, d)
            r = (q @ reads[:stop].reshape(-1, d).T).view(batch, stop - start, stop, parts, heads)
            s = r[..., 0, :] if parts == 1 else torch.addcmul(r[..., 0, :], r[..., 1, :],
                                                              inv2[start:stop].view(1, -1, 1, 1))
            keys[:, :stop] += torch.einsum("bpjh,hpj->bj", s, pattern[:, start:stop, :stop])
        keys *= inv1[:n, 0]  # [batch n]
        own = torch.bmm(g.transpose(0, 1), residual[first:n])  # [m batch parts]
        own = own[..., 0] if parts == 1 else torch.addcmul(own[..., 0], own[..., 1], inv2[first:n])
        if first:
            zero_edges = zero_edges + keys[:, 0]
        return zero_edges, keys[:, first:] + own.T

    def _factors_pay(self, position: Tensor, first: int) -> bool:
        """Whether targets one block below their first take the factored products: per target (heads + 1)
        skip products and twice as many output projections, against one of each per position carried."""
        _, _, _, _, w_o, _, skip, kv, groups, head_dim = self.blocks[0]
        rank, d, width = kv * groups + 1, w_o.shape[0], w_o.shape[1]
        carried = float((position + 1 - first).sum())
        dense = carried * (d * width + (0 if skip is None else skip.numel()))
        factored = len(position) * rank * ((2 if skip is not None else 1) * d * width + (0 if skip is None else skip.numel()))
        return factored < dense

    @staticmethod
    def _padding_pays(position: Tensor, n: int, first: int) -> bool:
        """Whether the products position by position run over every target's positions `first` ... n-1
        (the gradient's own layout: no gathers, no scatters, the positions after a target's own computed
        as the exact zeros they are) rather than over each target's own, packed: where at most an eighth of
        the rows would be such zeros (a gather and a scatter of a row cost about an eighth of its products)."""
        carried = int((position + 1 - first).sum())
        return 8 * carried >= 7 * len(position) * (n - first)

    def _through_block(self, l: int, g: Tensor, position: Tensor, n: int, first: int, zero_edges: Tensor,
                       out: Tensor, heads: Tensor | None = None) -> Tensor:
        """Block l's transpose for gradients g [batch n-first hidden_size] at its output: at its input,
        written into `out` (the same shape). The products position by position run over each target's
        positions `first` ... its own (the rest are zero: nothing later reaches it), packed [(target,
        position) hidden_size], or over all of them where the padding pays; only the mix is padded. With
        `first`, the value gradients at position 0 dotted with its embedding's values, added to `zero_edges`
        (returned). `heads` [batch seq head head_dim]: the gradients at the head outputs, written in. g is
        overwritten (where the padding pays, it holds the gradient at the attention's output after)."""
        inv1, inv2, w2, pattern, w_o, w_v, skip, kv, groups, head_dim = self.blocks[l]
        batch = g.shape[0]
        if self._padding_pays(position, n, first):
            # g_h in g's own rows (the writer has read g, and nothing reads it after this block): one
            # [batch n-first hidden_size] fewer held per target.
            g_h = g if skip is None else g.addcmul_((g @ skip).mul_(w2), inv2[first:n])
            z = (g_h @ w_o).view(batch, n - first, kv, groups, head_dim)
            v, zero_edges = self._mixed(l, z, n, first, zero_edges, heads)
            self._to_input(l, g_h, v, position, n, first, out)
            return zero_edges
        target, at = _packed(position, first)
        packed = g[target, at]
        g_h = packed if skip is None else torch.addcmul(packed, (packed @ skip).mul_(w2), inv2[at + first])
        # Written straight into the mix's layout [kv_head group n batch head_dim], seen as [batch n ...].
        z = g.new_zeros(kv, groups, n - first, batch, head_dim).permute(3, 2, 0, 1, 4)
        z[target, at] = (g_h @ w_o).view(-1, kv, groups, head_dim)
        v, zero_edges = self._mixed(l, z, n, first, zero_edges, heads)
        out.zero_()
        out[target, at] = torch.addcmul(g_h, v[target, at].flatten(1) @ w_v, inv1[at + first])
        return zero_edges

    def _mixed(self, l: int, z: Tensor, n: int, first: int, zero_edges: Tensor, heads: Tensor | None
               ) -> tuple[Tensor, Tensor]:
        """From the gradients z [batch n-first kv_head group head_dim] at block l's head outputs (positions
        `first` ... n-1; written into `heads` where given), those at its values [batch n-first kv_head
        head_dim]: each head's pattern transposed, summed over each key/value head's group, as one product
        per key/value head (its group's patterns side by side, [n (group n-first)], times their gradients
        [(group n-first) (batch head_dim)]); with `first`, position 0's (a key every query reads) dotted
        with its embedding's values and added to `zero_edges`."""
        pattern, kv, groups, head_dim = self.blocks[l][3], *self.blocks[l][7:]
        batch, m = z.shape[0], n - first
        if heads is not None:
            heads[:, first:n].unflatten(2, (kv, groups)).copy_(z)
        mix = pattern[:, first:n, :n].reshape(kv, groups, m, n).permute(0, 3, 1, 2).reshape(kv, n, groups * m)
        v = torch.bmm(mix, z.permute(2, 3, 1, 0, 4).reshape(kv, groups * m, batch * head_dim))
        v = v.view(kv, n, batch, head_dim).permute(2, 1, 0, 3)  # [batch n kv_head head_dim]
        if first:
            zero_edges = zero_edges + (v[:, 0] * self.zero_values[l]).flatten(1).sum(-1)
        return v[:, first:], zero_edges

    def _through_block_from_one_position(self, l: int, g: Tensor, position: Tensor, injected: list, n: int,
                                         first: int, zero_edges: Tensor, out: Tensor, heads: Tensor | None = None
                                         ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Block l's transpose for gradients g [batch n-first hidden_size] that are nonzero only at each
        target's position (plus `injected`: (row, direction) at the MLP input there): per head, the vector
        (g_h[p] @ W_O_h) @ W_V_h, spread over the positions by row p of the head's pattern (from `first`;
        position 0's share, with `first`, dotted with its embedding's values into `zero_edges`), written
        into `out`. Returns `zero_edges` and the gradient below in factors, for
        `_through_block_from_factors` at the next block down."""
        inv1, inv2, w2, pattern, w_o, w_v, skip, kv, groups, head_dim = self.blocks[l]
        batch = g.shape[0]
        rows = torch.arange(batch, device=g.device)
        at = g[rows, position - first]  # [batch hidden_size]
        into_mlp = torch.zeros_like(at) if skip is None else at @ skip
        if injected:
            rows_in, directions = zip(*injected)
            into_mlp.index_add_(0, torch.tensor(rows_in, device=g.device), torch.stack(directions).to(into_mlp.dtype))
        g_h = torch.addcmul(at, into_mlp * w2, inv2[position])
        z = (g_h @ w_o).view(batch, kv, groups, head_dim)
        if heads is not None:
            heads[rows, position] = z.view(batch, kv * groups, head_dim)
        per_head = torch.einsum("bkge,ked->bkgd", z, w_v.view(kv, head_dim, -1)).reshape(batch, kv * groups, -1)
        spread = pattern[:, position, :n].permute(1, 2, 0)  # [batch n head]: row p of each head's pattern
        if first:
            reads = torch.einsum("bkge,ke->bkg", z, self.zero_values[l]).flatten(1)  # [batch head]
            zero_edges = zero_edges + (spread[:, 0] * reads).sum(-1)
        # The gradient below as coefficients [batch n-first head+1] of vectors [batch head+1 hidden_size]:
        # each head's vector spread by the pattern's row (over the norm's scale), and g_h at the position.
        coefficients = torch.cat([spread[:, first:] * inv1[first:n], torch.zeros_like(spread[:, first:, :1])], -1)
        coefficients[rows, position - first, -1] = 1
        vectors = torch.cat([per_head, g_h[:, None]], 1)
        torch.bmm(coefficients, vectors, out=out)
        return zero_edges, (coefficients, vectors)

    def _through_block_from_factors(self, l: int, g: Tensor, coefficients: Tensor, vectors: Tensor, position: Tensor,
                                    n: int, first: int, zero_edges: Tensor, out: Tensor, heads: Tensor | None = None
                                    ) -> Tensor:
        """`_through_block` for targets one block below their first, whose gradient g is the block above's
        `coefficients @ vectors` (head + 1 vectors each): the skip and output projections of the vectors,
        not of every position (fewer products where a target carries more positions than twice its heads)."""
        inv1, inv2, w2, pattern, w_o, w_v, skip, kv, groups, head_dim = self.blocks[l]
        batch = g.shape[0]
        if skip is None:
            g_h, z = g, coefficients @ (vectors @ w_o)
        else:
            skipped = (vectors @ skip) * w2  # [batch head+1 d_in]
            g_h = g + (coefficients @ skipped) * inv2[first:n]
            z = coefficients @ (vectors @ w_o) + (coefficients @ (skipped @ w_o)) * inv2[first:n]
        z = z.view(batch, n - first, kv, groups, head_dim)
        v, zero_edges = self._mixed(l, z, n, first, zero_edges, heads)
        self._to_input(l, g_h, v, position, n, first, out)
        return zero_edges

    def _to_input(self, l: int, g_h: Tensor, v: Tensor, position: Tensor, n: int, first: int, out: Tensor) -> None:
        """Block l's input gradient into `out` [batch n-first hidden_size]: g_h (at the attention's
        output) plus the value gradients v [batch n-first kv_head head_dim] through W_V (its norm's weight
        folded in) over the norm's scale; over every position where the padding pays, else each target's
        own, packed (the rest zero)."""
        inv1, w_v = self.blocks[l][0], self.blocks[l][5]
        if self._padding_pays(position, n, first):
            torch.addcmul(g_h, v.reshape(*v.shape[:2], -1) @ w_v, inv1[first:n], out=out)
            return
        target, at = _packed(position, first)
        out.zero_()
        out[target, at] = torch.addcmul(g_h[target, at], v[target, at].flatten(1) @ w_v, inv1[at + first])


def _query_blocks(first: int, n: int) -> list[tuple[int, int]]:
    """The query positions `first` ... n-1 in consecutive blocks (start, stop), at most 16 of them and
    none shorter than 8 positions but the last: the bottom block dots each block's queries with the keys up
    to its last (a query reads no later key), about half the products of every query against every key
    on a long prompt, in products few enough to stay large."""
    size = max(8, -(-(n - first) // 16))
    return [(start, min(start + size, n)) for start in range(first, n, size)]


def _packed(position: Tensor, first: int) -> tuple[Tensor, Tensor]:
    """(target, position - first) of every position each target carries, `first` ... its own, in order."""
    counts = position + 1 - first
    target = torch.repeat_interleave(torch.arange(len(position), device=position.device), counts)
    at = torch.arange(int(counts.sum()), device=position.device) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    return target, at
