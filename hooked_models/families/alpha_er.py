"""alpha-er: a GPT-style pre-norm transformer with factored projections and a positional expert MLP.

What differs from Llama: learned absolute positions instead of rotary; LayerNorm with bias for
ln1, ln2 and ln_f; qkv, the attention output and the LM head are each a rank-r factored projection
(down -> LayerNorm on the bottleneck -> up); attention scores are soft-capped (tanh(s/30)·30) before
the mask; the MLP is 64 experts of width 320, a token at position t of T going to expert
floor(t·64/T), with tanh-approximate GELU. Because the expert boundaries fall at multiples of T/G,
sequence length is part of the architecture: a forward needs T a multiple of `mlp_experts`, and
`generate` pads every window to `block_size` and reads the last real position.
Extra hooks beyond the standard vocabulary: `position_embeddings` (TL `hook_pos_embed`); each
factored projection's `bottleneck` / `bottleneck_normed` and its norm's scale and normalized
bottleneck; `score_mod.attention_raw_scores` (before the cap); `mlp.mlp_expert_index`.
Reference: the alpha-er reference implementation in shared/seeds (004_*.txt).
"""

import torch
import torch.nn as nn
from jaxtyping import Float, Int
from torch import Tensor

from hooked_models.components import (
    AttentionInputs,
    FactoredProjection,
    FusedQKVAttention,
    LayerNorm,
    PositionalExpertMLP,
    PreNormBlock,
    SoftCap,
)
from hooked_models.components.attention import causal_mask
from hooked_models.components.kv_cache import KeyValueCache
from hooked_models.config import REFERENCE_FIELDS, AlphaErConfig  # noqa: F401 (REFERENCE_FIELDS was defined here)
from hooked_models.generation import PaddedWindowDecoder
from hooked_models.hooks import ValueHook
from hooked_models.model import HookedModel
from hooked_models.transformer_lens_compat import BottleneckReadout, FactoredMatrix
from hooked_models.vocabulary import declare_values

ALPHA_ER_VALUES = declare_values("model", [
    ("position_embeddings", "Residual",
     "The learned position embeddings; layers[0].input is token_embeddings + position_embeddings",
     "the child module embed_positions's output", dict(tl="hook_pos_embed")),
])


# The released alpha-er: the reference's defaults (2 layers, 1024 wide, 64 experts of 320, ranks 128).
ALPHA_ER = AlphaErConfig()


class HookedAlphaEr(HookedModel):
    """A hooked alpha-er: the standard module tree and vocabulary, exact against the reference.

    Load with `HookedAlphaEr.from_pretrained(path)` (either checkpoint format), `HookedAlphaEr.from_reference(module)`
    or `HookedAlphaEr.from_hf(model)` (a transformers `AlphaErForCausalLM`).

    With a key/value cache (`past_kv_cache`) the new positions end the sequence: position t of the
    cached + new T goes to expert floor(t·G/T), so the cached keys and values must come from a run
    at that same length T (as activation patching's windows do: hooked_models/patching.py).
    Incremental decoding would change T at every step; `generate` reruns the padded window instead.
    """

    supports_kv_cache = True

    def __init__(self, cfg: AlphaErConfig):
        super().__init__()
        self.cfg = cfg
        d, eps = cfg.n_embd, cfg.layer_norm_eps
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)
        self.embed_positions = nn.Embedding(cfg.block_size, d)
        self.layers = nn.ModuleList([
            PreNormBlock(
                self_attn=FusedQKVAttention(
                    qkv_proj=FactoredProjection(d, cfg.attn_rank, 3 * d, eps),
                    o_proj=FactoredProjection(d, cfg.attn_rank, d, eps),
                    num_heads=cfg.n_head, head_dim=cfg.head_dim, score_mod=SoftCap(cfg.attn_soft_cap),
                ),
                mlp=PositionalExpertMLP(d, cfg.ffn_dim, cfg.mlp_experts, nn.GELU(approximate="tanh")),
                input_layernorm=LayerNorm(d, eps),
                post_attention_layernorm=LayerNorm(d, eps),
            )
            for _ in range(cfg.n_layer)
        ])
        self.norm = LayerNorm(d, eps)
        self.lm_head = FactoredProjection(d, cfg.lm_head_rank, cfg.vocab_size, eps)
        for name in ("logits", "token_embeddings", "final_norm_output", "lm_head_output", "next_token_probs",
                     "input_ids", "attention_mask", "input_size"):
            setattr(self, name, ValueHook(name))
        self.position_embeddings = ValueHook(ALPHA_ER_VALUES["position_embeddings"])
        self.to(dtype=cfg.dtype)
        self.setup()

    # TransformerLens's weights (hooked_models/transformer_lens_compat.py). The head is factored,
    # logits = up(LayerNorm(down(ln_f(x)))), so its linearization freezes the bottleneck LayerNorm's
    # scale (`lm_head.norm.norm_scale`) as TransformerLens freezes ln_final's: W_U is then
    # FactoredMatrix(down.T, C diag(mid_w) up.T) per unit of that scale, and what no residual
    # component carries (ln_f's bias through the head, up(mid_b)) is `cache.readout_bias_attrs`.
    W_pos = property(lambda self: self.embed_positions.weight)
    W_U = property(lambda self: FactoredMatrix(*self.lm_head.factors))
    b_U = property(lambda self: self.lm_head.out_bias())
    readout_scale_name = "lm_head.norm.norm_scale"

    def readout_constants(self) -> tuple[Float[Tensor, " vocab_size"], Float[Tensor, " vocab_size"]]:
        """(scaled, fixed) logit constants: (ln_f.bias @ down.T + down_bias) B, divided by the frozen
        bottleneck scale; and up(mid_b) (+ up_bias), which is not."""
        a, b = self.lm_head.factors
        pre = self.norm.bias @ a
        if self.lm_head.down_bias is not None:
            pre = pre + self.lm_head.down_bias
        return pre @ b, self.b_U

    def readout_split(self) -> tuple[nn.Module, Tensor, Tensor]:
        """(ln_f then down and the bottleneck LayerNorm, up.T, up_bias): logits exactly, per vector."""
        bias = self.lm_head.up_bias
        return (BottleneckReadout(self.norm, self.lm_head), self.lm_head.up.T,
                self.lm_head.up.new_zeros(self.cfg.vocab_size) if bias is None else bias)

    def norm_readers(self) -> list[tuple[nn.Module, list]]:
        """Each LayerNorm and what reads its output: ln1 -> qkv's down, ln2 -> the experts' up,
        ln_f -> the head's down, and each bottleneck's own LayerNorm -> its up."""
        pairs = [(self.norm, [(self.lm_head, "down", "down_bias")])]
        projections = [self.lm_head]
        for layer in self.layers:
            pairs.append((layer.input_layernorm, [(layer.self_attn.qkv_proj, "down", "down_bias")]))
            pairs.append((layer.post_attention_layernorm, [layer.mlp.up_proj]))
            projections += [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
        return pairs + [(proj.norm, [(proj, "up", "up_bias")]) for proj in projections]

    def length_problem(self, seq: int) -> str | None:
        """Why alpha-er does not compute at length `seq` (None if it does): it computes at multiples of
        mlp_experts up to block_size."""
        cfg = self.cfg
        if seq > cfg.block_size:
            return (f"sequence length {seq} is longer than block_size={cfg.block_size}, the number of learned "
                    "positions")
        if seq % cfg.mlp_experts:
            return (f"sequence length {seq} is not a multiple of mlp_experts={cfg.mlp_experts}: the expert of "
                    f"position t is floor(t·{cfg.mlp_experts}/T), so the model reproduces its training behaviour "
                    "only at such lengths")
        return None

    def check_length(self, seq: int) -> None:
        """A ValueError unless `seq` is a length alpha-er computes at: a multiple of mlp_experts, <= block_size."""
        problem = self.length_problem(seq)
        if problem is None:
            return
        keep = f"keep the last {self.cfg.block_size} tokens, or " if seq > self.cfg.block_size else ""
        raise ValueError(f"{problem}; {keep}pad the input to block_size ({self.cfg.block_size}) and read the logits "
                         "at the last real position (attention is causal, so padding after the prompt cannot "
                         "change them); model.generate does this")

    def _check_sequence(self, seq: int, attention_mask: Tensor | None, past: int = 0) -> None:
        # With a key/value cache the sequence is the cached positions and the new ones.
        self.check_length(past + seq)
        self._check_right_padding(attention_mask)

    @staticmethod
    def _check_right_padding(attention_mask: Tensor | None) -> None:
        if attention_mask is not None and bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()):
            raise ValueError("alpha-er routes and embeds by position, so padding must be on the right "
                             "(an attention_mask of ones, then zeros)")

    def _embed(self, tokens: Int[Tensor, "batch seq"], past: int) -> Float[Tensor, "batch seq hidden_size"]:
        batch, seq = tokens.shape
        positions = torch.arange(past, past + seq, device=tokens.device)
        x = self.token_embeddings(self.embed_tokens(tokens))
        return x + self.position_embeddings(self.embed_positions(positions).expand(batch, seq, -1))

    def _attention_inputs(self, batch: int, seq: int, attention_mask: Int[Tensor, "batch seq"] | None, device,
                          dtype: torch.dtype, past_kv_cache: KeyValueCache | None = None) -> AttentionInputs:
        # Right padding only: real rows attend exactly as unpadded ones (causal), padding is never read.
        if past_kv_cache is None:
            return AttentionInputs(mask=causal_mask(attention_mask, seq, device))
        # The new positions end the sequence: T = cached + new, and the experts route by it.
        past = past_kv_cache.length
        attention_mask = past_kv_cache.extend_mask(attention_mask, batch, seq, device)
        self._check_right_padding(attention_mask)  # over the cached positions too
        return AttentionInputs(mask=causal_mask(attention_mask, seq, device), kv_cache=past_kv_cache,
                               window=(past, past + seq))

    def _decoder(self, use_cache: bool) -> PaddedWindowDecoder:
        # No cache: the reference's rule reruns the whole padded window at every step.
        return PaddedWindowDecoder(self, self.cfg.block_size, pad_id=0)

    def generate(self, input, max_new_tokens: int = 64, temperature: float | int = 0.8, top_k: int | None = 40,
                 **options):
        """The shared `generate` (hooked_models/generation.py) with the reference's defaults.

        Each row's window is its last block_size tokens, padded after the text with 0 to
        block_size; the logits are read at its last real position. temperature 0 is greedy;
        otherwise one draw from the softmax of the top_k logits divided by temperature, as the
        reference draws it (the same tokens from the same torch seed).
        """
        return super().generate(input, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                **options)

    @classmethod
    def from_reference(cls, module: nn.Module, dtype: torch.dtype | str | None = None, device=None) -> "HookedAlphaEr":
        """From an in-memory module with the reference's parameter names and a `cfg` with its fields
        (the weights are copied). `dtype` is a torch dtype or a name ("bfloat16", "bf16", "fp16":
        hooked_models.dtypes); `device` must exist here ("cuda" without CUDA is a ValueError naming
        the devices there are)."""
        from weight_conversion.alpha_er import load_from_reference

        return load_from_reference(module, dtype=dtype, device=device, build=_build_on_meta)

    @classmethod
    def from_hf(cls, hf_model, dtype: torch.dtype | str | None = None, device=None) -> "HookedAlphaEr":
        """From an in-memory transformers `AlphaErForCausalLM` (hooked_models.alpha_er_transformers; the
        weights are copied), as `HookedArcee.from_hf` takes an `ArceeForCausalLM`."""
        from weight_conversion.alpha_er_transformers import load_from_transformers_model

        return load_from_transformers_model(hf_model, dtype=dtype, device=device, build=_build_on_meta)

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | str | None = None, device=None) -> "HookedAlphaEr":
        """From a checkpoint in either format: the reference's (a safetensors file whose header metadata
        carries the config fields, or with a config.json beside it; a torch state-dict file with a
        config.json beside it; a directory holding either) or the transformers one that
        `save_pretrained(path, format="transformers")` or `AlphaErForCausalLM.save_pretrained` writes.
        `dtype` is a torch dtype or a name ("bfloat16", "bf16", "fp16": hooked_models.dtypes); `device`
        must exist here ("cuda" without CUDA is a ValueError naming the devices there are).

        `"embedded"` names the small IOI model shipped in the package (`hooked_models.embedded`), a
        safetensors file with its config in the header, loaded by the same code."""
        from hooked_models.embedded import resolve_embedded
        from weight_conversion.alpha_er_transformers import load_alpha_er

        return load_alpha_er(resolve_embedded(path, "alpha_er"), dtype=dtype, device=device, build=_build_on_meta)

    def save_pretrained(self, path, format: str = "reference") -> None:
        """Write a checkpoint. `format="reference"`: the reference's, safetensors with the config fields
        in the header metadata (a path ending in .safetensors is the file; otherwise a directory gets
        model.safetensors and config.json). `format="transformers"`: the directory
        `AlphaErForCausalLM.save_pretrained` writes, with its two source files as remote code."""
        if format == "reference":
            from weight_conversion.alpha_er import save_alpha_er_checkpoint

            save_alpha_er_checkpoint(self, path)
        elif format == "transformers":
            from weight_conversion.alpha_er_transformers import save_transformers_checkpoint

            save_transformers_checkpoint(self, path)
        else:
            raise ValueError(f"format={format!r} must be 'reference' or 'transformers'")

    def to_hf(self):
        """The same weights (shared, not copied) as a transformers `AlphaErForCausalLM` in eval mode."""
        from weight_conversion.alpha_er_transformers import to_transformers

        return to_transformers(self)


def _build_on_meta(cfg: AlphaErConfig) -> HookedAlphaEr:
    """The model with no storage yet (meta device): the loaders stream each tensor into it."""
    with torch.device("meta"):
        return HookedAlphaEr(cfg)
