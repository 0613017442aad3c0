"""Activation patching and attribution patching over the standard vocabulary, batched.

    from hooked_models import patching
    metric = patching.logit_diff_metric(answers, wrong_answers)
    result = patching.activation_patch(model, clean, corrupted, metric, "layer_input", over=("layer", "seq"))
    result.top(5); result.plot("out/resid.png")

A sweep patches one value (`layer_input`, `attention_head_outputs`, `attention_keys`, `mlp_neurons`, a
family's own values, or a TransformerLens short name such as `resid_pre` or `z`) at every hook point
that carries it, indexed along the dimensions its layout names (`seq`, `num_heads`, `num_kv_heads`,
`intermediate_size`, `rank`, ...; `pos`, `head`, `neuron` are accepted as TransformerLens-style
aliases). Nothing here knows a family: the sites, dimensions and sizes come from the vocabulary.

Denoising runs the corrupted input and writes in the clean run's activations; noising runs the clean
input and writes in the corrupted run's. A patch cannot reach back: a patch at layer l that first
writes something new at position p leaves every layer below l and every position before p as in the
run it is written into. So a patched run computes only layers l ... and positions p ...: it starts
at layer l (`start_at_layer`) from the unpatched run's residual stream there, its attention reading
the earlier positions' keys and values from a key/value cache filled from the unpatched run, and the
metric gets the unpatched run's logits before p. A patch that writes nothing new is not run at all
(its metric is the unpatched one). Many patches share a forward: each is a copy of the prompts along
the batch with its own patch (a `torch.where` against a per-copy mask), copies join the batch at
their own layer, and the forwards are sized to a memory budget. Attribution patching (Nanda 2023,
"Attribution Patching") estimates every patch at once from one forward and one backward:
effect ≈ Σ grad · (source − base).
"""

# For developers, the package's layout: one module per concern, each importing only those listed before it (the
# contract in pyproject.toml): inputs (tokens, metric, direction), sites (the hook points, the grid and its
# patches), result (`PatchingResult`), runner (which patches share a forward, and running them), activation
# (`activation_patch`), attribution (`attribution_patch`), sweeps (the named sweeps).

from hooked_models.patching.activation import activation_patch
from hooked_models.patching.attribution import attribution_patch
from hooked_models.patching.inputs import DIRECTIONS, Metric, logit_diff_metric
from hooked_models.patching.result import PatchingResult
from hooked_models.patching.runner import layer_call_rows, row_bytes
from hooked_models.patching.sites import AXIS_ALIASES, AXIS_TITLES, DEFAULT_OVER, Patch, Site, find_sites, plan
from hooked_models.patching.sweeps import (
    patch_attention_heads,
    patch_kv_heads,
    patch_mlp_outputs,
    patch_neurons,
    patch_residual_stream,
)

__all__ = [
    "AXIS_ALIASES", "AXIS_TITLES", "DEFAULT_OVER", "DIRECTIONS", "Metric", "Patch", "PatchingResult", "Site",
    "activation_patch", "attribution_patch", "find_sites", "layer_call_rows", "logit_diff_metric",
    "patch_attention_heads", "patch_kv_heads", "patch_mlp_outputs", "patch_neurons", "patch_residual_stream",
    "plan", "row_bytes",
]
