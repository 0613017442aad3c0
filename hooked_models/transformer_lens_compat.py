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

Both TransformerLens majors are supported: 3.x (which SAELens requires) and 4.x. What differs is
asked once, here (`TRANSFORMER_LENS_4`): 4.x ships the logit lens (`tools.analysis.logit_lens`), which
3.x lacks, so there the package's own lens (hooked_models/logit_lens.py) answers `cache.logit_lens`.
Everything else is written to run the same under both (per-head results and per-example logit
attributions do not lean on the version's own, which differ).
"""

import re
from importlib.metadata import version

import einops
import torch
import torch.nn as nn
from jaxtyping import Float
from torch import Tensor
from transformer_lens import ActivationCache
from transformer_lens.utilities import Slice

from hooked_models.components.norms import LayerNorm
from hooked_models.weight_views import FactoredMatrix, per_head_in, per_head_out

__all__ = ["FactoredMatrix", "TRANSFORMER_LENS_4", "TRANSFORMER_LENS_VERSION", "TransformerLensCache",
           "TransformerLensModel", "per_head_in", "per_head_out"]

# The installed TransformerLens, (major, minor): the one place that asks.
TRANSFORMER_LENS_VERSION: tuple[int, int] = tuple(
    int(part) for part in re.match(r"(\d+)\.(\d+)", version("transformer_lens")).groups())
TRANSFORMER_LENS_4 = TRANSFORMER_LENS_VERSION >= (4, 0)


@torch.no_grad()
def fold_norm_(norm: nn.Module, readers: list, center: bool) -> None:
    """Fold a norm's weight (and bias) into the layers that read its output, in place.

    A reader is an nn.Linear, or (module, weight name, bias name) for a weight [..., out, in] that
    reads the norm along its last axis (alpha-er's `down`, its experts' [expert out in] weights).
    reader(n·w + b) = (W·w) n + (W b + c), the bias made if the reader has none; the norm is left
    with weight 1 and bias 0. With `center` (a LayerNorm, whose output sums to zero over features)
    each reader's rows are also centred, which changes nothing it computes (TransformerLens's
    fold_ln does the same).
    """
    bias = getattr(norm, "bias", None)
    for reader in readers:
        owner, weight_name, bias_name = (reader, "weight", "bias") if isinstance(reader, nn.Module) else reader
        weight = getattr(owner, weight_name)
        if bias is not None and bool(bias.any()):
            extra = weight @ bias
            if getattr(owner, bias_name) is None:
                setattr(owner, bias_name, nn.Parameter(extra))
            else:
                getattr(owner, bias_name).add_(extra)
        weight *= norm.weight
        if center:
            weight -= weight.mean(-1, keepdim=True)
    norm.weight.fill_(1.0)
    if bias is not None:
        bias.zero_()


class BottleneckReadout(nn.Module):
    """A factored head up to its bottleneck: x -> LayerNorm(x @ down.T + down_bias), what `up` reads.

    TransformerLens's logit lens computes ln_final(x) @ W_U + b_U; for a factored head this module
    (after ln_final) and W = up.T make that exact, the bottleneck's norm recomputed per vector.
    """

    def __init__(self, final_norm: nn.Module, head: nn.Module):
        super().__init__()
        self.final_norm, self.head = final_norm, head

    def forward(self, x: Float[Tensor, "*batch hidden_size"]) -> Float[Tensor, "*batch rank"]:
        z = nn.functional.linear(self.final_norm(x), self.head.down, self.head.down_bias)
        return self.head.norm(z)


class _Delegate:
    """An object that answers like `target`, except for the attributes given."""

    def __init__(self, target, **overrides):
        self._target = target
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(self._target, name)


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
        return bias if bias is not None else self.W_E.new_zeros(self.cfg.d_vocab)

    @property
    def W_E_pos(self) -> Float[Tensor, "vocab_and_positions hidden_size"]:
        """[W_E; W_pos], the input basis of TransformerLens's full circuits (a copy); models with
        learned positions only."""
        return torch.cat([self.W_E, self.W_pos])

    # TransformerLens's switches. Each decides whether `run_with_cache()` with no names_filter
    # includes its values; a hook or a filter that names them gets them either way, they are
    # computed only while hooked, and reading them changes no bit of the output.
    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """Per-head results, `hook_result` (`attention_head_results`)."""
        self.cfg.use_attn_result = bool(use_attn_result)

    def set_use_split_qkv_input(self, use_split_qkv_input: bool) -> None:
        """Split inputs: a copy of the stream entering each block per query head (`hook_q_input`,
        `attention_query_inputs`) and per key/value head (`hook_k_input`, `hook_v_input`), taken
        before input_layernorm, so a write to one copy reaches that head's query, key or value alone."""
        self.cfg.use_split_qkv_input = bool(use_split_qkv_input)

    def set_use_attn_in(self, use_attn_in: bool) -> None:
        """One copy of the stream per query head that its queries, keys and values all read
        (`hook_attn_in`, `attention_inputs`)."""
        self.cfg.use_attn_in = bool(use_attn_in)

    def set_use_hook_mlp_in(self, use_hook_mlp_in: bool) -> None:
        """The MLP branch's own copy of the stream before post_attention_layernorm (`hook_mlp_in`,
        `mlp_residual_input`)."""
        self.cfg.use_hook_mlp_in = bool(use_hook_mlp_in)

    # The readout, for direct logit attribution: a family whose head is not linear (alpha-er's
    # bottleneck LayerNorm) names the scale that freezes it and overrides these.
    readout_scale_name: str | None = None

    def readout_constants(self) -> tuple[Float[Tensor, " vocab_size"], Float[Tensor, " vocab_size"]]:
        """(scaled, fixed): each logit's part that no residual component carries. `scaled` is
        divided by the readout scale (1 here), `fixed` is not: the final norm's bias through W_U, b_U."""
        bias = getattr(self.ln_final, "bias", None)
        scaled = self.b_U.new_zeros(self.cfg.d_vocab) if bias is None else bias @ self.W_U
        return scaled, self.b_U

    def readout_split(self) -> tuple[nn.Module, Tensor, Tensor]:
        """(module, W, b) with logits = module(resid) @ W + b exactly: ln_final, W_U, b_U here."""
        return self.ln_final, self.W_U, self.b_U

    def _tl_fallback_aliases(self) -> None:
        """Without rotary, queries and keys are the same before and after it: `hook_q`/`hook_k`
        are then second names of `hook_rot_q`/`hook_rot_k` (transformer_lens.patching sweeps them)."""
        for alias, canonical in list(self.aliases.items()):
            for rotated, plain in ((".attn.hook_rot_q", ".attn.hook_q"), (".attn.hook_rot_k", ".attn.hook_k")):
                if alias.endswith(rotated) and alias[: -len(rotated)] + plain not in self.aliases:
                    self.aliases[alias[: -len(rotated)] + plain] = canonical

    @property
    def W_pos(self) -> Tensor:
        raise AttributeError(f"{type(self).__name__} has rotary positions, so no learned W_pos")

    def _stack_blocks(self, path: str) -> Tensor | FactoredMatrix:
        """A weight view of every block, stacked along a new leading layer axis (a copy); factored
        weights (alpha-er) stack factor by factor."""
        views = []
        for block in self.blocks:
            obj = block
            for part in path.split("."):
                obj = getattr(obj, part)
            views.append(obj)
        if isinstance(views[0], FactoredMatrix):
            return FactoredMatrix(torch.stack([v.A for v in views]), torch.stack([v.B for v in views]))
        return torch.stack(views)

    W_Q = property(lambda self: self._stack_blocks("attn.W_Q"))
    W_K = property(lambda self: self._stack_blocks("attn.W_K"))
    W_V = property(lambda self: self._stack_blocks("attn.W_V"))
    W_O = property(lambda self: self._stack_blocks("attn.W_O"))
    W_in = property(lambda self: self._stack_blocks("mlp.W_in"))
    W_out = property(lambda self: self._stack_blocks("mlp.W_out"))

    QK = property(lambda self: self._stack_blocks("attn.QK"), doc="[layer head hidden_size hidden_size], "
                  "kv heads expanded to query heads (a FactoredMatrix)")
    OV = property(lambda self: self._stack_blocks("attn.OV"), doc="[layer head hidden_size hidden_size], "
                  "kv heads expanded to query heads (a FactoredMatrix)")

    # -------------------------------------------------------------------- residual directions
    def tokens_to_residual_directions(self, tokens) -> Tensor:
        """The residual-stream direction each token's logit reads, `W_U[:, token]`: [hidden_size]
        for one token (a string, an int or a 0-d tensor), [... hidden_size] for a tensor of them.

        These directions apply to the *normed* stream (after the final norm's weight), which is
        what this cache's `apply_ln_to_stack` returns, so `logit_attrs` is right without fold_ln.
        """
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        w_u = self.W_U
        index = tokens if isinstance(tokens, Tensor) and tokens.ndim > 0 else torch.tensor(int(tokens))
        if isinstance(w_u, FactoredMatrix):  # a factored head: A @ B[:, tokens]
            columns = w_u.A @ w_u.B[:, index.flatten().to(w_u.B.device)]
            columns = columns.view(-1, *index.shape)
        else:
            columns = w_u[:, index.to(w_u.device)]
        return einops.rearrange(columns, "d ... -> ... d")

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
        if getattr(self.unembed, "weight", None) is self.embed.weight:
            self.unembed.weight = nn.Parameter(self.embed.weight.detach().clone())
            self.cfg.tie_word_embeddings = False

    def fold_ln(self) -> None:
        """Fold every norm's weight (and a LayerNorm's bias, and its centring) into the layers that
        read it (`norm_readers()`), leaving weight 1 and bias 0: the logits are unchanged, and W_Q,
        W_in, W_U then include the norms. Unties a tied embedding first (the head changes, W_E must
        not). A LayerNorm's bias may give a bias-free reader a bias: alpha-er's reference format has
        no place for those, so such a model no longer exports to it.
        """
        self.untie_weights()
        for norm, readers in self.norm_readers():
            fold_norm_(norm, readers, center=isinstance(norm, LayerNorm))

    @torch.no_grad()
    def center_unembed(self) -> None:
        """Subtract the mean over the vocabulary from every logit's weights and bias: every logit
        at a position moves by the same amount, so probabilities are unchanged. (The head's output
        weight: lm_head.weight, or a factored head's `up`, and its bias if any.)"""
        self.untie_weights()
        head = self.unembed
        weight = head.weight if isinstance(head, nn.Linear) else head.up
        weight -= weight.mean(0, keepdim=True)
        bias = head.bias if isinstance(head, nn.Linear) else head.up_bias
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

    def compute_head_results(self) -> None:
        """Per-head results into the cache where missing, from `hook_z` through each attention's own
        `head_results` (TransformerLens 3.x multiplies z by W_O itself, which a factored W_O cannot do)."""
        self._ensure_head_results()

    def _ensure_head_results(self) -> bool:
        # The attention's own head_results: z @ W_O per head, or a factored o_proj's frozen-scale terms.
        all_cached = True
        for layer in range(self.model.cfg.n_layers):
            name, _ = self.model.resolve_hook_name(f"blocks.{layer}.attn.hook_result")
            if name in self.cache_dict:
                continue
            all_cached = False
            z = self[("z", layer, "attn")]
            with torch.no_grad():
                batched = z if self.has_batch_dim else z[None]
                result = self.model.blocks[layer].attn.head_results(batched)
            self.cache_dict[name] = result if self.has_batch_dim else result[0]
        return all_cached

    def _dense_W_out(self, layer: int) -> Float[Tensor, "intermediate_size hidden_size"]:
        """A block's W_out as [neuron hidden_size]: experts' [expert width hidden_size] flattened."""
        w_out = self.model.blocks[layer].mlp.W_out
        return w_out.flatten(0, 1) if w_out.ndim == 3 else w_out

    def get_neuron_results(self, layer, neuron_slice=None, pos_slice=None, project_output_onto=None):
        """Each neuron's contribution to the residual stream (TransformerLens's, with expert MLPs'
        W_out flattened to the dense neuron index)."""
        neuron_slice = neuron_slice if isinstance(neuron_slice, Slice) else Slice(neuron_slice)
        pos_slice = pos_slice if isinstance(pos_slice, Slice) else Slice(pos_slice)
        acts = neuron_slice.apply(pos_slice.apply(self[("post", layer, "mlp")], dim=-2), dim=-1)
        w_out = neuron_slice.apply(self._dense_W_out(layer), dim=0)
        if project_output_onto is None:
            return acts[..., None] * w_out
        projected = w_out @ project_output_onto
        return acts * projected if project_output_onto.ndim == 1 else acts[..., None] * projected

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
        """TransformerLens's fused path (normed neuron results projected, never materialized),
        with the norm's weight: (c(x) / s · w) @ p == (c(x) / s) @ (w p), c the centring if any."""
        norm = self._norm(layer, mlp_input)
        project = norm.weight[:, None] * project_2d
        scale = self._get_cached_ln_scale(layer, mlp_input=mlp_input, pos_slice=pos_slice)
        parts = []
        for l in range(layer):
            w_out = neuron_slice.apply(self._dense_W_out(l), dim=0)
            linear = w_out @ project
            if isinstance(norm, LayerNorm):  # a LayerNorm centres what it reads; an RMSNorm does not
                linear = linear - w_out.mean(-1)[:, None] * project.sum(0)[None, :]
            acts = neuron_slice.apply(pos_slice.apply(self[("post", l, "mlp")], dim=-2), dim=-1)
            parts.append((acts / scale)[..., None] * linear)
        if not parts:
            shape = pos_slice.apply(self["hook_embed"], dim=-2).shape[:-1]
            return project.new_zeros(0, *shape, project.shape[-1])
        return einops.rearrange(torch.cat(parts, dim=-2), "... neuron out -> neuron ... out")

    def readout_scale(self, pos_slice=None, batch_slice=None) -> Tensor:
        """The scale the readout's linearization divides by, per position ([batch seq], as the
        slices leave it): alpha-er's head-bottleneck LayerNorm scale, frozen at its cached value;
        ones for a linear head."""
        pos_slice = pos_slice if isinstance(pos_slice, Slice) else Slice(pos_slice)
        batch_slice = batch_slice if isinstance(batch_slice, Slice) else Slice(batch_slice)
        name = self.model.readout_scale_name
        if name is None:
            scale = torch.ones_like(self["hook_embed"][..., 0])
        else:
            scale = self[name][..., 0]
        scale = pos_slice.apply(scale, dim=-1)
        return batch_slice.apply(scale, dim=0) if self.has_batch_dim else scale

    def logit_attrs(self, residual_stack, tokens, incorrect_tokens=None, pos_slice=None, batch_slice=None,
                    has_batch_dim=True):
        """TransformerLens's logit_attrs, divided by the readout's frozen scale (1 for a linear
        head; alpha-er's head-bottleneck LayerNorm scale). With `readout_bias_attrs` the
        attributions of a full decomposition sum to the logit (difference)."""
        batch_slice = batch_slice if isinstance(batch_slice, Slice) else Slice(batch_slice)
        if has_batch_dim and batch_slice.mode != "int" and residual_stack.ndim == 4:
            # One token per example ([batch]) reads every position: [batch 1], which both majors
            # broadcast over positions (3.x would broadcast a [batch] tensor over the batch instead).
            tokens, incorrect_tokens = (self._per_example(t, residual_stack.shape[1])
                                        for t in (tokens, incorrect_tokens))
        attrs = super().logit_attrs(residual_stack, tokens, incorrect_tokens, pos_slice, batch_slice, has_batch_dim)
        if self.model.readout_scale_name is None:
            return attrs
        return attrs / self.readout_scale(pos_slice, batch_slice)

    @staticmethod
    def _per_example(tokens, batch: int):
        if isinstance(tokens, Tensor) and tokens.ndim == 1 and tokens.shape[0] == batch:
            return tokens[:, None]
        return tokens

    def logit_lens(self, **kwargs):
        """TransformerLens's logit lens (4.x; on 3.x, which has none, hooked_models/logit_lens.py's,
        with the same arguments and fields). A factored head (alpha-er) is read exactly: each entry
        goes through the final norm, down and the bottleneck LayerNorm (statistics recomputed per
        entry, as TransformerLens's lens recomputes ln_final's), then `up`, as the model does."""
        if not TRANSFORMER_LENS_4:
            from hooked_models.logit_lens import logit_lens

            return logit_lens(self, **kwargs)
        from transformer_lens.tools.analysis._model_state import require_eval_mode
        from transformer_lens.tools.analysis.logit_lens import logit_lens

        if isinstance(self.model.W_U, Tensor):
            return super().logit_lens(**kwargs)
        if not kwargs.pop("apply_ln", True):
            raise ValueError("a factored head reads the stream only through its final norm and bottleneck; "
                             "apply_ln=False has no readout on this model")
        require_eval_mode(self.model, operation="logit_lens")
        pre, weight, bias = self.model.readout_split()
        user_lens = kwargs.pop("lens", None)

        def lens(entry, index):
            return pre(entry if user_lens is None else user_lens(entry, index))

        # TransformerLens's lens then reads rank-wide vectors through W = up.T, b = up_bias.
        view = _Delegate(self.model, W_U=weight, b_U=bias, ln_final=pre,
                         cfg=_Delegate(self.model.cfg, d_model=weight.shape[0]))
        result = logit_lens(view, cache=self, lens=lens, apply_ln=False, **kwargs)
        result.readout.applied_ln = True
        return result

    def readout_bias_attrs(self, tokens, incorrect_tokens=None, pos_slice=None) -> Tensor:
        """The part of each logit (or logit difference) that no residual component carries: the
        final norm's bias through the head, and the head's own bias (alpha-er: its bottleneck
        LayerNorm's bias, up(mid_b), and the final LayerNorm's bias through the frozen head).

        `logit_attrs(get_full_resid_decomposition(), tokens, incorrect).sum(0)` plus this is the
        model's logit (difference), exactly. [batch seq] (or as pos_slice leaves it).
        """
        scaled, fixed = self.model.readout_constants()
        scale = self.readout_scale(pos_slice)

        def pick(constant, t):
            if isinstance(t, str):
                t = self.model.to_single_token(t)
            return constant[torch.as_tensor(t, device=constant.device)]

        def term(constant):
            value = pick(constant, tokens)
            if incorrect_tokens is not None:
                value = value - pick(constant, incorrect_tokens)
            if value.ndim == 1 and scale.ndim == 2 and value.shape[0] == scale.shape[0]:
                value = value[:, None]  # one token per example, broadcast over positions
            return value

        return term(scaled) / scale + term(fixed)

    def apply_slice_to_batch_dim(self, batch_slice):
        sliced = super().apply_slice_to_batch_dim(batch_slice)
        return type(self)(sliced.cache_dict, self.model, has_batch_dim=sliced.has_batch_dim)
