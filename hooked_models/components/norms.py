"""RMSNorm and LayerNorm, each exposing TransformerLens's `hook_scale` and `hook_normalized` values."""

import torch
import torch.nn as nn
from jaxtyping import Float
from torch import Tensor

from hooked_models.hooks import HookedModule, ValueHook
from hooked_models.vocabulary import Value


class RMSNorm(HookedModule):
    """x / sqrt(mean(x²) + eps) · weight, computed in float32 and cast back before the weight.

    The float32 round trip and the order (cast, then multiply by the weight) follow transformers'
    `LlamaRMSNorm`, so bfloat16 outputs match it closely.
    """

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.norm_scale = ValueHook("norm_scale")
        self.norm_normalized = ValueHook("norm_normalized")

    def forward(self, x: Float[Tensor, "batch seq hidden_size"]) -> Float[Tensor, "batch seq hidden_size"]:
        x32 = x.float()
        scale = self.norm_scale((x32.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        normalized = self.norm_normalized((x32 / scale).to(x.dtype))
        return self.weight * normalized

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class LayerNorm(HookedModule):
    """(x - mean) / sqrt(var + eps) · weight + bias, as `torch.nn.LayerNorm` computes it.

    Works over the last dimension of any shape, so it serves the residual stream and alpha-er's
    rank-r bottlenecks alike; `normalized` is the Value its normalized output carries (a norm on a
    bottleneck declares one with the bottleneck's layout).
    """

    def __init__(self, size: int, eps: float, normalized: Value | str = "norm_normalized"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size))
        self.eps = eps
        self.norm_scale = ValueHook("norm_scale")
        self.norm_normalized = ValueHook(normalized)

    def forward(self, x: Float[Tensor, "*batch features"]) -> Float[Tensor, "*batch features"]:
        x32 = x.float()
        centred = x32 - x32.mean(-1, keepdim=True)
        scale = self.norm_scale((centred.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        normalized = self.norm_normalized((centred / scale).to(x.dtype))
        return normalized * self.weight + self.bias

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
