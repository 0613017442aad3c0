"""`transcoder_fidelity`: how much of the MLPs a set of transcoders replaces."""

import torch
from torch import Tensor

from hooked_models.transcoders.cross_layer_transcoder import CrossLayerTranscoder
from hooked_models.transcoders.identity import input_hook_name, output_hook_name
from hooked_models.transcoders.single_layer_transcoder import TranscoderSet


@torch.no_grad()
def transcoder_fidelity(model, transcoders: TranscoderSet | CrossLayerTranscoder, tokens: Tensor) -> dict:
    """How much of the MLPs the transcoders replace, on `tokens` [batch seq]:

    variance_explained: per layer, 1 - Σ|y - ŷ|² / Σ|y - mean y|² over every position, ŷ the
      transcoders' output from the model's own MLP inputs;
    loss, loss_spliced, loss_zero_ablated: the next-token loss of the model, of the replacement model
      (every MLP output replaced by the transcoders' from the replacement model's own MLP inputs, no
      error terms), and with every MLP output zero;
    loss_recovered: (zero_ablated - spliced) / (zero_ablated - loss), 1 when the replacement is perfect;
    loss_gap: spliced - loss.
    """
    transcoders.check_model(model)
    n = transcoders.n_layers
    inputs, outputs = [input_hook_name(l) for l in range(n)], [output_hook_name(l) for l in range(n)]
    _, cache = model.run_with_cache(tokens, names_filter=lambda name: name in inputs + outputs)
    acts = [transcoders.encode(l, cache[inputs[l]]) for l in range(n)]
    explained = []
    for l in range(n):
        y = cache[outputs[l]].reshape(-1, cache[outputs[l]].shape[-1])
        y_hat = transcoders.decode_to(l, acts, cache[inputs[l]]).reshape(y.shape)
        explained.append(1 - float(((y - y_hat) ** 2).sum() / ((y - y.mean(0)) ** 2).sum()))
    loss = float(model(tokens, return_type="loss"))
    spliced = float(model.run_with_hooks(tokens, return_type="loss", fwd_hooks=transcoders.replacement_hooks()))
    ablated = float(model.run_with_hooks(tokens, return_type="loss",
                                         fwd_hooks=[(name, lambda y, hook: torch.zeros_like(y)) for name in outputs]))
    return {"variance_explained": explained, "loss": loss, "loss_spliced": spliced, "loss_zero_ablated": ablated,
            "loss_recovered": (ablated - spliced) / (ablated - loss), "loss_gap": spliced - loss}
