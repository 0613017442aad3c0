"""RMSNorm and LayerNorm, each exposing TransformerLens's `hook_scale` and `hook_normalized` values."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from hooked_models.hooks import HookedModule, ValueHook
from hooked_models.vocabulary import Value


class RMSNorm(HookedModule):
    """x / sqrt(mean(x²) + eps) · weight, computed in float32 and cast back before the weight.

    The arithmetic is transformers' `LlamaRMSNorm`, step for step (float32, multiply by `rsqrt`,
    cast, then the weight), so the output is transformers' bit for bit in every dtype, hooked or
    not: a hook that reads the scale leaves the numbers as they were. A hook that writes the scale
    makes the normalized value x / (the written scale), TransformerLens's meaning of `hook_scale`.
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
        inverse = torch.rsqrt(variance)
        if self.norm_scale.has_hooks():
            # scale / hooked scale is exactly 1 unless a hook wrote it (the hook gets its own tensor,
            # so an in-place write counts too); multiplying by 1 changes no bit.
            scale = variance.sqrt()
            inverse = inverse * (scale / self.norm_scale(scale.clone()))
        return self.weight * self.norm_normalized((x32 * inverse).to(x.dtype))

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class LayerNorm(HookedModule):
    """(x - mean) / sqrt(var + eps) · weight + bias, as `torch.nn.LayerNorm` computes it.

    Works over the last dimension of any shape, so it serves the residual stream and alpha-er's
    rank-r bottlenecks alike; `normalized` is the Value its normalized output carries (a norm on a
    bottleneck declares one with the bottleneck's layout).

    The output is always torch's fused `layer_norm` (what the reference's `nn.LayerNorm` runs), so
    it is the reference's bit for bit whether hooked or not. When a hook reads or writes the scale
    or the normalized value, both are also computed written out (float32 statistics) for the hooks,
    and what a hook writes is carried into the output: a normalized value a hook returns becomes
    written · weight + bias; a scale written, or a normalized value edited in place, moves the
    output by (written normalized - computed normalized) · weight, exactly zero when hooks only read.
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
        given = (centred / self.norm_scale(scale.clone())).to(x.dtype)
        written = self.norm_normalized(given)
        if written is not given:  # a replacement: TransformerLens's arithmetic on it, exactly
            return written * self.weight + self.bias
        return output + (written - computed) * self.weight

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
