"""The factored projection: a rank-r bottleneck with a LayerNorm inside, in place of a dense matrix.

x @ down.T -> LayerNorm on the r-dimensional bottleneck (its own weight and bias) -> @ up.T.
alpha-er uses it for qkv, the attention output and the LM head; its reference explains that the
norm is what made the factored form train at all (shared/seeds: alpha-er, "FACTORED PROJECTIONS").
"""

import torch
import torch.nn as nn
from jaxtyping import Float
from torch import Tensor

from hooked_models.components.norms import LayerNorm
from hooked_models.hooks import HookedModule, ValueHook
from hooked_models.vocabulary import declare_values

# The bottleneck's values, in the vocabulary's form. `norm_normalized` of the bottleneck's own
# LayerNorm is r wide, so it gets the Bottleneck layout rather than the residual one.
BOTTLENECK_VALUES = {
    **declare_values("projection", [
        ("bottleneck", "Bottleneck", "The rank-r bottleneck x @ down.T, before its LayerNorm",
         "the child module norm's input"),
        ("bottleneck_normed", "Bottleneck", "The bottleneck after its LayerNorm, what up reads",
         "the child module norm's output"),
    ]),
    **declare_values("norm", [
        ("norm_normalized", "Bottleneck", "The normalized bottleneck before the norm's weight and bias",
         "inside the norm", dict(tl="hook_normalized")),
    ]),
}


class FactoredProjection(HookedModule):
    """up(LayerNorm(down(x))): weights `down` [rank in_features] and `up` [out_features rank], F.linear's layout."""

    def __init__(self, in_features: int, rank: int, out_features: int, eps: float):
        super().__init__()
        self.in_features, self.rank, self.out_features = in_features, rank, out_features
        self.down = nn.Parameter(torch.empty(rank, in_features))
        self.norm = LayerNorm(rank, eps, normalized=BOTTLENECK_VALUES["norm_normalized"])
        self.up = nn.Parameter(torch.empty(out_features, rank))
        # Biases alpha-er does not have; `fold_ln` creates them when it folds a LayerNorm's bias in.
        self.register_parameter("down_bias", None)
        self.register_parameter("up_bias", None)
        self.bottleneck = ValueHook(BOTTLENECK_VALUES["bottleneck"])
        self.bottleneck_normed = ValueHook(BOTTLENECK_VALUES["bottleneck_normed"])

    def forward(self, x: Float[Tensor, "*batch in_features"]) -> Float[Tensor, "*batch out_features"]:
        z = self.bottleneck(nn.functional.linear(x, self.down, self.down_bias))
        return nn.functional.linear(self.bottleneck_normed(self.norm(z)), self.up, self.up_bias)

    def head_results(
        self, x: Float[Tensor, "batch seq num_heads head_dim"],
        output: Float[Tensor, "batch seq out_features"] | None = None,
    ) -> Float[Tensor, "batch seq num_heads out_features"]:
        """Each head's term of the output when the heads, side by side, are the input.

        The bottleneck's LayerNorm is linear once its mean and scale are fixed, so, with the scale
        of the whole bottleneck (as TransformerLens freezes a LayerNorm's scale for attribution),
        head h contributes up(norm.weight · (z_h - mean z_h) / scale). The forward runs as usual,
        every hook inside the projection firing; what the head terms miss of its output (rounding,
        or what such a hook wrote) is shared equally among the heads, so the terms plus `out_bias()`
        sum to the forward's output (`output`, when the caller ran it already).
        """
        if output is None:
            output = self(x.flatten(-2))
        heads = x.shape[-2]
        z_heads = torch.einsum("bshd,rhd->bshr", x, self.down.view(self.rank, heads, -1))
        z = z_heads.sum(-2, keepdim=True).float()
        scale = ((z - z.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True) + self.norm.eps).sqrt()
        normalized = ((z_heads - z_heads.mean(-1, keepdim=True)).float() / scale).to(x.dtype)
        terms = torch.einsum("bshr,or->bsho", normalized * self.norm.weight, self.up)
        rest = output - self.out_bias() - terms.sum(-2)
        return terms + rest.unsqueeze(-2) / heads

    def head_change(
        self, written: Float[Tensor, "*batch heads in_features"], unwritten: Float[Tensor, "*batch heads in_features"],
        rows: slice,
    ) -> Float[Tensor, "*batch heads head_dim"]:
        """How much output `rows`, cut into one equal slice per head, move when head n's input goes
        from `unwritten[..., n, :]` to `written[..., n, :]` (slice n for copy n, each copy through the
        whole bottleneck). Exactly zero where the two are equal: the written bottleneck is the
        unwritten one plus down(written - unwritten), and both are normed in one call. No hook of the
        projection fires (its values are those of the unsplit input)."""
        z = nn.functional.linear(unwritten, self.down, self.down_bias)
        moved = z + nn.functional.linear(written - unwritten, self.down)
        normed = self.norm.forward_unhooked(torch.stack([moved, z]))
        up = self.up[rows].view(written.shape[-2], -1, self.rank)
        return torch.einsum("...nr,ndr->...nd", normed[0] - normed[1], up)

    def out_bias(self) -> Float[Tensor, "out_features"]:
        """The output's constant term: up(norm.bias), which no head owns."""
        return nn.functional.linear(self.norm.bias, self.up, self.up_bias)

    @property
    def factors(self) -> tuple[Float[Tensor, "in_features rank"], Float[Tensor, "rank out_features"]]:
        """(A, B) with out = (x A + down_bias) B / scale + out_bias(), exact with the bottleneck's
        LayerNorm scale frozen at its value for x: A = down.T (a view, so edits write through) and
        B = C diag(norm.weight) up.T, C the centring the LayerNorm applies (derived, a copy)."""
        b = (self.up * self.norm.weight).T
        return self.down.T, b - b.mean(0, keepdim=True)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> rank {self.rank} -> {self.out_features}"
