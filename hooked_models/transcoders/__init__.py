"""Transcoders: sparse replacements of the MLPs, read from the MLP's input and written to its output.

    tc = Transcoder(d_in=64, d_transcoder=512, layer=1, activation="topk", k=16)
    acts = tc.encode(x)                        # x: layers.1.mlp_input [... d_in] -> [... d_transcoder]
    out = tc(x)                                # decode(encode(x)) (+ x @ W_skip.T): layers.1.mlp.mlp_output
    tcs = TranscoderSet([...], model=model)    # one per layer, for one model (family, hidden size, layers)
    tcs.save("out/tc"); TranscoderSet.load("out/tc", model=model)    # circuit-tracer's layout
    clt = CrossLayerTranscoder(n_layers=2, d_in=64, d_transcoder=512, model=model)   # encoders per layer,
    clt.decode_to(1, {0: acts0, 1: acts1})     # decoders from each layer to it and every later one

Names, layouts and files follow circuit-tracer (`SingleLayerTranscoder`, `TranscoderSet`,
`CrossLayerTranscoder`). `load_transcoders` reads a saved set (`lazy=True`: layer by layer as used),
`evaluate` measures FVU, L0, dead features, loss recovered and KL over a dataset, `transcoder_fidelity`
one batch, and `training` trains them (streamed from the live model or from a harvest, across processes,
resumable).
"""

# For developers, the package's layout: one module per concern, each importing only those listed before it (the
# contract in pyproject.toml): `activation_functions` (relu, topk, jumprelu and its straight-through gradient) and
# `identity` (the hooks read and written, the model a set is for); `files` (circuit-tracer's config.yaml,
# SAELens's class names, the replacement model's hooks); `single_layer_transcoder` (`Transcoder`, `TranscoderSet`)
# and `cross_layer_transcoder`; `lazy` (`LazyTranscoderSet`); `loading` (`load_transcoders`); `evaluation`
# (`evaluate`) and `fidelity` (`transcoder_fidelity`); `training/` (a package of its own).

from hooked_models.transcoders.activation_functions import ACTIVATIONS, JUMPRELU_BANDWIDTH, jumprelu, step, topk_relu
from hooked_models.transcoders.cross_layer_transcoder import CrossLayerTranscoder
from hooked_models.transcoders.evaluation import evaluate
from hooked_models.transcoders.fidelity import transcoder_fidelity
from hooked_models.transcoders.files import SAE_LENS_CLASSES
from hooked_models.transcoders.identity import (
    FEATURE_INPUT_HOOK,
    FEATURE_OUTPUT_HOOK,
    ModelIdentity,
    input_hook_name,
    output_hook_name,
)
from hooked_models.transcoders.lazy import LazyTranscoderSet
from hooked_models.transcoders.loading import load_transcoders
from hooked_models.transcoders.single_layer_transcoder import Transcoder, TranscoderSet
from hooked_models.transcoders.training import (
    HarvestReader,
    StreamingSource,
    TrainingConfig,
    init_transcoder_,
    new_transcoders,
    train_transcoders,
)

__all__ = ["ACTIVATIONS", "FEATURE_INPUT_HOOK", "FEATURE_OUTPUT_HOOK", "JUMPRELU_BANDWIDTH", "SAE_LENS_CLASSES",
           "CrossLayerTranscoder", "HarvestReader", "LazyTranscoderSet", "ModelIdentity", "StreamingSource",
           "TrainingConfig", "Transcoder", "TranscoderSet", "evaluate",
           "init_transcoder_", "input_hook_name", "jumprelu", "load_transcoders", "new_transcoders",
           "output_hook_name", "step", "topk_relu", "train_transcoders", "transcoder_fidelity"]
