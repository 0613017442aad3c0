"""Shared components: each family composes these, none branches on a family."""

from hooked_models.components.attention import AttentionInputs, GroupedQueryAttention, SelfAttention
from hooked_models.components.block import PreNormBlock
from hooked_models.components.mlp import ReLUSquared, UngatedMLP
from hooked_models.components.norms import LayerNorm, RMSNorm
from hooked_models.components.rotary import RopeConfig, RotaryEmbedding

__all__ = [
    "AttentionInputs",
    "GroupedQueryAttention",
    "LayerNorm",
    "PreNormBlock",
    "ReLUSquared",
    "RMSNorm",
    "RopeConfig",
    "RotaryEmbedding",
    "SelfAttention",
    "UngatedMLP",
]
