"""Shared components: each family composes these, none branches on a family."""

from hooked_models.components.attention import (
    AttentionInputs,
    FusedQKVAttention,
    GroupedQueryAttention,
    SelfAttention,
    SoftCap,
)
from hooked_models.components.block import PreNormBlock
from hooked_models.components.factored import FactoredProjection
from hooked_models.components.mlp import ExpertLinear, PositionalExpertMLP, ReLUSquared, UngatedMLP
from hooked_models.components.norms import LayerNorm, RMSNorm
from hooked_models.components.rotary import RopeConfig, RotaryEmbedding

__all__ = [
    "AttentionInputs",
    "ExpertLinear",
    "FactoredProjection",
    "FusedQKVAttention",
    "GroupedQueryAttention",
    "LayerNorm",
    "PositionalExpertMLP",
    "PreNormBlock",
    "ReLUSquared",
    "RMSNorm",
    "RopeConfig",
    "RotaryEmbedding",
    "SelfAttention",
    "SoftCap",
    "UngatedMLP",
]
