"""What TransformerLens's own tools read from a model and a cache, on top of the hooked models.

transformer_lens 4.x types its utilities' model as `model_protocol.TransformerLensModelWithWeights`:
`cfg`, `run_with_cache`, `run_with_hooks`, `to_tokens`, `blocks`, `ln_final`, `accumulated_bias`,
`to_single_token`, `tokens_to_residual_directions`; its `ActivationCache` helpers further read
`blocks[i].attn.W_O`, `blocks[i].mlp.W_out`, the norms' cached `hook_scale`, and `logit_lens`
reads `W_U`, `b_U`, `ln_final` and `unembed`. `TransformerLensModel` adds those (and the weight
processing TransformerLens users expect: `fold_ln`, `center_unembed`) to `HookedModel`;
`TransformerLensCache` fixes what `ActivationCache` gets wrong for these models.

Weight views are views: `W_Q`, `W_O`, `W_in`, `W_U` ... share storage with the parameters, so
nothing is copied and an edit writes through. Stacks across layers (`model.W_Q`) and the GQA
`_expanded` forms are copies, as they must be.

Direct logit attribution. TransformerLens's `apply_ln_to_stack` divides by the cached norm scale
but ignores the norm's weight, so unless the weights were folded, `logit_attrs` is silently wrong
(the known trap). Here `apply_ln_to_stack` applies the weight too (a no-op after `fold_ln`), so a
component's stack entry is exactly its contribution to the norm's output, and the attributions of
a full decomposition sum to the true logit (difference) on any weights. What no residual
component carries (an unembedding bias, a final LayerNorm's bias, alpha-er's head-bottleneck
bias) is `cache.readout_bias_attrs(...)`, the remaining term of that sum.
"""

import einops
import torch
import torch.nn as nn
from jaxtyping import Float
from torch import Tensor
from transformer_lens import ActivationCache
from transformer_lens.FactoredMatrix import FactoredMatrix
from transformer_lens.utilities import Slice

__all__ = ["FactoredMatrix", "TransformerLensCache", "TransformerLensModel", "per_head_in", "per_head_out"]


def per_head_in(weight: Float[Tensor, "heads_by_dim hidden_size"], heads: int) -> Tensor:
    """An [out, in] projection into heads -> TransformerLens's [head hidden_size head_dim] (a view)."""
    return weight.view(heads, -1, weight.shape[-1]).transpose(-1, -2)


def per_head_out(weight: Float[Tensor, "hidden_size heads_by_dim"], heads: int) -> Tensor:
    """An [out, in] projection out of heads -> TransformerLens's [head head_dim hidden_size] (a view)."""
    return weight.view(weight.shape[0], heads, -1).permute(1, 2, 0)


@torch.no_grad()
def fold_norm_(norm: nn.Module, readers: list[nn.Linear], center: bool) -> None:
    """Fold a norm's weight (and bias) into the linear layers that read its output, in place.

    reader(n·w + b) = (W·w) n + (W b + c); the norm is left with weight 1 and bias 0. With `center`
    (a LayerNorm, whose output sums to zero over features), each reader's rows are also centred,
    which changes nothing it computes (TransformerLens's fold_ln does the same).
    """
    bias = getattr(norm, "bias", None)
    for reader in readers:
        if bias is not None and bool(bias.any()):
            extra = reader.weight @ bias
            if reader.bias is None:
                reader.bias = nn.Parameter(extra)
            else:
                reader.bias += extra
        reader.weight *= norm.weight
        if center:
            reader.weight -= reader.weight.mean(-1, keepdim=True)
    norm.weight.fill_(1.0)
    if bias is not None:
        bias.zero_()


class TransformerLensModel:
    """TransformerLens's model surface for a `HookedModel` (mixed into it).

    A family says which linear layers read which norm (`norm_readers()`: a list of (norm, readers)
    pairs), and overrides the weight views where its modules differ (alpha-er's positional
    embedding and factored head).
    """

    # ---------------------------------------------------------------------------- weight views
    @property
    def W_E(self) -> Float[Tensor, "vocab_size hidden_size"]:
        """The token embedding (the parameter itself)."""
        return self.embed.weight

    @property
    def W_U(self) -> Float[Tensor, "hidden_size vocab_size"]:
        """The unembedding [hidden_size vocab_size], a view of lm_head's weight. The final norm's
        weight is not in it unless `fold_ln` has run; `apply_ln_to_stack` applies it."""
        return self.unembed.weight.T

    @property
    def b_U(self) -> Float[Tensor, " vocab_size"]:
        bias = getattr(self.unembed, "bias", None)
        return bias if bias is not None else torch.zeros(self.cfg.d_vocab, dtype=self.W_U.dtype,
                                                         device=self.W_U.device)

    @property
    def W_pos(self) -> Tensor:
        raise AttributeError(f"{type(self).__name__} has rotary positions, so no learned W_pos")

    def _stack_blocks(self, path: str) -> Tensor:
        """A weight view of every block, stacked along a new leading layer axis (a copy)."""
        tensors = []
        for block in self.blocks:
            obj = block
            for part in path.split("."):
                obj = getattr(obj, part)
            tensors.append(obj)
        return torch.stack(tensors)

    W_Q = property(lambda self: self._stack_blocks("attn.W_Q"))
    W_K = property(lambda self: self._stack_blocks("attn.W_K"))
    W_V = property(lambda self: self._stack_blocks("attn.W_V"))
    W_O = property(lambda self: self._stack_blocks("attn.W_O"))
    W_in = property(lambda self: self._stack_blocks("mlp.W_in"))
    W_out = property(lambda self: self._stack_blocks("mlp.W_out"))

    @property
    def QK(self) -> FactoredMatrix:
        """[layer head hidden_size hidden_size], kv heads expanded to query heads."""
        return FactoredMatrix(self._stack_blocks("attn.QK.A"), self._stack_blocks("attn.QK.B"))

    @property
    def OV(self) -> FactoredMatrix:
        """[layer head hidden_size hidden_size], kv heads expanded to query heads."""
        return FactoredMatrix(self._stack_blocks("attn.OV.A"), self._stack_blocks("attn.OV.B"))

    # -------------------------------------------------------------------- residual directions
    def tokens_to_residual_directions(self, tokens) -> Tensor:
        """The residual-stream direction each token's logit reads, `W_U[:, token]`: [hidden_size]
        for one token (a string, an int or a 0-d tensor), [... hidden_size] for a tensor of them.

        These directions apply to the *normed* stream (after the final norm's weight), which is
        what this cache's `apply_ln_to_stack` returns, so `logit_attrs` is right without fold_ln.
        """
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        if isinstance(tokens, Tensor) and tokens.ndim > 0:
            return einops.rearrange(self.W_U[:, tokens.to(self.W_U.device)], "d ... -> ... d")
        return self.W_U[:, int(tokens)]

    def accumulated_bias(self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True) -> Tensor:
        """The sum of the attention and MLP output biases before `layer` (and its attention's when
        `mlp_input`): the part of the residual stream no head or neuron writes. [hidden_size]"""
        total = torch.zeros(self.cfg.d_model, dtype=self.W_E.dtype, device=self.W_E.device)
        for index, block in enumerate(self.blocks):
            if index < layer or (index == layer and mlp_input):
                b_O = block.attn.out_bias()
                total = total + b_O if isinstance(b_O, Tensor) else total
            if index < layer and include_mlp_biases and getattr(block.mlp, "b_out", None) is not None:
                total = total + block.mlp.b_out
        return total

    # ----------------------------------------------------------------------- weight processing
    def untie_weights(self) -> None:
        """Give lm_head its own copy of a tied embedding, so that weight processing can edit one."""
        if self.unembed.weight is self.embed.weight:
            self.unembed.weight = nn.Parameter(self.embed.weight.detach().clone())
            self.cfg.tie_word_embeddings = False

    def fold_ln(self) -> None:
        """Fold every norm's weight (and a LayerNorm's bias, and its centring) into the linear
        layers that read it, leaving weight 1 and bias 0: the logits are unchanged, and W_Q, W_in,
        W_U then include the norms. Unties a tied embedding first (the head changes, W_E must not).
        """
        from hooked_models.components import LayerNorm

        self.untie_weights()
        for norm, readers in self.norm_readers():
            fold_norm_(norm, readers, center=isinstance(norm, LayerNorm))

    @torch.no_grad()
    def center_unembed(self) -> None:
        """Subtract each hidden direction's mean over the vocabulary from W_U (and b_U's mean):
        every logit at a position moves by the same amount, so probabilities are unchanged."""
        self.untie_weights()
        weight = self.unembed.weight
        weight -= weight.mean(0, keepdim=True)
        bias = getattr(self.unembed, "bias", None)
        if bias is not None:
            bias -= bias.mean()


class TransformerLensCache(ActivationCache):
    """transformer_lens's ActivationCache, corrected for these models (mixed into the cache).

    - `has_embed`/`has_pos_embed` look the TransformerLens names up through the aliases;
    - per-head results missing from the cache are computed from `hook_z` and `W_O` and stored
      under their standard name;
    - `apply_ln_to_stack` applies the norm's weight after TransformerLens's cached scale, so
      direct logit attribution is right without `fold_ln`;
    - `readout_bias_attrs` is the part of a logit no residual component carries;
    - slicing the batch keeps this class.
    """

    def __init__(self, cache_dict, model, has_batch_dim: bool = True):
        super().__init__(cache_dict, model, has_batch_dim=has_batch_dim)
        self.has_embed = "hook_embed" in self
        self.has_pos_embed = "hook_pos_embed" in self

    def _norm(self, layer: int, mlp_input: bool) -> nn.Module:
        if layer == self.model.cfg.n_layers:
            return self.model.ln_final
        block = self.model.blocks[layer]
        return block.ln2 if mlp_input else block.ln1

    def _ensure_head_results(self) -> bool:
        all_cached = True
        for layer in range(self.model.cfg.n_layers):
            name, _ = self.model.resolve_hook_name(f"blocks.{layer}.attn.hook_result")
            if name in self.cache_dict:
                continue
            all_cached = False
            z = self[("z", layer, "attn")]
            self.cache_dict[name] = torch.einsum("...hd,hdm->...hm", z, self.model.blocks[layer].attn.W_O)
        return all_cached

    def apply_ln_to_stack(self, residual_stack, layer=None, mlp_input=False, pos_slice=None, batch_slice=None,
                          has_batch_dim=True, recompute_ln=False):
        """TransformerLens's apply_ln_to_stack, then the norm's weight (see the module docstring).

        Each entry becomes exactly its contribution to the norm's output with the norm's scale
        frozen at its cached value (less the norm's bias, which belongs to no component).
        """
        n_layers = self.model.cfg.n_layers
        layer = n_layers if layer is None or layer == -1 else layer
        out = super().apply_ln_to_stack(residual_stack, layer, mlp_input, pos_slice, batch_slice, has_batch_dim,
                                        recompute_ln)
        if recompute_ln and layer == n_layers:
            return out  # ln_final itself was applied, weight and bias included
        return out * self._norm(layer, mlp_input).weight

    def _stack_neuron_results_apply_ln_projected(self, layer, pos_slice, neuron_slice, project_2d,
                                                 mlp_input=False):
        # (n / s · w) @ p == (n / s) @ (w p): the weight goes into the projection.
        weight = self._norm(layer, mlp_input).weight
        return super()._stack_neuron_results_apply_ln_projected(layer, pos_slice, neuron_slice,
                                                                weight[:, None] * project_2d, mlp_input)

    def readout_bias_attrs(self, tokens, incorrect_tokens=None, pos_slice=None) -> Tensor:
        """The part of each logit (or logit difference) that no residual component carries: the
        unembedding's bias (and, for a LayerNorm final norm, its bias through W_U).

        `logit_attrs(get_full_resid_decomposition(), tokens, incorrect).sum(0)` plus this is the
        model's logit (difference), exactly. [batch seq] (or as pos_slice leaves it).
        """
        if not isinstance(pos_slice, Slice):
            pos_slice = Slice(pos_slice)
        constant = self.model.b_U
        bias = getattr(self.model.ln_final, "bias", None)
        if bias is not None:
            constant = constant + bias @ self.model.W_U

        def pick(t):
            if isinstance(t, str):
                t = self.model.to_single_token(t)
            return constant[torch.as_tensor(t, device=constant.device)]

        value = pick(tokens) if incorrect_tokens is None else pick(tokens) - pick(incorrect_tokens)
        reference = pos_slice.apply(self["hook_embed"], dim=-2)[..., 0]
        if value.ndim == 1 and reference.ndim == 2 and value.shape[0] == reference.shape[0]:
            value = value[:, None]  # one token per example, broadcast over positions
        return torch.zeros_like(reference) + value

    def apply_slice_to_batch_dim(self, batch_slice):
        sliced = super().apply_slice_to_batch_dim(batch_slice)
        return type(self)(sliced.cache_dict, self.model, has_batch_dim=sliced.has_batch_dim)
