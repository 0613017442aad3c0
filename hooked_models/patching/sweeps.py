"""Named sweeps: the common questions (TransformerLens's `get_act_patch_*`), each one value over its usual axes."""

from hooked_models.patching.activation import activation_patch
from hooked_models.patching.result import PatchingResult


def patch_residual_stream(model, clean, corrupted, metric, value: str = "layer_input", **options) -> PatchingResult:
    """The residual stream entering each layer, by layer × position (TransformerLens's resid_pre sweep)."""
    return activation_patch(model, clean, corrupted, metric, value, ("layer", "seq"), **options)


def patch_attention_heads(model, clean, corrupted, metric, value: str = "attention_head_outputs",
                          **options) -> PatchingResult:
    """Each head's output (or queries, pattern, ...: pass `value`), by layer × head, all positions."""
    return activation_patch(model, clean, corrupted, metric, value, ("layer", "head"), **options)


def patch_kv_heads(model, clean, corrupted, metric, value: str = "attention_keys", **options) -> PatchingResult:
    """Keys or values by layer × key/value head: under GQA one patch reaches every query head of its group."""
    return activation_patch(model, clean, corrupted, metric, value, ("layer", "num_kv_heads"), **options)


def patch_mlp_outputs(model, clean, corrupted, metric, value: str = "mlp_output", **options) -> PatchingResult:
    """What each MLP adds to the residual stream, by layer × position."""
    return activation_patch(model, clean, corrupted, metric, value, ("layer", "seq"), **options)


def patch_neurons(model, clean, corrupted, metric, value: str = "mlp_neurons", **options) -> PatchingResult:
    """Single MLP neurons, by layer × neuron, at every position (restrict with select={"layer": [...]})."""
    return activation_patch(model, clean, corrupted, metric, value, ("layer", "neuron"), **options)
