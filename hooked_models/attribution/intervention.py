"""Interventions on the replacement model: features clamped, every later feature responding
(circuit-tracer's `ReplacementModel.feature_intervention`)."""

from collections.abc import Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from hooked_models.attribution.replacement import Prompt, check_prompt, is_frozen, prompt_tokens


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
    by_layer: dict[int, list] = {}
    for item in interventions:
        layer, pos, feature, value = item
        if not (0 <= layer < n_layers and 0 <= pos < seq and 0 <= feature < transcoders.d_transcoder):
            raise ValueError(f"intervention {item}: layer must be in [0, {n_layers}), position in [0, {seq}), "
                             f"feature in [0, {transcoders.d_transcoder})")
        by_layer.setdefault(layer, []).append((pos, feature, value))
    hooks = []
    if freeze_attention:
        with torch.no_grad():
            _, frozen = model.run_with_cache(tokens, names_filter=is_frozen)
        hooks.append((is_frozen, lambda t, hook: frozen[hook.name].to(t.dtype)))
    live: dict[int, Tensor] = {}
    acts: list[Tensor] = [None] * n_layers

    def read(t, hook, layer):
        live[layer] = t[0].to(state.x[0].dtype)
        a = transcoders.encode(layer, live[layer]).clone()
        for pos, feature, value in by_layer.get(layer, []):
            a[pos, feature] = value
        acts[layer] = a

    def write(t, hook, layer):
        recons = transcoders.decode_to(layer, acts[:layer + 1] + [torch.zeros_like(acts[layer])] * (n_layers - layer - 1),
                                       live[layer] if transcoders.has_skip else None)
        # The clean output minus what the reconstruction moved: exactly the clean output when nothing did.
        out = state.mlp_out[layer].to(recons.dtype) - (state.recons[layer] - recons)
        return out.to(t.dtype)[None]

    for l in range(n_layers):
        hooks += [(state.inputs[l], lambda t, hook, l=l: read(t, hook, l)),
                  (state.outputs[l], lambda t, hook, l=l: write(t, hook, l))]
    with torch.no_grad():
        return model.run_with_hooks(tokens, fwd_hooks=hooks)[0]


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
    by_layer: dict[int, list] = {}
    for item in interventions:
        layer, pos, feature, value = item
        start = pos.start or 0 if isinstance(pos, slice) else pos
        if not (0 <= layer < n_layers and isinstance(start, int) and 0 <= start < limit
                and 0 <= feature < transcoders.d_transcoder):
            raise ValueError(f"intervention {item}: layer must be in [0, {n_layers}), position (or a slice's start) "
                             f"in [0, {limit}), feature in [0, {transcoders.d_transcoder})")
        by_layer.setdefault(layer, []).append((pos, feature, value))
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
    with torch.no_grad():
        out = model.generate(tokens, max_new_tokens=max_new_tokens, do_sample=do_sample, fwd_hooks=hooks,
                             use_cache=False, verbose=False, **generate_kwargs)
    return out[0]
