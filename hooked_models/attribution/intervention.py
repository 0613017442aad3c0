"""Interventions on the replacement model: features clamped, every later feature responding
(circuit-tracer's `ReplacementModel.feature_intervention`); `replacement_runs`, its batched run, which the
supernode interventions read (supernode_intervention.py); and steering, a feature's decoder row added to
the model's MLP output at a chosen strength (`feature_steering`, `feature_steering_generate`)."""

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from jaxtyping import Float
from torch import Tensor

from hooked_models.attribution.replacement import Prompt, check_prompt, is_frozen, prompt_tokens, written_layers


def feature_intervention(model, prompt, transcoders, interventions: Sequence[tuple[int, int, int, float]], *,
                         freeze_attention: bool = True) -> Float[Tensor, "seq vocab"]:
    """The logits of the replacement model (transcoders with their error terms fixed at the prompt's
    values) with each (layer, position, feature, value) set: that feature's activation is `value`, and
    every later feature responds, computed by its transcoder from its live input. With
    `freeze_attention`, attention patterns and norm scales keep their prompt values (the model in which
    the graph's edges are direct effects, apart from the features' nonlinearity); without, they move.
    With no intervention the logits are the model's bit for bit (with `freeze_attention`, as the model
    computes them with attention explicit, which any hook on the pattern makes it)."""
    tokens = prompt_tokens(model, prompt)
    check_prompt(model, tokens, transcoders)
    state = Prompt(model, tokens, transcoders, frozen=freeze_attention)
    seq, n_layers = tokens.shape[1], transcoders.n_layers
    for item in interventions:
        layer, pos, feature, _ = item
        if not (0 <= layer < n_layers and 0 <= pos < seq and 0 <= feature < transcoders.d_transcoder):
            raise ValueError(f"intervention {item}: layer must be in [0, {n_layers}), position in [0, {seq}), "
                             f"feature in [0, {transcoders.d_transcoder})")
    edits = [Edit(features=[tuple(item) for item in interventions])]
    return replacement_runs(state, edits, freeze_attention=freeze_attention)[0][0]


@dataclass
class Edit:
    """What one row of a batch of replacement runs changes: features set to a value, (layer, position,
    feature, value), or to a multiple of their value in row 0, (layer, position, feature, scale), row 0
    being the clean run (an empty edit); error terms and embeddings scaled, (layer, position, scale) and
    (position, scale)."""

    features: list[tuple[int, int, int, float]] = field(default_factory=list)
    scaled: list[tuple[int, int, int, float]] = field(default_factory=list)
    errors: list[tuple[int, int, float]] = field(default_factory=list)
    embeddings: list[tuple[int, float]] = field(default_factory=list)


def replacement_runs(state: Prompt, edits: Sequence[Edit], *, freeze_attention: bool = True
                     ) -> tuple[Float[Tensor, "batch seq vocab"], list[Float[Tensor, "batch seq feature"]]]:
    """The replacement model of `state`'s prompt, one row per edit, in one batched forward (`state`
    built with `frozen=freeze_attention`; the edits' indices already checked): the logits and every
    layer's feature activations, the set ones included. Row by row, `feature_intervention`'s run."""
    model, transcoders, tokens = state.model, state.transcoders, state.tokens
    n_layers, batch = transcoders.n_layers, len(edits)
    features: dict[int, list] = {}
    scaled_features: dict[int, list] = {}
    errors: dict[int, list] = {}
    for b, edit in enumerate(edits):
        for layer, pos, feature, value in edit.features:
            features.setdefault(layer, []).append((b, pos, feature, value))
        for layer, pos, feature, scale in edit.scaled:
            scaled_features.setdefault(layer, []).append((b, pos, feature, scale))
        for layer, pos, scale in edit.errors:
            errors.setdefault(layer, []).append((b, pos, scale))
    scaled = [(b, pos, scale) for b, edit in enumerate(edits) for pos, scale in edit.embeddings]
    hooks = []
    if freeze_attention:
        with torch.no_grad():
            _, frozen = model.run_with_cache(tokens, names_filter=is_frozen)
        hooks.append((is_frozen, lambda t, hook: frozen[hook.name].to(t.dtype).expand(t.shape)))
    if scaled:
        def embed(t, hook):
            t = t.clone()
            for b, pos, scale in scaled:
                t[b, pos] = t[b, pos] * scale
            return t
        hooks.append(("layers.0.layer_input", embed))
    live: dict[int, Tensor] = {}
    acts: list[Tensor] = [None] * n_layers

    def read(t, hook, layer):
        live[layer] = t.to(state.x[0].dtype)
        a = transcoders.encode(layer, live[layer]).clone()
        for b, pos, feature, value in features.get(layer, []):
            a[b, pos, feature] = value
        for b, pos, feature, scale in scaled_features.get(layer, []):
            # scale x the clean value, rounded once (as a Python float value would be)
            a[b, pos, feature] = (a[0, pos, feature].double() * scale).to(a.dtype)
        acts[layer] = a

    def write(t, hook, layer):
        recons = transcoders.decode_to(layer, acts[:layer + 1] + [torch.zeros_like(acts[layer])] * (n_layers - layer - 1),
                                       live[layer] if transcoders.has_skip else None)
        # The clean output minus what the reconstruction moved: exactly the clean output when nothing did.
        out = state.mlp_out[layer].to(recons.dtype) - (state.recons[layer] - recons)
        for b, pos, scale in errors.get(layer, []):  # the error term, (scale - 1) of it more
            out[b, pos] = out[b, pos] + (scale - 1) * state.errors[layer, pos]
        return out.to(t.dtype)

    for l in range(n_layers):
        hooks += [(state.inputs[l], lambda t, hook, l=l: read(t, hook, l)),
                  (state.outputs[l], lambda t, hook, l=l: write(t, hook, l))]
    with torch.no_grad():
        logits = model.run_with_hooks(tokens.expand(batch, -1), fwd_hooks=hooks)
    return logits, acts


def feature_intervention_generate(model, prompt, transcoders, interventions: Sequence[tuple], *,
                                  max_new_tokens: int = 10, do_sample: bool = False, **generate_kwargs) -> Tensor:
    """Continue `prompt` (greedily unless `do_sample`; `generate_kwargs` go to `model.generate`) with
    features clamped: each (layer, position, feature, value) sets that feature's activation at that
    position, an int (one past the prompt or later: once generated) or a slice (`slice(5, None)`: from
    position 5 on, every new position included). Returns the token ids, prompt and continuation [seq].

    The replacement model of circuit-tracer's `feature_intervention_generate`, its errors live: at each
    position the MLP's output moves by what the clamping moves its transcoder's reconstruction (the
    error, what the transcoder misses there, stays the model's own), and every later feature, read from
    its live input, responds. Attention is live (new positions have no frozen pattern). With no
    intervention the tokens are the model's own generation (recomputed whole at each step, no cache)."""
    tokens = prompt_tokens(model, prompt)
    check_prompt(model, tokens, transcoders)
    n_layers, limit = transcoders.n_layers, model.max_positions
    by_layer = _by_layer(interventions, transcoders, model.max_positions, "intervention")
    dtype = transcoders.dtype
    clean: dict[int, Tensor] = {}
    clamped: dict[int, Tensor] = {}
    live: dict[int, Tensor] = {}

    def read(t, hook, layer):
        live[layer] = t.to(dtype)
        clean[layer] = transcoders.encode(layer, live[layer])
        a = clean[layer].clone()
        for pos, feature, value in by_layer.get(layer, []):
            if isinstance(pos, slice) or pos < a.shape[1]:
                a[:, pos, feature] = value
        clamped[layer] = a

    def write(t, hook, layer):
        x = live[layer] if transcoders.has_skip else None
        moved = transcoders.decode_to(layer, clamped, x) - transcoders.decode_to(layer, clean, x)
        return t + moved.to(t.dtype)  # exactly t where the clamping moved nothing

    hooks = []
    for l in range(n_layers):
        hooks += [(transcoders.input_hook(l), lambda t, hook, l=l: read(t, hook, l)),
                  (transcoders.output_hook(l), lambda t, hook, l=l: write(t, hook, l))]
    return _generate(model, tokens, hooks, max_new_tokens, do_sample, generate_kwargs)


def feature_steering(model, prompt, transcoders, steering: Sequence[tuple]) -> Float[Tensor, "seq vocab"]:
    """The model's logits with each (layer, position, feature, strength) steering: `strength` times the
    feature's decoder row added to the MLP output it writes (a cross-layer transcoder's feature: to each
    later layer's, by its decoder there) at that position, an int or a slice (`slice(None)`: every
    position). The model itself, no replacement: nothing is encoded, every value downstream moves
    (attention, norms, MLPs). Clamping the feature's activation to its value plus `strength` in
    `feature_intervention_generate` moves the MLP outputs by the same vector (decoding is linear)."""
    tokens = prompt_tokens(model, prompt)
    check_prompt(model, tokens, transcoders)
    hooks = _steering_hooks(transcoders, _by_layer(steering, transcoders, tokens.shape[1], "steering"))
    with torch.no_grad():
        return model.run_with_hooks(tokens, fwd_hooks=hooks)[0]


def feature_steering_generate(model, prompt, transcoders, steering: Sequence[tuple], *, max_new_tokens: int = 10,
                              do_sample: bool = False, **generate_kwargs) -> Tensor:
    """Continue `prompt` with `feature_steering`'s steering at each step (a position past the prompt
    is steered once generated; a slice covers the new positions too): the token ids, prompt and
    continuation [seq]. With strength 0 the model's own generation (recomputed whole each step)."""
    tokens = prompt_tokens(model, prompt)
    check_prompt(model, tokens, transcoders)
    hooks = _steering_hooks(transcoders, _by_layer(steering, transcoders, model.max_positions, "steering"))
    return _generate(model, tokens, hooks, max_new_tokens, do_sample, generate_kwargs)


def _steering_hooks(transcoders, by_layer: dict[int, list]) -> list:
    """fwd_hooks adding strength x decoder row to each MLP output a steered feature writes."""
    adds: dict[int, list] = {}
    for layer, items in by_layer.items():
        for pos, feature, strength in items:
            for target in written_layers(transcoders, layer):
                row = transcoders.decoder_rows(layer, target, [feature])[0]
                adds.setdefault(target, []).append((pos, strength * row))

    def add(t, hook, target):
        t = t.clone()
        for pos, vector in adds[target]:
            if isinstance(pos, slice) or pos < t.shape[1]:  # a position not generated yet is skipped
                t[:, pos] = t[:, pos] + vector.to(t.dtype)
        return t

    return [(transcoders.output_hook(t), lambda x, hook, t=t: add(x, hook, t)) for t in adds]


def _by_layer(items: Sequence[tuple], transcoders, limit: int, what: str) -> dict[int, list]:
    """(layer, position, feature, value) items by layer, checked: a position an int or a slice whose
    start is in [0, limit), a finite number as value."""
    n_layers, by_layer = transcoders.n_layers, {}
    for item in items:
        if len(item) != 4:
            raise ValueError(f"{what} {item!r} must be (layer, position, feature, value)")
        layer, pos, feature, value = item
        start = pos.start or 0 if isinstance(pos, slice) else pos
        if not (0 <= layer < n_layers and isinstance(start, int) and 0 <= start < limit
                and 0 <= feature < transcoders.d_transcoder):
            raise ValueError(f"{what} {item}: layer must be in [0, {n_layers}), position (or a slice's start) "
                             f"in [0, {limit}), feature in [0, {transcoders.d_transcoder})")
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(f"{what} {item}: the value {value!r} must be a finite number")
        by_layer.setdefault(layer, []).append((pos, feature, value))
    return by_layer


def _generate(model, tokens: Tensor, hooks: list, max_new_tokens: int, do_sample: bool, kwargs: dict) -> Tensor:
    with torch.no_grad():
        out = model.generate(tokens, max_new_tokens=max_new_tokens, do_sample=do_sample, fwd_hooks=hooks,
                             use_cache=False, verbose=False, **kwargs)
    return out[0]
