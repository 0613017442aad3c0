"""The families' configs: plain data, below every module that builds from them.

What every config shares (TransformerLens's names for the standardized fields), the rotary parameters,
and each family's config class. They live here, not beside their family, so that the converters
(weight_conversion/) can build them from checkpoint fields without importing a family.
"""

from dataclasses import dataclass, field, fields, replace

import torch


class TransformerLensFields:
    """TransformerLens's field names (`n_layers`, `d_model`, ...) as read-only views of the standardized
    ones (`num_layers`, `hidden_size`, ...), which each family's config defines. TransformerLens's
    utilities read these; a family adds the ones that differ (eps, act_fn, normalization_type, ...)."""

    n_layers = property(lambda self: self.num_layers)
    d_model = property(lambda self: self.hidden_size)
    n_heads = property(lambda self: self.num_heads)
    n_key_value_heads = property(lambda self: self.num_kv_heads)
    d_head = property(lambda self: self.head_dim)
    d_mlp = property(lambda self: self.intermediate_size)
    d_vocab = property(lambda self: self.vocab_size)
    d_vocab_out = property(lambda self: self.vocab_size)
    n_ctx = property(lambda self: self.max_position_embeddings)
    gated_mlp = property(lambda self: False)
    attn_only = property(lambda self: False)

    # TransformerLens's switches (the model's set_use_* set them on its config, where TransformerLens's
    # tools read them): which on-request values a cache-everything run_with_cache includes. Hooks on
    # those values fire whether or not their switch is on; off, they cost nothing.
    use_attn_result = False
    use_split_qkv_input = False
    use_attn_in = False
    use_hook_mlp_in = False

    def with_(self, **changes):
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


ROPE_TYPES = ("default", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary parameters, with transformers' names and defaults.

    `factor` is YaRN's stretch. When it disagrees with max_position_embeddings /
    original_max_position_embeddings (AFM-4.5B: 20 against 65536/4096 = 16), the explicit factor
    wins, as in transformers.
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r} is not supported; supported: {ROPE_TYPES}")
        if self.rope_type == "yarn" and self.original_max_position_embeddings is None:
            raise ValueError("yarn rotary needs original_max_position_embeddings")


@dataclass
class ArceeConfig(TransformerLensFields):
    """The standardized fields of the family page, plus what the family needs.

    TransformerLens's names for the same fields (`n_layers`, `d_model`, ...) are read-only properties.
    """

    num_layers: int = 36
    hidden_size: int = 2560
    num_heads: int = 20
    num_kv_heads: int = 4
    head_dim: int = 128
    vocab_size: int = 128004
    intermediate_size: int = 18432
    max_position_embeddings: int = 65536
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    dtype: torch.dtype | str = torch.float32  # or a name ("bfloat16", "bf16"): hooked_models.dtypes
    device: str | torch.device = "cpu"
    model_name: str = "arcee"

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary")

    @property
    def qk_head_dim(self) -> int:
        return self.head_dim

    # TransformerLens's names beyond the shared ones (TransformerLensFields).
    eps = property(lambda self: self.rms_norm_eps)
    act_fn = property(lambda self: "relu2")
    normalization_type = property(lambda self: "RMS")
    positional_embedding_type = property(lambda self: "rotary")
    rotary_base = property(lambda self: self.rope.theta)
    rotary_dim = property(lambda self: self.head_dim)
    final_rms = property(lambda self: True)
    original_architecture = property(lambda self: "ArceeForCausalLM")


@dataclass
class AlphaErConfig(TransformerLensFields):
    """The reference config's fields (names as in the checkpoint header) and defaults.

    The standardized names (`num_layers`, `hidden_size`, ...) and TransformerLens's (`n_layers`,
    `d_model`, ...) are read-only properties over them.
    """

    vocab_size: int = 12288
    block_size: int = 512
    n_layer: int = 2
    n_embd: int = 1024
    n_head: int = 8
    ffn_dim: int = 20480
    mlp_experts: int = 64
    lm_head_rank: int = 128
    attn_rank: int = 128
    attn_soft_cap: float = 30.0
    layer_norm_eps: float = 1e-5
    dtype: torch.dtype | str = torch.float32  # or a name ("bfloat16", "bf16"): hooked_models.dtypes
    device: str | torch.device = "cpu"
    model_name: str = "alpha-er"

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_embd", "n_head", "ffn_dim", "mlp_experts",
                     "lm_head_rank", "attn_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.attn_soft_cap < 0:
            raise ValueError(f"attn_soft_cap={self.attn_soft_cap} must be >= 0 (0 turns the cap off)")
        if self.layer_norm_eps <= 0:
            raise ValueError(f"layer_norm_eps={self.layer_norm_eps} must be > 0")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.ffn_dim % self.mlp_experts:
            raise ValueError(f"ffn_dim={self.ffn_dim} is not divisible by mlp_experts={self.mlp_experts}: "
                             "each expert is ffn_dim/mlp_experts wide")
        if self.block_size % self.mlp_experts:
            raise ValueError(f"block_size={self.block_size} is not divisible by mlp_experts={self.mlp_experts}: "
                             "generation pads to block_size, which must split into mlp_experts windows")

    # The standardized names.
    num_layers = property(lambda self: self.n_layer)
    hidden_size = property(lambda self: self.n_embd)
    num_heads = property(lambda self: self.n_head)
    num_kv_heads = property(lambda self: self.n_head)
    head_dim = property(lambda self: self.n_embd // self.n_head)
    qk_head_dim = property(lambda self: self.n_embd // self.n_head)
    intermediate_size = property(lambda self: self.ffn_dim)
    expert_width = property(lambda self: self.ffn_dim // self.mlp_experts)
    max_position_embeddings = property(lambda self: self.block_size)

    # TransformerLens's names beyond the shared ones (TransformerLensFields).
    eps = property(lambda self: self.layer_norm_eps)
    act_fn = property(lambda self: "gelu_new")  # TransformerLens's name for the tanh approximation
    normalization_type = property(lambda self: "LN")
    positional_embedding_type = property(lambda self: "standard")
    final_rms = property(lambda self: False)
    original_architecture = property(lambda self: "AlphaErForCausalLM")

    def reference_fields(self) -> dict:
        """The fields the reference config and the checkpoint header carry."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in REFERENCE_FIELDS}


REFERENCE_FIELDS = ("vocab_size", "block_size", "n_layer", "n_embd", "n_head", "ffn_dim", "mlp_experts",
                    "lm_head_rank", "attn_rank", "attn_soft_cap", "layer_norm_eps")
