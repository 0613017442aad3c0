"""The transcoders being trained, as one process holds them: per-layer modules or one cross-layer
transcoder, cut to this process's features, with uniform access to each layer's parameters."""

import torch
from torch import Tensor

from hooked_models.transcoders.cross_layer_transcoder import CrossLayerTranscoder
from hooked_models.transcoders.identity import ModelIdentity
from hooked_models.transcoders.single_layer_transcoder import Transcoder, TranscoderSet
from hooked_models.transcoders.training.config import TrainingConfig
from hooked_models.transcoders.training.distributed import Layout
from hooked_models.transcoders.training.init import module_activation, new_transcoders


class Shard:
    """This process's part of the transcoders: `layers` trained (targets and sources), each layer's encoder
    `enc(l)` [d_in features], `b_enc(l)`, `threshold(l)`, decoder `dec(source, target)` [features d_out],
    `b_dec(t)`, skip `skip(t)` [d_out d_in] or None; `sources(t)`, the layers whose features write t."""

    def __init__(self, identity: ModelIdentity, config: TrainingConfig, layout: Layout):
        self.identity, self.config, self.layout = identity, config, layout
        self.modules = new_transcoders(identity, config, layout.features)
        self.modules = {l: m.to(layout.device) for l, m in self.modules.items()} if isinstance(
            self.modules, dict) else self.modules.to(layout.device)
        self.cross = isinstance(self.modules, CrossLayerTranscoder)
        self.layers = list(range(identity.num_layers)) if self.cross else list(self.modules)
        self.module = self.modules if self.cross else torch.nn.ModuleDict({str(l): m for l, m in self.modules.items()})
        self.since_fired = {l: torch.zeros(layout.d_local, dtype=torch.int64, device=layout.device)
                            for l in self.layers}

    def _tc(self, l: int) -> Transcoder:
        return self.modules[l]

    def enc(self, l: int) -> Tensor:
        return self.modules.W_enc[l] if self.cross else self._tc(l).W_enc

    def b_enc(self, l: int) -> Tensor:
        return self.modules.b_enc[l] if self.cross else self._tc(l).b_enc

    def threshold(self, l: int) -> Tensor | None:
        return self.modules.threshold_of(l) if self.cross else self._tc(l).threshold

    def dec(self, source: int, target: int) -> Tensor:
        return self.modules.decoder(source, target) if self.cross else self._tc(source).W_dec

    def b_dec(self, t: int) -> Tensor:
        return self.modules.b_dec[t] if self.cross else self._tc(t).b_dec

    def skip(self, t: int) -> Tensor | None:
        if self.cross:
            return None if self.modules.W_skip is None else self.modules.W_skip[t]
        return self._tc(t).W_skip

    def sources(self, t: int) -> list[int]:
        return list(range(t + 1)) if self.cross else [t]

    def decoder_norms(self, l: int) -> Tensor:
        return self.modules.decoder_norms(l) if self.cross else self._tc(l).W_dec.norm(dim=-1)

    def trained_parameters(self) -> list[torch.nn.Parameter]:
        """What the optimizer moves: everything but BatchTopK's thresholds (a running mean, not a gradient's)."""
        skip = set()
        if self.config.activation == "batchtopk":
            skip = {id(self.threshold(l)) for l in self.layers} if not self.cross else {id(self.modules.threshold)}
        return [p for p in self.module.parameters() if id(p) not in skip]

    def state_dict(self) -> dict:
        return {"module": self.module.state_dict(), "since_fired": self.since_fired}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])
        self.since_fired = state["since_fired"]

    # ------------------------------------------------------------------------- the whole result
    def gathered(self):
        """The whole transcoders, every process's features in order (every process gets them): a
        TranscoderSet (every layer trained), {layer: Transcoder} (some), or a CrossLayerTranscoder."""
        config = self.config
        activation, k = module_activation(config)
        if self.cross:
            whole = CrossLayerTranscoder(self.identity.num_layers, self.modules.d_in, config.d_transcoder,
                                         activation=activation, k=k, skip=config.skip, identity=self.identity)
            return self._gather_into(whole, self.modules)
        out = {l: self._gather_into(Transcoder(tc.d_in, config.d_transcoder, layer=l, activation=activation, k=k,
                                               skip=config.skip), tc) for l, tc in self.modules.items()}
        if sorted(out) == list(range(self.identity.num_layers)):
            return TranscoderSet([out[l] for l in sorted(out)], identity=self.identity).eval()
        return out

    # The feature axis of each parameter (by its name's first part): gathered across the shards in rank order;
    # the rest (b_dec, W_skip) is replicated, the same on every process.
    _FEATURE_AXIS = {"W_enc": -1, "b_enc": -1, "threshold": -1, "W_dec": 0}

    def _gather_into(self, whole, part):
        """`whole` (a module of every feature) filled from `part` (this process's features of the same kind)."""
        with torch.no_grad():
            for (name, target), source in zip(whole.named_parameters(), part.parameters(), strict=True):
                axis = self._FEATURE_AXIS.get(name.split(".")[0])
                target.copy_(source.detach() if axis is None else self.layout.gather_features(source.detach(), axis))
        return whole.eval()
