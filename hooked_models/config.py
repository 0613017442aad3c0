"""What every family's config shares: TransformerLens's names for the standardized fields."""

from dataclasses import replace


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
