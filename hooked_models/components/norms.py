"""RMSNorm and LayerNorm, each exposing TransformerLens's `hook_scale` and `hook_normalized` values."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from hooked_models.hooks import HookedModule, ValueHook
from hooked_models.vocabulary import Value


def value_of_gradient_of(value: Tensor, gradient_of: Tensor) -> Tensor:
    """`value`'s bits with `gradient_of`'s gradient (the two equal in value where it matters).

    value + (g - g.detach()) adds an exact zero forward, so a norm whose scale a hook wrote with
    an equal value (a detached copy) keeps the reference's output bit for bit, yet backpropagates
    through the written scale, as a constant if it was detached.
    """
    return value.detach() + (gradient_of - gradient_of.detach())


class RMSNorm(HookedModule):
    """x / sqrt(mean(x²) + eps) · weight, computed in float32 and cast back before the weight.

    The arithmetic is transformers' `LlamaRMSNorm`, step for step (float32, multiply by `rsqrt`,
    cast, then the weight), so the output is transformers' bit for bit in every dtype, hooked or
    not: a hook that reads the scale leaves the numbers as they were. Where a hook writes the scale,
    the normalized value is x / (the written scale), TransformerLens's meaning and arithmetic of
    `hook_scale`, exactly. Any write is honoured, even of an equal value: the gradient then flows
    through x / (the written scale), so `scale.detach()` freezes the scale (TransformerLens's idiom
    for attribution) while the forward keeps the reference's bits.
    """

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.norm_scale = ValueHook("norm_scale")
        self.norm_normalized = ValueHook("norm_normalized")

    def forward(self, x: Float[Tensor, "batch seq hidden_size"]) -> Float[Tensor, "batch seq hidden_size"]:
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True) + self.eps
        if self.norm_scale.has_hooks():
            # Where the hook left the scale as it was, the reference's arithmetic stands (no bit
            # changes); where it wrote one, TransformerLens's: x / scale. The hook gets its own
            # tensor, so an in-place write counts too.
            scale = variance.sqrt()
            given = scale.clone()
            written = self.norm_scale(given)
            if written is not given or not torch.equal(given, scale):
                return self.weight * self.norm_normalized(self._written(x32, variance, scale, written).to(x.dtype))
        return self.weight * self.norm_normalized((x32 * torch.rsqrt(variance)).to(x.dtype))

    @staticmethod
    def _written(x32: Tensor, variance: Tensor, scale: Tensor, written: Tensor) -> Tensor:
        """The normalized value where a hook wrote the scale: x / written, and the reference's x * rsqrt
        where it wrote the value computed; with a gradient through the written scale where one is taken
        (with none, the same values: neither the gradient's exact zero is added nor the reference's
        product formed where no scale is the computed one)."""
        divided = x32 / written
        same = written == scale
        if torch.is_grad_enabled() and (x32.requires_grad or written.requires_grad):
            return value_of_gradient_of(torch.where(same, x32 * torch.rsqrt(variance), divided), divided)
        if not bool(same.any()):
            return divided
        if same.shape != variance.shape:  # a scale of another shape, broadcast: every element compared
            return torch.where(same, x32 * torch.rsqrt(variance), divided)
        # The reference's product at the few positions where the written scale is the computed one (a
        # decomposition's rows: an embedding alone at layer 0), not over the whole batch.
        at = same[..., 0].nonzero(as_tuple=True)
        divided[at] = x32[at] * torch.rsqrt(variance[at])
        return divided

    def forward_unhooked(self, x: Float[Tensor, "*batch hidden_size"]) -> Float[Tensor, "*batch hidden_size"]:
        """The same arithmetic with no hook firing: what per-head copies of the stream go through
        (the norm's values are those of the stream itself, not of its copies)."""
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class LayerNorm(HookedModule):
    """(x - mean) / sqrt(var + eps) · weight + bias, as `torch.nn.LayerNorm` computes it.

    Works over the last dimension of any shape, so it serves the residual stream and alpha-er's
    rank-r bottlenecks alike; `normalized` is the Value its normalized output carries (a norm on a
    bottleneck declares one with the bottleneck's layout).

    The output is torch's fused `layer_norm` (what the reference's `nn.LayerNorm` runs), so it is
    the reference's bit for bit whether hooked or not. When a hook reads or writes the scale or the
    normalized value, both are also computed written out (float32 statistics) for the hooks, and
    what a hook writes is carried into the output with TransformerLens's arithmetic: wherever the
    normalized value differs from the computed one (written, edited in place, or divided by a
    written scale), the output is written · weight + bias; elsewhere it stays the fused output.
    Once a hook returns a tensor of its own, even one of equal value (`scale.detach()`), the
    gradient is that of written · weight + bias everywhere: a detached scale is a frozen one.
    """

    def __init__(self, size: int, eps: float, normalized: Value | str = "norm_normalized"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size))
        self.eps = eps
        self.norm_scale = ValueHook("norm_scale")
        self.norm_normalized = ValueHook(normalized)

    def forward(self, x: Float[Tensor, "*batch features"]) -> Float[Tensor, "*batch features"]:
        output = F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
        if not (self.norm_scale.has_hooks() or self.norm_normalized.has_hooks()):
            return output
        x32 = x.float()
        centred = x32 - x32.mean(-1, keepdim=True)
        scale = (centred.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()
        computed = (centred / scale).to(x.dtype)
        # The hooks get tensors of their own, so an in-place write is a write too.
        given_scale = scale.clone()
        written_scale = self.norm_scale(given_scale)
        given = (centred / written_scale).to(x.dtype)
        written = self.norm_normalized(given)
        replaced = written * self.weight + self.bias
        output = torch.where(written == computed, output, replaced)
        if written is not given or written_scale is not given_scale or not torch.equal(given_scale, scale):
            output = value_of_gradient_of(output, replaced)
        return output

    def forward_unhooked(self, x: Float[Tensor, "*batch features"]) -> Float[Tensor, "*batch features"]:
        """The same arithmetic with no hook firing (per-head copies of the stream go through it)."""
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
