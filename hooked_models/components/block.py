"""The pre-norm residual block, composed from the modules it is given."""

import torch.nn as nn
from jaxtyping import Float
from torch import Tensor

from hooked_models.components.attention import AttentionInputs
from hooked_models.hooks import HookedModule, ValueHook


class PreNormBlock(HookedModule):
    """h = x + self_attn(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h)).

    The contributions are added with nothing in between, so
    `layer_input + attention_output + mlp_output == layer_output` holds exactly. Split inputs
    (per-head copies of x that each head's query, key and value read, and the MLP branch's own copy
    of h) are made only while hooked: `self_attn.split_inputs` and `mlp_residual_input`.
    """

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, input_layernorm: nn.Module,
                 post_attention_layernorm: nn.Module):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm
        for name in ("layer_input", "attention_norm_output", "layer_mid", "mlp_norm_output", "mlp_input",
                     "layer_output", "mlp_residual_input"):
            setattr(self, name, ValueHook(name))

    # TransformerLens's module names, as read-only views of the same modules.
    attn = property(lambda self: self.self_attn)
    ln1 = property(lambda self: self.input_layernorm)
    ln2 = property(lambda self: self.post_attention_layernorm)

    def forward(
        self, x: Float[Tensor, "batch seq hidden_size"], inputs: AttentionInputs
    ) -> Float[Tensor, "batch seq hidden_size"]:
        x = self.layer_input(x)
        # Per-head copies of x (split inputs), only where hooked; None costs nothing.
        split = self.self_attn.split_inputs(x, self.input_layernorm)
        attention_output = self.self_attn(self.attention_norm_output(self.input_layernorm(x)), inputs, split)
        h = self.layer_mid(x + attention_output)
        # The MLP branch's own copy of h (TransformerLens's hook_mlp_in), only where hooked.
        branch = self.mlp_residual_input(h.clone()) if self.mlp_residual_input.has_hooks() else h
        mlp_in = self.mlp_input(self.mlp_norm_output(self.post_attention_layernorm(branch)))
        return self.layer_output(h + self.mlp(mlp_in, inputs))
