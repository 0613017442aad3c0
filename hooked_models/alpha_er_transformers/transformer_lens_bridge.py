"""alpha-er under TransformerLens's TransformerBridge (4.x, and 3.9): a small architecture adapter.

    from hooked_models.alpha_er_transformers.transformer_lens_bridge import register
    register()
    bridge = TransformerBridge.boot_transformers("path/to/alpha-er-hf", device="cpu")
    logits, cache = bridge.run_with_cache(tokens)   # tokens: [batch, T], T a multiple of mlp_experts

What the bridge gives: TransformerLens's module names and the hooks around whole modules (hook_embed,
hook_pos_embed, blocks.{i}.hook_resid_pre/mid/post, hook_attn_out, hook_mlp_out, attn.hook_pattern and
hook_attn_scores, the norms' hook_scale and hook_normalized, ln_final, hook_unembed), within float32
rounding of the model: its NormalizationBridge recomputes each LayerNorm in separate operations (to expose
hook_scale) where the model calls F.layer_norm (measured: 4e-7 of the largest logit on the embedded alpha-er).
What it does not: W_U / b_U (the head is factored, up(LayerNorm(down(x))): no matrix is the unembedding),
hook_q/k/v/z and the MLP's hook_pre/post (the attention and the experts run as the model's own modules,
which the bridge wraps whole), weight processing (fold_ln and the like: none is declared), and
`generate`, whose key/value cache alpha-er refuses; HookedAlphaEr has all of these.
Needs `transformer_lens.model_bridge`: tested under TransformerLens 4.3 and 3.9 (the sae extra's).
"""

from transformer_lens.factories import architecture_adapter_factory
from transformer_lens.factories.architecture_adapter_factory import ArchitectureAdapterFactory
from transformer_lens.model_bridge.architecture_adapter import ArchitectureAdapter
from transformer_lens.model_bridge.generalized_components import (
    AttentionBridge,
    BlockBridge,
    EmbeddingBridge,
    MLPBridge,
    NormalizationBridge,
    PosEmbedBridge,
    UnembeddingBridge,
)

ARCHITECTURE = "AlphaErForCausalLM"


class FactoredUnembeddingBridge(UnembeddingBridge):
    """The factored LM head, wrapped whole: it has no weight matrix, so W_U and b_U are absent (an
    AttributeError, which the bridge's hook scan skips) rather than wrong."""

    @property
    def W_U(self):
        raise AttributeError("alpha-er's LM head is factored, up(LayerNorm(down(x))): it has no W_U")

    @property
    def b_U(self):
        raise AttributeError("alpha-er's LM head is factored, up(LayerNorm(down(x))): it has no b_U")


class WholeAttentionBridge(AttentionBridge):
    """alpha-er's attention wrapped whole: its fused, factored QKV has no q/k/v/o submodules, so the
    hook_q/k/v/z aliases are not declared (declared, each would warn at boot that it does not resolve, and
    the bridge would then warn that a per-layer alias falls back to "the wrong tensor"; reading one raises
    KeyError either way)."""

    hook_aliases: dict = {}


class WholeMLPBridge(MLPBridge):
    """alpha-er's positional experts wrapped whole: no in/out submodules, so no hook_pre/hook_post aliases
    (as WholeAttentionBridge's)."""

    hook_aliases: dict = {}


class AlphaErArchitectureAdapter(ArchitectureAdapter):
    """AlphaErForCausalLM's modules under TransformerLens's names; LayerNorm with bias, learned positions."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.cfg.normalization_type = "LN"
        self.cfg.positional_embedding_type = "standard"
        self.cfg.final_rms = False
        self.cfg.gated_mlp = False
        self.cfg.attn_only = False
        self.weight_processing_conversions = {}
        self.component_mapping = {
            "embed": EmbeddingBridge(name="model.embed_tokens"),
            "pos_embed": PosEmbedBridge(name="model.embed_positions"),
            "blocks": BlockBridge(name="model.layers", submodules={
                "ln1": NormalizationBridge(name="input_layernorm", config=self.cfg),
                "ln2": NormalizationBridge(name="post_attention_layernorm", config=self.cfg),
                "attn": WholeAttentionBridge(name="self_attn", config=self.cfg),
                "mlp": WholeMLPBridge(name="mlp"),
            }),
            "ln_final": NormalizationBridge(name="model.norm", config=self.cfg),
            "unembed": FactoredUnembeddingBridge(name="lm_head"),
        }


def register() -> None:
    """Register the adapter for AlphaErForCausalLM (and the transformers classes with the Auto classes)."""
    import hooked_models.alpha_er_transformers  # noqa: F401  (AutoModelForCausalLM must know alpha-er)

    ArchitectureAdapterFactory.register_adapter(ARCHITECTURE, AlphaErArchitectureAdapter)
    # TransformerLens 4.3's boot_transformers finds the architecture in SUPPORTED_ARCHITECTURES, which
    # register_adapter does not update: without this entry it refuses a registered architecture.
    architecture_adapter_factory.SUPPORTED_ARCHITECTURES[ARCHITECTURE] = AlphaErArchitectureAdapter
