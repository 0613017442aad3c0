"""One oracle per hooked value: the same quantity, taken from the reference model independently.

`ORACLES[family]` has one entry per value the family's model exposes, keyed by its standard name with the
layer index written `{i}` (`layers.{i}.self_attn.attention_queries`, `norm.norm_scale`, `lm_head.bottleneck`),
so two norms or two bottlenecks are two entries. Each says where the reference holds the value, and whether
reading it and writing it must agree with the reference bit for bit or within a stated bound (and why).
tests/hooked_models/test_oracles.py checks every entry and that the table covers exactly what each model
exposes; `PYTHONPATH=. python tests/hooked_models/oracle_report.py` prints the measured differences.

The references are run through harnesses that record every value by its hooked name and can apply one edit:
- Arcee: transformers' `ArceeForCausalLM` itself. Values at module boundaries come from forward hooks on its
  modules; queries, keys, values, scores, pattern and head outputs from the attention function's own
  arguments, through attention functions registered with transformers' `AttentionInterface` that record
  and then delegate to transformers' "sdpa" or run its "eager" function step by step (pinned to it bit for
  bit by a test). The RMSNorm's scale and normalized value are computed from the norm's input with
  transformers' own arithmetic (ArceeRMSNorm.forward, step by step, pinned to its output).
- alpha-er: the transcribed reference (tests/reference/alpha_er_reference.py). Its block computes attention
  and the experts inline, so the harness runs its forwards step by step on the reference's own modules and
  weights (pinned to the reference's forward bit for bit by a test) with each intermediate as a point.
Nothing here calls hooked_models to compute a reference quantity.

An edit is made on a value in the standard layout: the hooked model's hook and the reference's point apply
the same arithmetic to the same elements. Values whose write has a documented meaning get an edit with that
meaning in the reference: a written norm scale divides the stream (TransformerLens's hook_scale) where it
changed; written head results become the attention output as their sum (plus the output's bias); a written
dense expert neuron counts only inside the token's own expert; written ids are looked up; a written
attention mask makes a position padding (keys no query attends to, positions counted over real tokens).
"""

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.models.arcee.modeling_arcee import repeat_kv

from alpha_er_reference import reference_gelu  # tests/reference, on the path through conftest


@dataclass(frozen=True)
class Oracle:
    """Where the reference holds a value, and how closely the hooked model must agree with it.

    A bound of 0 means bit for bit (torch.equal); otherwise max |hooked - reference| <= bound ·
    max |reference| (the read value's scale, or the logits' for a write), and `why` says why it is not exact.
    """

    source: str
    read_bound: float = 0.0
    write_bound: float = 0.0
    why: str = ""
    read_only: bool = False


RMS = "transformers' ArceeRMSNorm.forward step by step on its input: "
ATTN_FN = "the attention function's "


def _rms_norm(prefix: str, module: str) -> dict[str, Oracle]:
    return {
        f"{prefix}norm_scale": Oracle(RMS + f"sqrt(mean(x²) + eps), x what {module} is called with"),
        f"{prefix}norm_normalized": Oracle(RMS + f"x·rsqrt(mean(x²) + eps) in {module}, before its weight"),
    }


_HEAD_RESULTS_WHY = ("each head's share is a {d}-term product per output; the oracle computes it with "
                     "F.linear on the head's slice, the port with one einsum over heads: the same sum, "
                     "rounded in another order")

ORACLES: dict[str, dict[str, Oracle]] = {
    "arcee": {
        "input_ids": Oracle("the ids transformers' embed_tokens looks up (its input)"),
        "attention_mask": Oracle("the attention_mask ArceeModel is called with (positions counted over its ones)"),
        "input_size": Oracle("the shape of the ids transformers is called with", read_only=True),
        "token_embeddings": Oracle("model.embed_tokens's output"),
        "layers.{i}.layer_input": Oracle("model.layers[i]'s input hidden_states"),
        **_rms_norm("layers.{i}.input_layernorm.", "layers[i].input_layernorm"),
        "layers.{i}.attention_norm_output": Oracle("layers[i].input_layernorm's output"),
        "layers.{i}.self_attn.attention_queries_unrotated": Oracle("layers[i].self_attn.q_proj's output, in heads"),
        "layers.{i}.self_attn.attention_keys_unrotated": Oracle("layers[i].self_attn.k_proj's output, in heads"),
        "layers.{i}.self_attn.attention_queries": Oracle(ATTN_FN + "query argument (after rotary)"),
        "layers.{i}.self_attn.attention_keys": Oracle(ATTN_FN + "key argument (after rotary, before repeat_kv)"),
        "layers.{i}.self_attn.attention_values": Oracle(ATTN_FN + "value argument (before repeat_kv)"),
        "layers.{i}.self_attn.attention_scores": Oracle(
            "eager attention's q·kᵀ·scaling + mask (masked entries read as -inf, TransformerLens's convention; "
            "transformers adds finfo.min)"),
        "layers.{i}.self_attn.attention_probabilities": Oracle(
            "eager attention's softmax weights, what transformers returns as output_attentions (pinned by a test)"),
        "layers.{i}.self_attn.attention_head_outputs": Oracle(ATTN_FN + "output (per head, before o_proj)"),
        "layers.{i}.self_attn.attention_premix": Oracle("layers[i].self_attn.o_proj's input, split into heads"),
        "layers.{i}.self_attn.attention_head_results": Oracle(
            "F.linear(o_proj's input for head h, o_proj.weight's columns of head h), per head",
            read_bound=1e-6, write_bound=1e-6, why=_HEAD_RESULTS_WHY.format(d="head_dim")),
        "layers.{i}.self_attn.attention_output": Oracle("layers[i].self_attn's output"),
        "layers.{i}.layer_mid": Oracle("layers[i].post_attention_layernorm's input (the residual after attention)"),
        **_rms_norm("layers.{i}.post_attention_layernorm.", "layers[i].post_attention_layernorm"),
        "layers.{i}.mlp_norm_output": Oracle("layers[i].post_attention_layernorm's output"),
        "layers.{i}.mlp_input": Oracle("layers[i].mlp's input"),
        "layers.{i}.mlp.mlp_pre_activation": Oracle("layers[i].mlp.up_proj's output"),
        "layers.{i}.mlp.mlp_activation": Oracle("layers[i].mlp.act_fn's output"),
        "layers.{i}.mlp.mlp_neurons": Oracle("layers[i].mlp.down_proj's input"),
        "layers.{i}.mlp.mlp_output": Oracle("layers[i].mlp's output"),
        "layers.{i}.layer_output": Oracle("model.layers[i]'s output"),
        **_rms_norm("norm.", "model.norm"),
        "final_norm_output": Oracle("model.norm's output"),
        "lm_head_output": Oracle("lm_head's output"),
        "logits": Oracle("the logits transformers returns"),
        "next_token_probs": Oracle("softmax (float32) of transformers' logits at the last real position",
                                   read_only=True),
    },
}

LN = "nn.LayerNorm's definition on its input x: "
FACTORED = "ReferenceFactoredProjection.forward step by step: "


def _layer_norm(prefix: str, module: str, layout: str) -> dict[str, Oracle]:
    return {
        f"{prefix}norm_scale": Oracle(LN + f"sqrt(mean((x - mean x)²) + eps), x what {module} normalizes"),
        f"{prefix}norm_normalized": Oracle(LN + f"(x - mean x) / scale in {module}, before its weight and bias "
                                                f"({layout})"),
    }


def _factored(prefix: str, module: str) -> dict[str, Oracle]:
    return {
        f"{prefix}bottleneck": Oracle(FACTORED + f"F.linear(x, {module}.down)"),
        f"{prefix}bottleneck_normed": Oracle(FACTORED + f"F.layer_norm of {module}'s bottleneck (mid_w, mid_b)"),
        **_layer_norm(f"{prefix}norm.", f"{module}'s layer_norm", "rank wide"),
    }


STEP = "the reference block's forward step by step: "
ORACLES["alpha_er"] = {
    "input_ids": Oracle("the ids the reference's wte looks up"),
    "attention_mask": Oracle("the mask the harness is given (the reference takes none: it masks keys "
                             "alongside its causal mask)"),
    "input_size": Oracle("the shape of the ids the reference is called with", read_only=True),
    "token_embeddings": Oracle("wte's output"),
    "position_embeddings": Oracle("wpe's output, per row of the batch"),
    "layers.{i}.layer_input": Oracle("blocks[i]'s input"),
    **_layer_norm("layers.{i}.input_layernorm.", "blocks[i].ln1", "residual"),
    "layers.{i}.attention_norm_output": Oracle("blocks[i].ln1's output"),
    **_factored("layers.{i}.self_attn.qkv_proj.", "blocks[i].qkv"),
    "layers.{i}.self_attn.attention_queries": Oracle(STEP + "q of qkv(ln1(x)).split, split into heads"),
    "layers.{i}.self_attn.attention_keys": Oracle(STEP + "k of qkv(ln1(x)).split, split into heads"),
    "layers.{i}.self_attn.attention_values": Oracle(STEP + "v of qkv(ln1(x)).split, split into heads"),
    "layers.{i}.self_attn.score_mod.attention_raw_scores": Oracle(STEP + "(q @ kᵀ)·(1/sqrt(head_dim)), uncapped"),
    "layers.{i}.self_attn.attention_scores": Oracle(STEP + "tanh(s/cap)·cap, masked_fill(-inf)"),
    "layers.{i}.self_attn.attention_probabilities": Oracle(STEP + "softmax of the masked scores"),
    "layers.{i}.self_attn.attention_head_outputs": Oracle(STEP + "softmax(scores) @ v, heads on the third axis"),
    "layers.{i}.self_attn.attention_premix": Oracle(STEP + "blocks[i].proj's input, split into heads"),
    "layers.{i}.self_attn.attention_head_results": Oracle(
        "from blocks[i].proj's weights: up(mid_w·(z_h - mean z_h)/s) per head, z_h head h's part of the "
        "bottleneck and s the reference bottleneck's LayerNorm scale, plus an equal share of what the heads "
        "miss of proj's output (up(mid_b) excluded)",
        read_bound=1e-6, write_bound=1e-6,
        why=_HEAD_RESULTS_WHY.format(d="head_dim and rank") + "; the scale is the reference's bottleneck's, the "
            "port's the sum of the heads' parts"),
    **_factored("layers.{i}.self_attn.o_proj.", "blocks[i].proj"),
    "layers.{i}.self_attn.attention_output": Oracle("blocks[i].proj's output"),
    "layers.{i}.layer_mid": Oracle(STEP + "x + proj(...), the residual after attention"),
    **_layer_norm("layers.{i}.post_attention_layernorm.", "blocks[i].ln2", "residual"),
    "layers.{i}.mlp_norm_output": Oracle("blocks[i].ln2's output"),
    "layers.{i}.mlp_input": Oracle("blocks[i].ln2's output, as the experts read it (.view(B, G, S, d))"),
    "layers.{i}.mlp.mlp_expert_index": Oracle(STEP + "the window .view(B, G, S, d) puts position t in: t // S",
                                              read_only=True),
    "layers.{i}.mlp.mlp_pre_activation": Oracle(STEP + "einsum(ln2 windows, fc1s), each token's slice in place "
                                                      "of zeros"),
    "layers.{i}.mlp.mlp_activation": Oracle(STEP + "reference_gelu of the pre-activation, dense as above"),
    "layers.{i}.mlp.mlp_neurons": Oracle(STEP + "what einsum(·, fc2s) reads, dense as above"),
    "layers.{i}.mlp.mlp_output": Oracle(STEP + "einsum(h, fc2s).reshape(B, T, d)"),
    "layers.{i}.layer_output": Oracle("blocks[i]'s output"),
    **_layer_norm("norm.", "ln_f", "residual"),
    "final_norm_output": Oracle("ln_f's output"),
    **_factored("lm_head.", "lm_head"),
    "lm_head_output": Oracle("lm_head's output"),
    "logits": Oracle("the logits the reference returns"),
    "next_token_probs": Oracle("softmax (float32) of the reference's logits at the last position", read_only=True),
}


def template(name: str) -> str:
    """A hooked name with its layer index as {i}: the table's key."""
    parts = name.split(".")
    if parts[0] == "layers":
        parts[1] = "{i}"
    return ".".join(parts)


# ------------------------------------------------------------------------------------------------ edits
# Which axes an edit indexes, by the names of a layout's dimensions: one row of the batch, one position,
# one head; every other axis whole.
ROLES = {"batch": "batch", "seq": "pos", "query": "pos", "num_heads": "head", "num_kv_heads": "head"}

# TransformerLens's layouts (its documentation: hook_q ... [batch pos head_index d_head], hook_pattern
# [batch head_index query_pos key_pos]), written here independently of the package's alias table.
_TL_HEADS = ("batch", "pos", "head", None)
TL_AXES = {
    **dict.fromkeys(("hook_q", "hook_k", "hook_v", "hook_z", "hook_rot_q", "hook_rot_k", "hook_result"), _TL_HEADS),
    **dict.fromkeys(("hook_attn_scores", "hook_pattern"), ("batch", "head", "pos", None)),
    **dict.fromkeys(("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_attn_out", "hook_mlp_out",
                     "hook_embed", "hook_pos_embed", "hook_normalized", "hook_scale", "hook_pre", "hook_post"),
                    ("batch", "pos", None)),
}


class Edit:
    """A random edit of one value at one position of one row (and one head where the layout has heads).

    Numbers are added (a random vector, half the size of what is there), a norm's scale is multiplied by
    1.5 (it must stay positive), token ids are moved to another id, and a mask entry is set to 0. The
    amounts are drawn once, from what the first tensor edited holds, so the hooked model and the reference
    get the same arithmetic on the same elements.
    """

    def __init__(self, seed: int, value: str, layout: str, vocab_size: int):
        generator = torch.Generator().manual_seed(seed)
        self.value, self.layout, self.vocab_size = value, layout, vocab_size
        self.row = 1
        self._pos_fraction, self._head_fraction = torch.rand(2, generator=generator).tolist()
        self._generator = generator
        self.delta: Tensor | int | None = None

    def index(self, tensor: Tensor, roles: tuple) -> tuple:
        picks = {}
        for axis, role in enumerate(roles):
            size = tensor.shape[axis]
            if role == "pos":
                picks[axis] = 1 + int(self._pos_fraction * (size - 1))  # never position 0: a row keeps a real token
            elif role == "head":
                picks[axis] = int(self._head_fraction * size)
            elif role == "batch":
                picks[axis] = self.row
        return tuple(picks.get(axis, slice(None)) for axis in range(tensor.ndim))

    def apply(self, tensor: Tensor, roles: tuple) -> None:
        """Edit `tensor` in place; `roles` names its axes ("batch", "pos", "head" or None)."""
        where = self.index(tensor, roles)
        if self.value == "attention_mask":
            tensor[where] = 0
            return
        if self.value == "input_ids":
            if self.delta is None:
                self.delta = 1 + int(torch.randint(0, self.vocab_size - 1, (1,), generator=self._generator))
            tensor[where] = (tensor[where] + self.delta) % self.vocab_size
            return
        if self.delta is None:
            part = tensor[where].float()
            if self.layout == "Scale":
                self.delta = 0.5 * part
            else:
                noise = torch.randn(part.shape, generator=self._generator)
                size = part[part.isfinite()].pow(2).mean().sqrt() if part.isfinite().any() else torch.tensor(1.0)
                self.delta = 0.5 * float(size) * noise
            self.delta = self.delta.to(tensor.dtype)
        tensor[where] += self.delta

    def keep(self, logits: Tensor) -> Tensor:
        """The logit positions to compare: after a mask edit, the real positions only (padding positions'
        outputs are never read, and each implementation fills them its own way)."""
        keep = torch.ones(logits.shape[:2], dtype=torch.bool)
        if self.value == "attention_mask":
            keep[self.index(keep, ("batch", "pos"))] = False
        return keep


class Probe:
    """One reference forward's record of every value, with at most one of them edited.

    `probe(name, tensor, to_std, from_std)`: `to_std` views the reference's tensor in the standard layout
    (what is recorded); an edit is applied there and `from_std` maps it back into the reference's layout.
    """

    def __init__(self, edit_at: str | None = None, edit: Callable[[Tensor], None] | None = None):
        self.seen: dict[str, Tensor] = {}
        self.edit_at, self.edit = edit_at, edit
        self.edited = False

    def __call__(self, name: str, tensor: Tensor, to_std=lambda t: t, from_std=lambda t: t) -> Tensor:
        if name == self.edit_at:
            std = to_std(tensor).clone()
            self.edit(std)
            tensor = from_std(std)
            self.edited = True
        self.seen[name] = to_std(tensor).detach().clone()
        return tensor


def split_heads(heads: int):
    """[batch seq heads·dim] <-> [batch heads seq dim]: what q_proj writes, as the hook holds it."""
    to_std = lambda t: t.view(*t.shape[:2], heads, -1).transpose(1, 2)  # noqa: E731
    from_std = lambda t: t.transpose(1, 2).reshape(t.shape[0], t.shape[2], -1)  # noqa: E731
    return to_std, from_std


def heads_last(heads: int):
    """[batch seq heads·dim] <-> [batch seq heads dim]."""
    return (lambda t: t.view(*t.shape[:2], heads, -1)), (lambda t: t.reshape(*t.shape[:2], -1))


def last_real_probs(logits: Tensor, mask: Tensor | None) -> Tensor:
    """softmax (float32) of each row's logits at its last real position."""
    rows = []
    for b in range(logits.shape[0]):
        last = logits.shape[1] - 1 if mask is None else int(torch.nonzero(mask[b]).max())
        rows.append(logits[b, last].float().softmax(-1))
    return torch.stack(rows)


def positions_over_real_tokens(mask: Tensor) -> Tensor:
    """Position ids counted over the real tokens, as transformers' generate derives them."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)


# ------------------------------------------------------------------------------------------------ Arcee
def _registered_attention(eager: bool):
    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        harness = module.oracle_harness
        point = f"layers.{module.layer_idx}.self_attn."
        probe = harness.probe
        query = probe(point + "attention_queries", query)
        key = probe(point + "attention_keys", key)
        value = probe(point + "attention_values", value)
        if eager:
            out, weights = eager_attention_steps(module, query, key, value, attention_mask, scaling, dropout,
                                                 probe, point)
        else:
            out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                                  scaling=scaling, **kwargs)
        return probe(point + "attention_head_outputs", out), weights

    return attention


def eager_attention_steps(module, query, key, value, attention_mask, scaling, dropout, probe, point):
    """transformers' modeling_arcee.eager_attention_forward, step by step, the scores and the weights as
    points (pinned to it bit for bit by a test)."""
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    # The hooked value holds masked scores as -inf; transformers' additive mask leaves them near finfo.min.
    blocked = (attention_mask != 0) if attention_mask is not None else torch.zeros_like(attn_weights, dtype=torch.bool)
    unmasked = attn_weights
    attn_weights = probe(point + "attention_scores", attn_weights,
                         to_std=lambda w: w.masked_fill(blocked, float("-inf")),
                         from_std=lambda s: torch.where(blocked, unmasked, s))
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = probe(point + "attention_probabilities", attn_weights)
    attn_weights = F.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, attn_weights


for _name, _eager in (("oracle_sdpa", False), ("oracle_eager", True)):
    AttentionInterface.register(_name, _registered_attention(_eager))
    AttentionMaskInterface.register(_name, eager_mask if _eager else sdpa_mask)


def rms_norm_steps(norm, x: Tensor, out: Tensor, probe: Probe, prefix: str) -> Tensor:
    """transformers' ArceeRMSNorm.forward step by step with the scale and the normalized value as points.

    A written scale divides the stream where it changed (TransformerLens's x / scale); positions it left
    alone keep transformers' numbers. With no edit this returns `out`, transformers' own output.
    """
    input_dtype = x.dtype
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    scale = (variance + norm.variance_epsilon).sqrt()
    written_scale = probe(prefix + "norm_scale", scale)
    normalized = x32 * torch.rsqrt(variance + norm.variance_epsilon)
    changed = (written_scale != scale).expand_as(normalized)
    normalized = torch.where(changed, x32 / written_scale, normalized).to(input_dtype)
    written = probe(prefix + "norm_normalized", normalized)
    if written_scale is scale and written is normalized:
        return out
    return norm.weight * written


class ArceeReference:
    """transformers' ArceeForCausalLM with a forward hook (or pre-hook) at every value, through a Probe."""

    def __init__(self, hf):
        self.hf, self.probe = hf, Probe()
        self.heads, self.kv_heads = hf.config.num_attention_heads, hf.config.num_key_value_heads
        self.handles = []
        base = hf.model
        self._hook(base.embed_tokens, pre=lambda args: (self.probe("input_ids", args[0]),))
        self._hook(base.embed_tokens, post=lambda args, out: self.probe("token_embeddings", out))
        base.register_forward_pre_hook(self._model_inputs, with_kwargs=True)
        for i, layer in enumerate(base.layers):
            self._layer(f"layers.{i}.", layer)
        self._hook(base.norm, post=lambda args, out: self.probe(
            "final_norm_output", rms_norm_steps(base.norm, args[0], out, self.probe, "norm.")))
        self._hook(hf.lm_head, post=lambda args, out: self.probe("lm_head_output", out))

    def _hook(self, module, pre=None, post=None):
        if pre is not None:
            module.register_forward_pre_hook(lambda m, args: pre(args))
        if post is not None:
            module.register_forward_hook(lambda m, args, out: post(args, out))

    def _model_inputs(self, module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if self.probe.edit_at == "attention_mask" and mask is None:
            mask = torch.ones_like(kwargs["input_ids"])
        if mask is None:
            return None
        written = self.probe("attention_mask", mask)
        if written is not mask:  # padding where the edit put it, positions counted over the real tokens
            kwargs = {**kwargs, "attention_mask": written, "position_ids": positions_over_real_tokens(written)}
        return args, kwargs

    def _layer(self, p: str, layer):
        attn, mlp = layer.self_attn, layer.mlp
        attn.oracle_harness = self
        kept = {}
        self._hook(layer, pre=lambda args: (self.probe(p + "layer_input", args[0]), *args[1:]))
        self._hook(layer.input_layernorm, post=lambda args, out: self.probe(
            p + "attention_norm_output",
            rms_norm_steps(layer.input_layernorm, args[0], out, self.probe, p + "input_layernorm.")))
        self._hook(attn.q_proj, post=lambda args, out: self.probe(
            p + "self_attn.attention_queries_unrotated", out, *split_heads(self.heads)))
        self._hook(attn.k_proj, post=lambda args, out: self.probe(
            p + "self_attn.attention_keys_unrotated", out, *split_heads(self.kv_heads)))
        self._hook(attn.o_proj, pre=lambda args: (self.probe(p + "self_attn.attention_premix", args[0],
                                                             *heads_last(self.heads)),))
        self._hook(attn.o_proj, post=lambda args, out: self._head_results(p, attn.o_proj, args[0], out))
        self._hook(attn, post=lambda args, out: (self.probe(p + "self_attn.attention_output", out[0]), *out[1:]))

        def mid(args):
            kept["mid"] = self.probe(p + "layer_mid", args[0])
            return (kept["mid"],)

        # A written layer_mid is the residual too: the layer then returns it plus the MLP's output,
        # as transformers' `residual + hidden_states`.
        self._hook(layer.post_attention_layernorm, pre=mid)
        self._hook(layer.post_attention_layernorm, post=lambda args, out: self.probe(
            p + "mlp_norm_output",
            rms_norm_steps(layer.post_attention_layernorm, args[0], out, self.probe, p + "post_attention_layernorm.")))
        self._hook(mlp, pre=lambda args: (self.probe(p + "mlp_input", args[0]),))
        self._hook(mlp.up_proj, post=lambda args, out: self.probe(p + "mlp.mlp_pre_activation", out))
        self._hook(mlp.act_fn, post=lambda args, out: self.probe(p + "mlp.mlp_activation", out))
        self._hook(mlp.down_proj, pre=lambda args: (self.probe(p + "mlp.mlp_neurons", args[0]),))

        def mlp_output(args, out):
            kept["mlp"] = self.probe(p + "mlp.mlp_output", out)
            return kept["mlp"]

        self._hook(mlp, post=mlp_output)

        def layer_output(args, out):
            if self.probe.edit_at == p + "layer_mid":
                out = kept["mid"] + kept["mlp"]
            return self.probe(p + "layer_output", out)

        self._hook(layer, post=layer_output)

    def _head_results(self, p: str, o_proj, premix: Tensor, out: Tensor) -> Tensor:
        """Head h's term of o_proj: its slice of the input through its columns of the weight."""
        d = premix.shape[-1] // self.heads
        results = torch.stack([F.linear(premix[..., h * d:(h + 1) * d], o_proj.weight[:, h * d:(h + 1) * d])
                               for h in range(self.heads)], dim=-2)
        written = self.probe(p + "self_attn.attention_head_results", results)
        if written is results:
            return out
        return written.sum(-2) + (0.0 if o_proj.bias is None else o_proj.bias)

    @torch.no_grad()
    def run(self, ids: Tensor, attention_mask: Tensor | None = None, probe: Probe | None = None,
            eager: bool = False) -> Tensor:
        """The logits, every value recorded in `probe` (and its edit made); eager attention or sdpa."""
        self.probe = probe or Probe()
        self.hf.config._attn_implementation = "oracle_eager" if eager else "oracle_sdpa"
        kwargs = {}
        if attention_mask is not None:
            kwargs = dict(attention_mask=attention_mask, position_ids=positions_over_real_tokens(attention_mask))
        try:
            self.probe("input_size", torch.tensor(tuple(ids.shape)))
            output = self.hf(ids, **kwargs)
            logits = self.probe("logits", output.logits)
            self.probe("next_token_probs", last_real_probs(logits, attention_mask))
            return logits
        finally:
            self.probe = Probe()


# ---------------------------------------------------------------------------------------------- alpha-er
def dense(compact: Tensor) -> Tensor:
    """[batch expert window width] -> [batch seq expert·width]: each token's slice in place, zeros elsewhere."""
    batch, experts, window, width = compact.shape
    out = compact.new_zeros(batch, experts, window, experts, width)
    for g in range(experts):
        out[:, g, :, g] = compact[:, g]
    return out.view(batch, experts * window, experts * width)


def own_slices(full: Tensor, experts: int) -> Tensor:
    """The inverse of `dense`: each token's own expert's slice, whatever the rest holds."""
    batch, seq, wide = full.shape
    blocks = full.view(batch, experts, seq // experts, experts, wide // experts)
    return torch.stack([blocks[:, g, :, g] for g in range(experts)], dim=1)


class AlphaErReference:
    """The transcribed alpha-er reference, run step by step on its own modules and weights, every
    intermediate a Probe point (`model_steps`, `block_steps`, `factored_steps` are its forwards)."""

    def __init__(self, reference):
        self.reference, self.probe = reference, Probe()
        self.mask: Tensor | None = None

    def layer_norm_steps(self, prefix: str, x: Tensor, weight: Tensor, bias: Tensor, eps: float, out: Tensor) -> Tensor:
        """The scale and the normalized value of a LayerNorm by its definition, as points. A write there is
        carried as TransformerLens carries it, normalized · weight + bias, where it changed the normalized
        value; elsewhere `out`, the reference's own fused output."""
        x32 = x.float()
        centred = x32 - x32.mean(-1, keepdim=True)
        scale = (centred.pow(2).mean(-1, keepdim=True) + eps).sqrt()
        computed = (centred / scale).to(x.dtype)
        normalized = (centred / self.probe(prefix + "norm_scale", scale)).to(x.dtype)
        written = self.probe(prefix + "norm_normalized", normalized)
        return torch.where(written == computed, out, written * weight + bias)

    def module_norm(self, prefix: str, ln, x: Tensor) -> Tensor:
        return self.layer_norm_steps(prefix, x, ln.weight, ln.bias, ln.eps, ln(x))

    def factored_steps(self, prefix: str, proj, x: Tensor) -> Tensor:
        """ReferenceFactoredProjection.forward."""
        at = self.probe
        z = at(prefix + "bottleneck", F.linear(x, proj.down))
        normed = F.layer_norm(z, (z.shape[-1],), proj.mid_w, proj.mid_b, proj.eps)
        z = at(prefix + "bottleneck_normed", self.layer_norm_steps(prefix + "norm.", z, proj.mid_w, proj.mid_b,
                                                                   proj.eps, normed))
        return F.linear(z, proj.up)

    @staticmethod
    def head_results(proj, premix: Tensor, out: Tensor, heads: int) -> Tensor:
        """Each head's term of a factored projection whose input is the heads side by side: the bottleneck
        LayerNorm's mean and scale fixed at the whole input's, head h gives up(mid_w·(z_h - mean z_h)/s);
        what the terms miss of the output (less up(mid_b)) is shared equally."""
        d = premix.shape[-1] // heads
        z = F.linear(premix, proj.down).float()
        scale = ((z - z.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True) + proj.eps).sqrt()
        terms = []
        for h in range(heads):
            z_h = F.linear(premix[..., h * d:(h + 1) * d], proj.down[:, h * d:(h + 1) * d])
            normalized = ((z_h - z_h.mean(-1, keepdim=True)).float() / scale).to(premix.dtype)
            terms.append(F.linear(normalized * proj.mid_w, proj.up))
        terms = torch.stack(terms, dim=-2)
        rest = out - F.linear(proj.mid_b, proj.up) - terms.sum(-2)
        return terms + rest.unsqueeze(-2) / heads

    def block_steps(self, i: int, blk, x: Tensor) -> Tensor:
        """ReferenceAlphaErBlock.forward."""
        at, p = self.probe, f"layers.{i}."
        B, T, d = x.shape
        H = blk.cfg.n_head
        hd = d // H
        x = at(p + "layer_input", x)
        a = at(p + "attention_norm_output", self.module_norm(p + "input_layernorm.", blk.ln1, x))
        q, k, v = self.factored_steps(p + "self_attn.qkv_proj.", blk.qkv, a).split(d, dim=-1)
        q = at(p + "self_attn.attention_queries", q.view(B, T, H, hd).transpose(1, 2))
        k = at(p + "self_attn.attention_keys", k.view(B, T, H, hd).transpose(1, 2))
        v = at(p + "self_attn.attention_values", v.view(B, T, H, hd).transpose(1, 2))
        cap = blk.cfg.attn_soft_cap
        scores = at(p + "self_attn.score_mod.attention_raw_scores", (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd)))
        if cap and cap > 0:
            scores = torch.tanh(scores / cap) * cap
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        if self.mask is not None:  # padding: keys no query attends to
            mask = mask & self.mask.bool()[:, None, None, :]
        scores = at(p + "self_attn.attention_scores", scores.masked_fill(~mask, float("-inf")))
        att = at(p + "self_attn.attention_probabilities", torch.softmax(scores, dim=-1)) @ v
        heads = at(p + "self_attn.attention_head_outputs", att.transpose(1, 2))
        premix = at(p + "self_attn.attention_premix", heads.reshape(B, T, d), *heads_last(H))
        attn_out = self.factored_steps(p + "self_attn.o_proj.", blk.proj, premix)
        results = self.head_results(blk.proj, premix, attn_out, H)
        written = at(p + "self_attn.attention_head_results", results)
        if written is not results:  # the attention output is then their sum, plus what no head owns
            attn_out = written.sum(-2) + F.linear(blk.proj.mid_b, blk.proj.up)
        x = at(p + "layer_mid", x + at(p + "self_attn.attention_output", attn_out))
        G = blk.cfg.mlp_experts
        S = T // G
        m = at(p + "mlp_norm_output", self.module_norm(p + "post_attention_layernorm.", blk.ln2, x))
        m = at(p + "mlp_input", m)
        at(p + "mlp.mlp_expert_index", (torch.arange(T, device=x.device) // S).expand(B, T))
        b = m.view(B, G, S, d)
        expert_layout = (dense, lambda full: own_slices(full, G))
        pre = at(p + "mlp.mlp_pre_activation", torch.einsum("bgsd,gfd->bgsf", b, blk.fc1s), *expert_layout)
        h = at(p + "mlp.mlp_activation", reference_gelu(pre), *expert_layout)
        h = at(p + "mlp.mlp_neurons", h, *expert_layout)
        y = at(p + "mlp.mlp_output", torch.einsum("bgsf,gdf->bgsd", h, blk.fc2s).reshape(B, T, d))
        return at(p + "layer_output", x + y)

    def model_steps(self, ids: Tensor) -> Tensor:
        """ReferenceAlphaErForCausalLM.forward (its length check aside: the harness runs valid lengths)."""
        at, ref = self.probe, self.reference
        B, T = ids.shape
        pos = torch.arange(T, device=ids.device)
        ids = at("input_ids", ids)
        tokens = at("token_embeddings", ref.wte(ids))
        positions = at("position_embeddings", ref.wpe(pos), lambda t: t.expand(B, T, -1))
        x = tokens + positions
        for i, blk in enumerate(ref.blocks):
            x = self.block_steps(i, blk, x)
        x = at("final_norm_output", self.module_norm("norm.", ref.ln_f, x))
        return at("lm_head_output", self.factored_steps("lm_head.", ref.lm_head, x))

    @torch.no_grad()
    def run(self, ids: Tensor, attention_mask: Tensor | None = None, probe: Probe | None = None,
            eager: bool = False) -> Tensor:
        self.probe = probe or Probe()
        try:
            self.probe("input_size", torch.tensor(tuple(ids.shape)))
            mask = attention_mask
            if mask is None and self.probe.edit_at == "attention_mask":
                mask = torch.ones_like(ids)
            if mask is not None:
                mask = self.probe("attention_mask", mask)
            self.mask = mask
            logits = self.probe("logits", self.model_steps(ids))
            self.probe("next_token_probs", last_real_probs(logits, attention_mask))
            return logits
        finally:
            self.probe, self.mask = Probe(), None


# ---------------------------------------------------------------------------------------------- the pair
class Pair:
    """A family's hooked model beside its reference harness, on fixed tokens; what the tests and the
    report measure."""

    def __init__(self, family: str, model, reference, tokens: Tensor, mask: Tensor):
        self.family, self.model, self.reference, self.tokens, self.mask = family, model, reference, tokens, mask
        self.table = ORACLES[family]
        self._plain: dict[bool, Tensor] = {}
        self._recorded: dict[bool, dict[str, Tensor]] = {}

    def templates(self) -> set[str]:
        return {template(name) for name in self.model.standard_hook_dict}

    def instances(self, key: str) -> list[str]:
        return [name for name in self.model.standard_hook_dict if template(name) == key]

    def value(self, name: str):
        return self.model.standard_hook_dict[name].value

    def explicit(self, key: str) -> bool:
        """Whether hooking this value sends Arcee's attention down its explicit path (transformers'
        "eager" arithmetic) rather than the fused one ("sdpa")."""
        return key.rpartition(".")[2] in ("attention_scores", "attention_probabilities")

    def _mask_for(self, key: str) -> Tensor | None:
        return self.mask if key == "attention_mask" else None

    def recorded(self, key: str) -> dict[str, Tensor]:
        eager, mask = self.explicit(key), self._mask_for(key)
        if mask is not None:
            probe = Probe()
            self.reference.run(self.tokens, mask, probe=probe, eager=eager)
            return probe.seen
        if eager not in self._recorded:
            probe = Probe()
            self.reference.run(self.tokens, probe=probe, eager=eager)
            self._recorded[eager] = probe.seen
        return self._recorded[eager]

    @torch.no_grad()
    def read(self, key: str) -> list[tuple[str, Tensor, Tensor | None]]:
        """(name, hooked value, reference value) for every instance of the value."""
        names = self.instances(key)
        _, cache = self.model.run_with_cache(self.tokens, attention_mask=self._mask_for(key), names_filter=names)
        seen = self.recorded(key)
        return [(name, cache[name], seen.get(name)) for name in names]

    def plain_logits(self, eager: bool) -> Tensor:
        if eager not in self._plain:
            self._plain[eager] = self.reference.run(self.tokens, eager=eager)
        return self._plain[eager]

    def names_of(self, key: str) -> list[str]:
        """The instance a write test edits (layer 0's), under its standard name and each TransformerLens name."""
        canonical = self.instances(key)[0]
        return self.model.hook_names(canonical)

    def roles(self, name: str) -> tuple:
        canonical, _ = self.model.resolve_hook_name(name)
        if name == canonical:
            return tuple(ROLES.get(dim) for dim in self.value(canonical).dims)
        return TL_AXES[name.rpartition(".")[2]]

    def edit_for(self, key: str) -> Edit:
        value = self.value(self.instances(key)[0])
        return Edit(zlib.crc32(f"{self.family}:{key}".encode()), value.name, value.layout, self.model.cfg.vocab_size)

    @torch.no_grad()
    def write(self, key: str) -> tuple[dict[str, Tensor], Tensor, Tensor, Tensor]:
        """({name: hooked logits after the edit under that name}, the reference's logits after the same
        edit, its logits without it, the positions to compare)."""
        edit = self.edit_for(key)
        hooked = {}
        for name in self.names_of(key):
            roles = self.roles(name)

            def hook(tensor, hook, roles=roles):
                tensor = tensor.clone()
                edit.apply(tensor, roles)
                return tensor

            hooks = [(name, hook)]
            if self.explicit(key):  # every layer on the explicit path, as the reference's eager attention
                hooks.insert(0, (lambda hook_name: hook_name.endswith(".attention_scores"), lambda t, hook: None))
            hooked[name] = self.model.run_with_hooks(self.tokens, fwd_hooks=hooks)
        canonical = self.instances(key)[0]
        standard = self.roles(canonical)
        probe = Probe(canonical, lambda tensor: edit.apply(tensor, standard))
        eager = self.explicit(key)
        reference = self.reference.run(self.tokens, probe=probe, eager=eager)
        assert probe.edited, f"the reference never reached {canonical}"
        return hooked, reference, self.plain_logits(eager), edit.keep(reference)


def within(hooked: Tensor, reference: Tensor, bound: float) -> bool:
    """Bit for bit (bound 0), or max |difference| <= bound · max |reference| over finite entries."""
    if bound == 0:
        return hooked.dtype == reference.dtype and torch.equal(hooked, reference)
    same_inf = torch.equal(torch.isinf(hooked), torch.isinf(reference))
    finite = torch.isfinite(reference)
    return same_inf and max_diff(hooked, reference) <= bound * float(reference[finite].abs().max())


def max_diff(hooked: Tensor, reference: Tensor) -> float:
    """max |hooked - reference| over the entries where the reference is finite (masked scores are -inf in both)."""
    finite = torch.isfinite(reference)
    if not finite.any():
        return 0.0
    return float((hooked.double()[finite] - reference.double()[finite]).abs().max())


def make_pairs(hf_arcee, reference_alpha_er) -> dict[str, Pair]:
    """Both families' pairs from a transformers ArceeForCausalLM and a transcribed alpha-er reference."""
    from hooked_models import HookedAlphaEr, HookedArcee

    generator = torch.Generator().manual_seed(0)
    arcee_ids = torch.randint(3, hf_arcee.config.vocab_size, (2, 12), generator=generator)
    alpha_ids = torch.randint(0, reference_alpha_er.cfg.vocab_size, (2, 8), generator=generator)
    left_padded = torch.ones_like(arcee_ids)
    left_padded[1, :3] = 0
    right_padded = torch.ones_like(alpha_ids)
    right_padded[1, 5:] = 0
    return {
        "arcee": Pair("arcee", HookedArcee.from_hf(hf_arcee), ArceeReference(hf_arcee), arcee_ids, left_padded),
        "alpha_er": Pair("alpha_er", HookedAlphaEr.from_reference(reference_alpha_er),
                         AlphaErReference(reference_alpha_er), alpha_ids, right_padded),
    }
