"""Arcee AFM (`ArceeForCausalLM`): Llama's block with an ungated squared-ReLU MLP.

What differs from Llama: the MLP has no gate_proj; it is down_proj(relu(up_proj(x))²), so a neuron
is exactly zero wherever its pre-activation is negative. AFM-4.5B has 20 query heads over 4
key/value heads, 128 wide, and stretches its rotary with YaRN (factor 20 over 4096 positions).
Extra hooks beyond the standard vocabulary: none of its own; the components add the norms'
scale/normalized, pre-rotary queries/keys, the MLP pre-activation and per-head results.
Reference: transformers `models/arcee/modeling_arcee.py`; the nnterp family page in shared/seeds.
"""

import os
import torch
import torch.nn as nn
from jaxtyping import Float, Int
from torch import Tensor

from hooked_models.components import (
    AttentionInputs,
    GroupedQueryAttention,
    PreNormBlock,
    ReLUSquared,
    RMSNorm,
    RotaryEmbedding,
    UngatedMLP,
)
from hooked_models.components.attention import causal_mask
from hooked_models.config import ArceeConfig, RopeConfig
from hooked_models.components.kv_cache import KeyValueCache
from hooked_models.hooks import ValueHook
from hooked_models.model import HookedModel


# arcee-ai/AFM-4.5B: YaRN factor 20 over 4096 original positions, stretched to 65536.
AFM_4_5B = ArceeConfig(
    vocab_size=128005,
    rope=RopeConfig("yarn", theta=10000.0, factor=20.0, original_max_position_embeddings=4096),
    bos_token_id=128000,
)
# arcee-ai/AFM-4.5B-Base-Pre-Anneal: the plain rotary over 4096 positions.
AFM_4_5B_PRE_ANNEAL = ArceeConfig(vocab_size=128256, max_position_embeddings=4096, bos_token_id=128000)


def positions_from_mask(attention_mask: Tensor | None, batch: int, seq: int, device) -> Int[Tensor, "batch seq"]:
    """Each row's positions count from its first real token (padding gets position 0)."""
    if attention_mask is None:
        return torch.arange(seq, device=device).expand(batch, seq)
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


class HookedArcee(HookedModel):
    """A hooked Arcee AFM: the module tree and hooks of the standard vocabulary.

    Load with `HookedArcee.from_pretrained(path)` or `HookedArcee.from_hf(model)`.
    `generate` decodes with a key/value cache (see hooked_models/generation.py).
    """

    supports_kv_cache = True

    def __init__(self, cfg: ArceeConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([
            PreNormBlock(
                self_attn=GroupedQueryAttention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
                mlp=UngatedMLP(cfg.hidden_size, cfg.intermediate_size, ReLUSquared()),
                input_layernorm=RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
                post_attention_layernorm=RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
            )
            for _ in range(cfg.num_layers)
        ])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary_emb = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
        self.tie_weights()
        for name in ("logits", "token_embeddings", "final_norm_output", "lm_head_output", "next_token_probs",
                     "input_ids", "attention_mask", "input_size"):
            setattr(self, name, ValueHook(name))
        self.to(dtype=cfg.dtype)
        self.setup()

    def tie_weights(self):
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def norm_readers(self) -> list[tuple[nn.Module, list[nn.Linear]]]:
        """Each norm and the projections that read its output (what `fold_ln` folds it into)."""
        pairs = [(self.norm, [self.lm_head])]
        for layer in self.layers:
            attn = layer.self_attn
            pairs.append((layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj]))
            pairs.append((layer.post_attention_layernorm, [layer.mlp.up_proj]))
        return pairs

    def _embed(self, tokens: Int[Tensor, "batch seq"], past: int) -> Float[Tensor, "batch seq hidden_size"]:
        return self.token_embeddings(self.embed_tokens(tokens))

    def _attention_inputs(self, batch: int, seq: int, attention_mask: Int[Tensor, "batch seq"] | None, device,
                          dtype: torch.dtype, past_kv_cache: KeyValueCache | None = None) -> AttentionInputs:
        total, window = seq, None
        if past_kv_cache is not None:
            # The mask and positions now span the cached positions too; the new ones are the last.
            total = past_kv_cache.length + seq
            attention_mask = past_kv_cache.extend_mask(attention_mask, batch, seq, device)
            window = (past_kv_cache.length - seq, total)
        positions = positions_from_mask(attention_mask, batch, total, device)[:, total - seq:]
        cos, sin = self.rotary_emb(positions, dtype)
        return AttentionInputs(mask=causal_mask(attention_mask, seq, device), cos=cos, sin=sin,
                               kv_cache=past_kv_cache, window=window)

    @classmethod
    def from_hf(cls, hf_model, dtype: torch.dtype | str | None = None, device=None,
                n_devices: int | None = None) -> "HookedArcee":
        """From an in-memory transformers `ArceeForCausalLM` (its weights are copied). `n_devices`
        spreads the layers over that many GPUs in contiguous groups, as TransformerLens does. `dtype`
        is a torch dtype or a name ("bfloat16", "bf16", "fp16": hooked_models.dtypes); `device` must
        exist here ("cuda" without CUDA is a ValueError naming the devices there are)."""
        from weight_conversion.arcee import load_from_hf_model

        return load_from_hf_model(hf_model, dtype=dtype, device=device, n_devices=n_devices, build=_build_on_meta)

    @classmethod
    def from_pretrained(cls, path_or_id: str | os.PathLike, dtype: torch.dtype | str | None = None, device=None,
                        progress: bool | None = None, n_devices: int | None = None) -> "HookedArcee":
        """From an HF checkpoint directory (config.json, one or many safetensors shards, tokenizer),
        or a Hub id already in the local HF cache (offline). Streams shard by shard into a model
        built on the meta device, so peak memory stays near one copy of the weights. `n_devices`
        spreads the layers over cuda:0..n-1 (from `device`) in contiguous groups, as TransformerLens
        does; the residual stream moves between them. `dtype` is a torch dtype or a name ("bfloat16",
        "bf16", "fp16": hooked_models.dtypes); `device` must exist here ("cuda" without CUDA is a
        ValueError naming the devices there are).

        `"embedded"` names the small IOI model shipped in the package (`hooked_models.embedded`),
        an HF directory loaded by the same code."""
        from hooked_models.embedded import resolve_embedded
        from weight_conversion.arcee import load_arcee_checkpoint

        return load_arcee_checkpoint(resolve_embedded(path_or_id, "arcee"), dtype=dtype, device=device,
                                     progress=progress, n_devices=n_devices, build=_build_on_meta)

    def save_pretrained(self, path: str | os.PathLike, max_shard_size: int | str = "5GB") -> None:
        """Write an HF checkpoint (config.json + safetensors) that `ArceeForCausalLM` loads."""
        from weight_conversion.arcee import save_arcee_checkpoint

        save_arcee_checkpoint(self, path, max_shard_size=max_shard_size)


def _build_on_meta(cfg: ArceeConfig) -> HookedArcee:
    """The model with no storage yet (meta device): the loaders stream each tensor into it."""
    with torch.device("meta"):
        return HookedArcee(cfg)
