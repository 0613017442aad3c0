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
