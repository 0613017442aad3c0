"""alpha-er's transformers configuration.

Self-contained (transformers only): `save_pretrained` copies this file beside the weights, so that
`AutoConfig.from_pretrained(dir, trust_remote_code=True)` reads it where hooked_models is not installed.
The same file serves transformers 4.57 and 5.x. Fields take Llama's names where Llama has the concept
(`hidden_size`, `num_hidden_layers`, ...), so tools written for transformers find them; the reference
checkpoint's names (`n_embd`, `n_layer`, ...) are read-only aliases.
"""

from transformers import PretrainedConfig

# The reference's field names (its checkpoint header) -> this config's.
REFERENCE_NAMES = {
    "block_size": "max_position_embeddings",
    "n_layer": "num_hidden_layers",
    "n_embd": "hidden_size",
    "n_head": "num_attention_heads",
    "ffn_dim": "intermediate_size",
}

# What transformers itself passes to a config (its own fields, loader options, legacy keys): a
# field beyond these and this config's own is refused instead of silently kept.
_TRANSFORMERS_FIELDS = {
    *PretrainedConfig().to_dict(), "auto_map", "torch_dtype", "dtype", "attn_implementation",
    "experts_implementation", "name_or_path", "_name_or_path", "_commit_hash", "num_labels", "transformers_version",
    "model_type", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id", "tokenizer_class",
    "_attn_implementation_autoset",
}


class AlphaErConfig(PretrainedConfig):
    r"""The configuration of an [`AlphaErForCausalLM`]; the defaults are the released alpha-er.

    Args:
        vocab_size: the number of tokens.
        max_position_embeddings: the number of learned positions (the reference's `block_size`);
            `generate` pads every window to this length.
        num_hidden_layers: the number of blocks (the reference's `n_layer`).
        hidden_size: the residual width (the reference's `n_embd`).
        num_attention_heads: the number of heads (the reference's `n_head`).
        intermediate_size: the width of all experts together (the reference's `ffn_dim`).
        mlp_experts: the number of positional experts G; a sequence's length must be a multiple of it.
        head_dim: derived (hidden_size / num_attention_heads) and stored as Llama stores it; another value is
            refused.
        num_key_value_heads: derived (num_attention_heads: no grouping) and stored as Llama stores it; another
            value is refused.
        lm_head_rank: the bottleneck rank of the factored LM head.
        attn_rank: the bottleneck rank of qkv and of the output projection.
        attn_soft_cap: scores become tanh(s/cap)·cap before the softmax; 0 turns the cap off.
        layer_norm_eps: the epsilon of every LayerNorm, the bottlenecks' included.
    """

    model_type = "alpha-er"
    attribute_map = dict(REFERENCE_NAMES)
    # Fixed by the architecture, so not fields: tools written for transformers read them.
    hidden_act = "gelu_pytorch_tanh"

    def __init__(
        self,
        vocab_size: int = 12288,
        max_position_embeddings: int = 512,
        num_hidden_layers: int = 2,
        hidden_size: int = 1024,
        num_attention_heads: int = 8,
        intermediate_size: int = 20480,
        mlp_experts: int = 64,
        lm_head_rank: int = 128,
        attn_rank: int = 128,
        attn_soft_cap: float | int = 30.0,
        layer_norm_eps: float | int = 1e-5,
        initializer_range: float = 0.02,
        pad_token_id: int | None = 0,
        tie_word_embeddings: bool = False,
        use_cache: bool = False,
        head_dim: int | None = None,
        num_key_value_heads: int | None = None,
        **kwargs,
    ):
        model_type = kwargs.get("model_type", self.model_type)
        if model_type != self.model_type:
            raise ValueError(f"model_type={model_type!r}: this is not an alpha-er config (model_type "
                             f"{self.model_type!r}); load it with its own family's class")
        unknown = sorted(set(kwargs) - _TRANSFORMERS_FIELDS)
        if unknown:
            renamed = {name: REFERENCE_NAMES[name] for name in unknown if name in REFERENCE_NAMES}
            hint = f" ({', '.join(f'{a} is called {b} here' for a, b in renamed.items())})" if renamed else ""
            raise ValueError(f"AlphaErConfig does not know the field(s) {unknown}{hint}")
        self.vocab_size = vocab_size
        self.max_position_embeddings = max_position_embeddings
        self.num_hidden_layers = num_hidden_layers
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.mlp_experts = mlp_experts
        self.lm_head_rank = lm_head_rank
        self.attn_rank = attn_rank
        self.attn_soft_cap = float(attn_soft_cap)
        self.layer_norm_eps = float(layer_norm_eps)
        self.initializer_range = initializer_range
        # No key/value cache: a token's expert depends on the whole length T (see the modeling file).
        self.use_cache = use_cache
        # Derived, stored as Llama's config stores them (tools read them from config.json): any other value is refused.
        self.head_dim = hidden_size // num_attention_heads if head_dim is None else head_dim
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self._check()
        super().__init__(pad_token_id=pad_token_id, tie_word_embeddings=tie_word_embeddings, **kwargs)

    def _check(self) -> None:
        for name in ("vocab_size", "max_position_embeddings", "num_hidden_layers", "hidden_size",
                     "num_attention_heads", "intermediate_size", "mlp_experts", "lm_head_rank", "attn_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.attn_soft_cap < 0:
            raise ValueError(f"attn_soft_cap={self.attn_soft_cap} must be >= 0 (0 turns the cap off)")
        if self.layer_norm_eps <= 0:
            raise ValueError(f"layer_norm_eps={self.layer_norm_eps} must be > 0")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.head_dim * self.num_attention_heads != self.hidden_size:
            raise ValueError(f"head_dim={self.head_dim} must be hidden_size/num_attention_heads="
                             f"{self.hidden_size // self.num_attention_heads}")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(f"num_key_value_heads={self.num_key_value_heads} must equal num_attention_heads="
                             f"{self.num_attention_heads}: alpha-er has no grouped-query attention")
        if self.intermediate_size % self.mlp_experts:
            raise ValueError(f"intermediate_size={self.intermediate_size} is not divisible by "
                             f"mlp_experts={self.mlp_experts}: each expert is intermediate_size/mlp_experts wide")
        if self.max_position_embeddings % self.mlp_experts:
            raise ValueError(f"max_position_embeddings={self.max_position_embeddings} is not divisible by "
                             f"mlp_experts={self.mlp_experts}: generation pads to it, which must split into "
                             "mlp_experts windows")


__all__ = ["AlphaErConfig"]
