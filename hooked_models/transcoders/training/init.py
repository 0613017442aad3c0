"""The transcoders training starts from: drawn whole per layer, then cut to this process's features, so a
feature's first weights are the same however many processes shard them."""

import math

import torch
from torch import Tensor

from hooked_models.transcoders.cross_layer_transcoder import CrossLayerTranscoder
from hooked_models.transcoders.identity import ModelIdentity
from hooked_models.transcoders.single_layer_transcoder import Transcoder
from hooked_models.transcoders.training.config import TrainingConfig


def init_transcoder_(tc: Transcoder | CrossLayerTranscoder, seed: int = 0, threshold: float = 0.0) -> None:
    """Random weights for tests and benchmarks: decoder rows of unit norm, the encoder their transpose
    (as SAELens initializes; scaled normal where d_in != d_out), biases zero, skip zero, JumpReLU
    thresholds `threshold`. A cross-layer decoder is split evenly over the layers it writes."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if isinstance(tc, Transcoder):
            enc, dec = _unit_pair(tc.d_in, tc.d_transcoder, tc.d_out, generator)
            tc.W_enc.copy_(enc)
            tc.W_dec.copy_(dec)
        else:
            for l in range(tc.n_layers):
                enc, dec = _unit_pair(tc.d_in, tc.d_transcoder, tc.d_out, generator)
                tc.W_enc[l].copy_(enc)
                tc.W_dec[l].copy_(dec[:, None, :].expand(-1, tc.n_layers - l, -1) / (tc.n_layers - l))
        for name in ("b_enc", "b_dec", "W_skip"):
            if getattr(tc, name, None) is not None:
                getattr(tc, name).zero_()
        if tc.threshold is not None:
            tc.threshold.fill_(threshold)


def _unit_pair(d_in: int, d_transcoder: int, d_out: int, generator) -> tuple[Tensor, Tensor]:
    w = torch.randn(d_transcoder, d_out, generator=generator)
    w = w / w.norm(dim=-1, keepdim=True)
    if d_in == d_out:
        return w.T, w
    return torch.randn(d_in, d_transcoder, generator=generator) / math.sqrt(d_in), w


def layer_init(config: TrainingConfig, d_in: int, d_out: int, layer: int) -> tuple[Tensor, Tensor]:
    """Layer `layer`'s whole encoder [d_in d_transcoder] and decoder direction [d_transcoder d_out]."""
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + layer)
    if config.init == "unit_decoder":
        return _unit_pair(d_in, config.d_transcoder, d_out, generator)
    # torch.nn.Linear(d_in, d_transcoder)'s draw (kaiming uniform, a=√5): U(-1/√d_in, 1/√d_in).
    bound = 1 / math.sqrt(d_in)
    enc = torch.empty(config.d_transcoder, d_in).uniform_(-bound, bound, generator=generator)
    if config.init == "zero_decoder":
        return enc.T.contiguous(), torch.zeros(config.d_transcoder, d_out)
    dec = enc if d_in == d_out else torch.randn(config.d_transcoder, d_out, generator=generator)
    return enc.T.contiguous(), config.init_scale * dec / dec.norm(dim=-1, keepdim=True)


def module_activation(config: TrainingConfig) -> tuple[str, int | None]:
    """The activation (and k) of the modules trained: BatchTopK's are JumpReLUs with the learned threshold."""
    if config.activation == "batchtopk":
        return "jumprelu", None
    return config.activation, config.k


def new_transcoders(identity: ModelIdentity, config: TrainingConfig, features: slice | None = None
                    ) -> dict[int, Transcoder] | CrossLayerTranscoder:
    """Untrained transcoders for a model as `config` says (features `features` of each layer; default all):
    per layer, {layer: Transcoder}; or one CrossLayerTranscoder."""
    features = slice(0, config.d_transcoder) if features is None else features
    width = features.stop - features.start
    d = identity.hidden_size
    activation, k = module_activation(config)
    if config.activation == "batchtopk":
        threshold = 0.0
    else:
        threshold = config.threshold
    with torch.no_grad():
        if config.cross_layer:
            n = identity.num_layers
            clt = CrossLayerTranscoder(n, d, width, activation=activation, k=k, skip=config.skip, identity=identity)
            for l in range(n):
                enc, dec = layer_init(config, d, d, l)
                clt.W_enc[l].copy_(enc[:, features])
                clt.W_dec[l].copy_(dec[features, None, :].expand(-1, n - l, -1) / (n - l))
            if clt.threshold is not None:
                clt.threshold.fill_(threshold)
            clt.bandwidth = config.bandwidth
            return clt
        out = {}
        for l in config.layers or range(identity.num_layers):
            tc = Transcoder(d, width, layer=l, activation=activation, k=k, skip=config.skip)
            enc, dec = layer_init(config, d, d, l)
            tc.W_enc.copy_(enc[:, features])
            tc.W_dec.copy_(dec[features])
            if tc.threshold is not None:
                tc.threshold.fill_(threshold)
            tc.bandwidth = config.bandwidth
            out[l] = tc
        return out
