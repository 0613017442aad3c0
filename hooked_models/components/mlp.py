"""MLPs: the ungated two-projection MLP with a pluggable activation (Arcee's relu², GPT's GELU)."""

import torch
import torch.nn as nn
from jaxtyping import Float
from torch import Tensor

from hooked_models.hooks import HookedModule, ValueHook


class ReLUSquared(nn.Module):
    """relu(x)², as in Primer (So et al. 2021): exactly zero below zero, so an off neuron gets no gradient."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.square(torch.relu(x))


class UngatedMLP(HookedModule):
    """down_proj(act(up_proj(x))): no gate, so `mlp_neurons` is the activation itself."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: nn.Module, bias: bool = False):
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = activation
        self.mlp_pre_activation = ValueHook("mlp_pre_activation")
        self.mlp_activation = ValueHook("mlp_activation")
        self.mlp_neurons = ValueHook("mlp_neurons")
        self.mlp_output = ValueHook("mlp_output")

    def forward(self, x: Float[Tensor, "batch seq hidden_size"]) -> Float[Tensor, "batch seq hidden_size"]:
        pre = self.mlp_pre_activation(self.up_proj(x))
        neurons = self.mlp_neurons(self.mlp_activation(self.act_fn(pre)))
        return self.mlp_output(self.down_proj(neurons))
