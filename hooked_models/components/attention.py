"""Causal self-attention: the shared core, and grouped-query attention with rotary (Llama, Arcee).

The core takes queries, keys and values already split into heads and does the rest: scores, an
optional score modifier (alpha-er's soft cap), the mask, softmax, the mix, and the output projection.
When no hook reads or writes the scores or the pattern, it calls the fused
`scaled_dot_product_attention`, which never materializes them; otherwise it computes them
explicitly. They are transformers' "sdpa" and "eager" attention, step for step, so each gives its
counterpart's numbers bit for bit, and the two agree with each other to float32 rounding
(tests/hooked_models/components/test_attention.py, tests/hooked_models/families/test_arcee.py).
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from jaxtyping import Bool, Float
from torch import Tensor

from hooked_models.components.kv_cache import KeyValueCache
from hooked_models.components.rotary import apply_rotary
from hooked_models.hooks import HookedModule, ValueHook
from hooked_models.weight_views import FactoredMatrix, per_head_in, per_head_out
from hooked_models.vocabulary import declare_values


@dataclass
class AttentionInputs:
    """What every layer needs from the model's forward, computed once per forward.

    `mask` is None for a plain causal mask, else a boolean [batch 1 query key] (True: may attend).
    `cos` and `sin` are None for models without rotary. `kv_cache`, when given, holds the earlier
    positions' keys and values: the queries are then the last positions of the keys. `window`,
    when given, is (first position, sequence length): the call runs positions first ... of a
    sequence that long, the earlier ones held by the cache; a module that routes by absolute
    position (alpha-er's experts) reads it, and None means the call is the whole sequence.
    """

    mask: Bool[Tensor, "batch 1 query key"] | None = None
    cos: Float[Tensor, "batch seq head_dim"] | None = None
    sin: Float[Tensor, "batch seq head_dim"] | None = None
    kv_cache: KeyValueCache | None = None
    window: tuple[int, int] | None = None


def causal_mask(attention_mask: Tensor | None, seq: int, device: torch.device) -> Tensor | None:
    """The boolean mask for a padded batch, or None where the plain causal mask serves.

    A query may attend to earlier real tokens and always to itself, so padding rows stay finite
    (their outputs are never read) and real rows are exactly those of the unpadded prompt.
    `attention_mask` may cover cached positions too ([batch key], key >= seq): the `seq` queries
    are then its last positions.
    """
    if attention_mask is None:
        return None
    past = attention_mask.shape[-1] - seq
    causal = torch.ones(seq, past + seq, dtype=torch.bool, device=device).tril(past)
    keys = attention_mask.bool()[:, None, None, :]
    eye = torch.arange(past + seq, device=device) == torch.arange(past, past + seq, device=device)[:, None]
    return (causal & keys) | eye


class SelfAttention(HookedModule):
    """The attention core shared by every family.

    Subclasses own the projections that make queries, keys and values, and say through
    `head_input_change(part, written, unwritten)` how much head n's query, key or value ("q", "k",
    "v") moves when its normed input goes from `unwritten[..., n, :]` to `written[..., n, :]`
    (exactly zero where the two are equal), which split inputs need; `o_proj` maps the heads,
    side by side, back to the residual stream. `score_mod` (a module, or None) rewrites the scaled
    scores before the mask: alpha-er passes its soft cap here. Heads are `num_heads` query heads
    over `num_kv_heads` key/value heads; keys and values are hooked before the grouped-query repeat,
    so an edit to key/value head j reaches query heads j·g … j·g+g−1 (g = num_heads / num_kv_heads).
    """

    # Whether keys and values are laid out contiguously before attention when no key/value cache
    # holds them. transformers' default forward (use_cache=True) passes them through its cache, a
    # concatenation, so its attention reads contiguous copies; matmul's rounding can depend on the
    # layout, so a family that mirrors transformers copies them too (kv heads only: a small copy).
    contiguous_kv = False

    # A pattern fixed in advance ([1 num_heads seq seq], broadcast over the batch), or None. Set while the
    # attribution's decomposition runs (hooked_models/attribution/decomposition.py), whose patterns are the
    # prompt's frozen ones: the scores (and `attention_scores`) are then not computed, only to be replaced;
    # the pattern still passes `attention_probabilities` and mixes the values as a written pattern does.
    fixed_pattern: Tensor | None = None

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, score_mod: nn.Module | None = None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.groups = num_heads // num_kv_heads
        self.scale = head_dim**-0.5
        self.score_mod = score_mod
        for name in ("attention_queries", "attention_keys", "attention_values", "attention_scores",
                     "attention_premix", "attention_output", "attention_probabilities",
                     "attention_head_outputs", "attention_head_results", "attention_query_inputs",
                     "attention_key_inputs", "attention_value_inputs", "attention_inputs"):
            setattr(self, name, ValueHook(name))

    def split_inputs(
        self, x: Float[Tensor, "batch seq hidden_size"], norm: nn.Module
    ) -> dict[str, Float[Tensor, "batch seq heads head_dim"]] | None:
        """Per-head copies of the stream `x` entering the block (before `norm`), where hooked.

        None unless a hook is on `attention_inputs` or a query/key/value input (then no copy is made
        and nothing is computed). Otherwise, for each part ("q", "k", "v") whose copies are hooked,
        how much the copies move its heads: head n's projection of norm(copy n) minus its projection
        of norm(x), [batch seq heads head_dim], which the forward adds to that part (TransformerLens
        projects the copies instead; the difference is what a hook wrote, so unwritten copies leave
        the output bit for bit as it was). Both normed inputs come from one call on one stacked
        tensor, so rows that no hook changed are exactly equal and their difference exactly zero;
        the second comes from `x`, so a gradient reaches `x` once through the part, and head n's
        copy through head n alone.
        """
        points = {"q": self.attention_query_inputs, "k": self.attention_key_inputs, "v": self.attention_value_inputs}
        shared = self.attention_inputs.has_hooks()
        hooked = [part for part, point in points.items() if shared or point.has_hooks()]
        if not hooked:
            return None
        heads = {"q": self.num_heads, "k": self.num_kv_heads, "v": self.num_kv_heads}

        def copies(n: int) -> Tensor:
            return x.unsqueeze(-2).expand(*x.shape[:-1], n, x.shape[-1])

        given = {}
        if shared:
            attn_in = self.attention_inputs(copies(self.num_heads).contiguous())
            # Key/value head j reads the copy of its group's first query head (g = 1: its own).
            given = {"q": attn_in, "k": attn_in[..., ::self.groups, :], "v": attn_in[..., ::self.groups, :]}
        changes = {}
        for part in hooked:
            copy = given[part].clone() if part in given else copies(heads[part]).contiguous()
            written, unwritten = norm.forward_unhooked(torch.stack([points[part](copy), copies(heads[part])]))
            changes[part] = self.head_input_change(part, written, unwritten)
        return changes

    def wants_explicit_scores(self) -> bool:
        """Whether anyone reads or writes the scores or the pattern (else the fused path serves)."""
        explicit = self.attention_scores.has_hooks() or self.attention_probabilities.has_hooks()
        return explicit or self.score_mod is not None

    def attend(
        self,
        q: Float[Tensor, "batch num_heads seq qk_head_dim"],
        k: Float[Tensor, "batch num_kv_heads seq qk_head_dim"],
        v: Float[Tensor, "batch num_kv_heads seq head_dim"],
        inputs: AttentionInputs,
    ) -> Float[Tensor, "batch seq hidden_size"]:
        q = self.attention_queries(q)
        k = self.attention_keys(k)
        v = self.attention_values(v)
        if inputs.kv_cache is not None:
            # The hooks above saw the new positions only; attention reads the cached ones too.
            k, v = inputs.kv_cache.extend(self, k, v)
        elif self.contiguous_kv:
            k, v = k.contiguous(), v.contiguous()
        seq_q, seq_k = q.shape[-2], k.shape[-2]
        mask = inputs.mask
        if mask is None and seq_q != seq_k:
            # Queries are the last seq_q positions (a key/value cache holds the earlier ones).
            mask = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).tril(seq_k - seq_q)
        if self.fixed_pattern is not None:
            probs = self.attention_probabilities(self.fixed_pattern.expand(q.shape[0], -1, -1, -1).to(q.dtype))
            mixed = self.mix(probs, v)
        elif self.wants_explicit_scores():
            k_rep, v_rep = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
            scores = torch.matmul(q, k_rep.transpose(-1, -2)) * self.scale
            if self.score_mod is not None:
                scores = self.score_mod(scores)
            if mask is None:
                mask = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).tril()
            scores = self.attention_scores(scores.masked_fill(~mask, float("-inf")))
            # Softmax in float32 and back, as transformers does, so bf16 patterns agree with it.
            probs = self.attention_probabilities(F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype))
            mixed = self.mix(probs, v, v_rep)
        else:
            mixed = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                enable_gqa=self.groups > 1,
            )
        heads = self.attention_head_outputs(mixed.transpose(1, 2))
        premix = self.attention_premix(heads)
        output = self.o_proj(premix.flatten(-2))
        if self.attention_head_results.has_hooks():
            results = self.head_results(premix, output)
            written = self.attention_head_results(results)
            # Reading the heads leaves the output as it was, bit for bit; rewriting them makes
            # the output their sum, so the write flows on.
            if written is not results:
                output = written.sum(-2) + self.out_bias()
        return self.attention_output(output)

    def mix(self, probs: Float[Tensor, "batch num_heads seq_q seq_k"], v: Float[Tensor, "batch num_kv_heads seq_k head_dim"],
            v_rep: Tensor | None = None) -> Float[Tensor, "batch num_heads seq_q head_dim"]:
        """The pattern times the values, query head h reading key/value head h // groups (`v_rep`: v
        repeated so, where made already): matmul's products. Where every row of the batch has one
        pattern (a frozen one written back, expanded: stride 0), the same products per head with the
        pattern read in place, not copied once per row as matmul copies an expanded operand, nor the
        values repeated: the same [seq_q seq_k] x [seq_k head_dim] products, so the same bits."""
        batch = v.shape[0]
        if batch == 1 or probs.stride(0) != 0 or probs.shape[0] != batch:
            return torch.matmul(probs, repeat_kv(v, self.groups) if v_rep is None else v_rep)
        out = v.new_empty(probs.shape[1], batch, probs.shape[2], v.shape[-1])  # [head batch seq_q head_dim]
        for h in range(probs.shape[1]):
            torch.bmm(probs[:, h], v[:, h // self.groups], out=out[h])
        return out.transpose(0, 1)

    def head_results(
        self, premix: Float[Tensor, "batch seq num_heads head_dim"],
        output: Float[Tensor, "batch seq hidden_size"] | None = None,
    ) -> Float[Tensor, "batch seq num_heads hidden_size"]:
        """Each head's term of the output projection (bias excluded): they sum to its output.

        An output projection that is not one matrix (alpha-er's factored o_proj) splits itself,
        through its own `head_results` and `out_bias`; `output`, when the forward has it already,
        spares it a second run.
        """
        if hasattr(self.o_proj, "head_results"):
            return self.o_proj.head_results(premix, output)
        w = self.o_proj.weight.view(-1, self.num_heads, self.head_dim)
        # Contiguous, so that summing a written copy over heads reduces in the order a plain tensor does.
        return torch.einsum("bshd,mhd->bshm", premix, w).contiguous()

    def out_bias(self) -> Tensor | float:
        if hasattr(self.o_proj, "out_bias"):
            return self.o_proj.out_bias()
        bias = getattr(self.o_proj, "bias", None)
        return 0.0 if bias is None else bias


def repeat_kv(x: Float[Tensor, "batch num_kv_heads seq dim"], groups: int) -> Float[Tensor, "batch num_heads seq dim"]:
    """Each key/value head repeated for its `groups` query heads (query head h reads kv head
    h // groups), built as transformers' `repeat_kv` builds it (expand, then reshape): with one kv
    head that is a view with a zero stride, which matmul treats differently from a copy, so only
    this form gives transformers' eager scores bit for bit."""
    if groups == 1:
        return x
    batch, kv_heads, seq, dim = x.shape
    return x[:, :, None].expand(batch, kv_heads, groups, seq, dim).reshape(batch, kv_heads * groups, seq, dim)


class GroupedQueryAttention(SelfAttention):
    """Llama's attention: q, k, v and o projections without bias, rotary on queries and keys."""

    contiguous_kv = True

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.attention_queries_unrotated = ValueHook("attention_queries_unrotated")
        self.attention_keys_unrotated = ValueHook("attention_keys_unrotated")

    def forward(
        self, x: Float[Tensor, "batch seq hidden_size"], inputs: AttentionInputs,
        split: dict[str, Tensor] | None = None,
    ) -> Float[Tensor, "batch seq hidden_size"]:
        """`split`: what per-head input copies change, from `split_inputs` (None: no copies)."""
        batch, seq, _ = x.shape
        q, k, v = (proj(x).view(batch, seq, -1, self.head_dim) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if split is not None:  # same layout as the projections' own output, so the same bits follow
            q, k, v = (t + split[part] if part in split else t for part, t in zip("qkv", (q, k, v)))
        q = apply_rotary(self.attention_queries_unrotated(q.transpose(1, 2)), inputs.cos, inputs.sin)
        k = apply_rotary(self.attention_keys_unrotated(k.transpose(1, 2)), inputs.cos, inputs.sin)
        return self.attend(q, k, v.transpose(1, 2), inputs)

    def head_input_change(self, part, written, unwritten):
        # Linear: the projection of the difference, exactly zero where nothing was written.
        weight = {"q": self.q_proj, "k": self.k_proj, "v": self.v_proj}[part].weight
        heads = written.shape[-2]
        return torch.einsum("bsnh,ndh->bsnd", written - unwritten, weight.view(heads, self.head_dim, -1))

    # TransformerLens's weight views: they share storage with the projections, so an edit writes
    # through. W_K and W_V are per key/value head, as TransformerLens's bridge has them; the
    # `_expanded` forms repeat each kv head for its query heads (query head h reads kv head
    # h // groups) and are copies, as circuits need one matrix per query head.
    W_Q = property(lambda self: per_head_in(self.q_proj.weight, self.num_heads))
    W_K = property(lambda self: per_head_in(self.k_proj.weight, self.num_kv_heads))
    W_V = property(lambda self: per_head_in(self.v_proj.weight, self.num_kv_heads))
    W_O = property(lambda self: per_head_out(self.o_proj.weight, self.num_heads))
    _W_K = W_K
    _W_V = W_V
    W_K_expanded = property(lambda self: self.W_K.repeat_interleave(self.groups, dim=0))
    W_V_expanded = property(lambda self: self.W_V.repeat_interleave(self.groups, dim=0))

    @property
    def QK(self) -> FactoredMatrix:
        """Per query head, W_Q @ W_K.T [head hidden_size hidden_size] (before rotary)."""
        return FactoredMatrix(self.W_Q, self.W_K_expanded.transpose(-1, -2))

    @property
    def OV(self) -> FactoredMatrix:
        """Per query head, W_V @ W_O [head hidden_size hidden_size]: what a head writes per token it reads."""
        return FactoredMatrix(self.W_V_expanded, self.W_O)


# The soft cap's own value, in the vocabulary's form.
SOFT_CAP_VALUES = declare_values("attention", [
    ("attention_raw_scores", "Pattern", "The scaled scores q·k/sqrt(d) before the soft cap, unmasked",
     "the child module score_mod's input"),
])


class SoftCap(HookedModule):
    """Logit soft-capping, tanh(s / cap) · cap, on the scaled scores before the mask; cap 0 is off.

    alpha-er's trainer applies it (cap 30) and `scaled_dot_product_attention` has no equivalent; the
    alpha-er reference reports an 82% logit disagreement without it. Gemma 2 uses the same form.
    """

    def __init__(self, cap: float):
        super().__init__()
        if cap < 0:
            raise ValueError(f"soft cap must be >= 0 (0 turns it off), got {cap}")
        self.cap = cap
        self.attention_raw_scores = ValueHook(SOFT_CAP_VALUES["attention_raw_scores"])

    def forward(
        self, scores: Float[Tensor, "batch num_heads query key"]
    ) -> Float[Tensor, "batch num_heads query key"]:
        scores = self.attention_raw_scores(scores)
        if not self.cap:
            return scores
        return torch.tanh(scores / self.cap) * self.cap

    def extra_repr(self) -> str:
        return f"cap={self.cap}" if self.cap else "cap=0 (off)"


class FusedQKVAttention(SelfAttention):
    """Attention whose queries, keys and values come from one projection, split in that order.

    The projections are passed in (alpha-er: factored qkv_proj and o_proj, no rotary), as is the
    score modifier. Keys and values have as many heads as queries.
    """

    def __init__(self, qkv_proj: nn.Module, o_proj: nn.Module, num_heads: int, head_dim: int,
                 score_mod: nn.Module | None = None):
        super().__init__(num_heads, num_heads, head_dim, score_mod=score_mod)
        self.qkv_proj = qkv_proj
        self.o_proj = o_proj

    def forward(
        self, x: Float[Tensor, "batch seq hidden_size"], inputs: AttentionInputs,
        split: dict[str, Tensor] | None = None,
    ) -> Float[Tensor, "batch seq hidden_size"]:
        """`split`: what per-head input copies change, from `split_inputs` (None: no copies)."""
        batch, seq, _ = x.shape
        width = self.num_heads * self.head_dim
        qkv = self.qkv_proj(x)
        if split is not None:  # added in qkv's own layout, so q, k and v keep their strides (and bits)
            zeros = qkv.new_zeros(batch, seq, self.num_heads, self.head_dim)
            qkv = qkv + torch.cat([split.get(part, zeros) for part in "qkv"], dim=-2).flatten(-2)
        q, k, v = (
            t.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
            for t in qkv.split(width, dim=-1)
        )
        return self.attend(q, k, v, inputs)

    def head_input_change(self, part, written, unwritten):
        # Each copy through the shared bottleneck, and then through its own head's rows of up.
        width = self.num_heads * self.head_dim
        index = "qkv".index(part)
        return self.qkv_proj.head_change(written, unwritten, slice(index * width, (index + 1) * width))

    # TransformerLens's weights, through the factored projections: exact with each bottleneck's
    # LayerNorm scale frozen at its value for the input (`qkv_proj.norm.norm_scale`,
    # `o_proj.norm.norm_scale`), as TransformerLens freezes a LayerNorm's scale for attribution.
    # q_h = x W_Q[h] / scale + b_Q[h]; W_Q's A factor is a view of qkv_proj.down (edits write
    # through), its B factor is derived from up and the bottleneck's weight (FactoredProjection.factors).
    def _qkv(self, part: int) -> FactoredMatrix:
        a, b = self.qkv_proj.factors
        width = self.num_heads * self.head_dim
        b = b[:, part * width:(part + 1) * width].view(-1, self.num_heads, self.head_dim).transpose(0, 1)
        return FactoredMatrix(a, b)

    W_Q = property(lambda self: self._qkv(0))
    W_K = property(lambda self: self._qkv(1))
    W_V = property(lambda self: self._qkv(2))
    _W_K = W_K_expanded = W_K  # keys and values have a head per query head
    _W_V = W_V_expanded = W_V
    b_Q = property(lambda self: self.qkv_proj.out_bias().view(3, self.num_heads, self.head_dim)[0])
    b_K = property(lambda self: self.qkv_proj.out_bias().view(3, self.num_heads, self.head_dim)[1])
    b_V = property(lambda self: self.qkv_proj.out_bias().view(3, self.num_heads, self.head_dim)[2])
    b_O = property(lambda self: self.o_proj.out_bias())

    @property
    def W_O(self) -> FactoredMatrix:
        """[head head_dim hidden_size]: head h's share of o_proj, z_h W_O[h] / scale summed over heads
        plus b_O being the output (the rows of A are views of o_proj.down)."""
        a, b = self.o_proj.factors
        return FactoredMatrix(a.view(self.num_heads, self.head_dim, -1), b)

    QK = property(lambda self: self.W_Q @ self.W_K.T)
    OV = property(lambda self: self.W_V @ self.W_O)
