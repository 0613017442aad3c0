"""circuit-tracer's file layout, what a per-layer set and a cross-layer transcoder share.

A saved set is a directory: `config.yaml` (model_kind, feature_input_hook, feature_output_hook,
activation, the file list, and the model identity) beside the tensors' safetensors files. "embedded" names
the transcoders shipped for the embedded model of a family. SAELens's transcoder classes, by activation
and skip connection, for the conversions both ways.
"""

import os
from collections.abc import Callable
from pathlib import Path

import torch.nn as nn
import yaml
from torch import Tensor

from hooked_models.transcoders.identity import (
    FEATURE_INPUT_HOOK,
    FEATURE_OUTPUT_HOOK,
    ModelIdentity,
    input_hook_name,
    output_hook_name,
)

# SAELens's transcoder classes by (activation, skip connection); it has no TopK transcoder.
SAE_LENS_CLASSES = {("relu", False): "Transcoder", ("relu", True): "SkipTranscoder",
                    ("jumprelu", False): "JumpReLUTranscoder", ("jumprelu", True): "JumpReLUSkipTranscoder"}



class SetBase(nn.Module):
    """What a TranscoderSet and a CrossLayerTranscoder share: the model identity, hook names, the hooks
    that splice the replacement model, and the circuit-tracer config file."""

    model_kind: str

    def __init__(self, identity: ModelIdentity | None):
        super().__init__()
        self.identity = identity

    def input_hook(self, layer: int) -> str:
        return input_hook_name(self._layer(layer))

    def output_hook(self, layer: int) -> str:
        return output_hook_name(self._layer(layer))

    def _layer(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.n_layers:
            raise ValueError(f"layer={layer!r} is not a layer of these transcoders (0 ... {self.n_layers - 1})")
        return layer

    @property
    def dtype(self):
        """The dtype the features are computed in (the encoders')."""
        return self.encoder(0).dtype

    def encoder_columns(self, layer: int, ids):
        """[d_in n]: the encoder directions of layer `layer`'s features `ids`."""
        return self.encoder(layer)[:, ids]

    def decoder_rows(self, source: int, target: int, ids):
        """[n d_out]: the decoder rows, from layer `source` to layer `target`'s MLP output, of features `ids`."""
        return self.decoder(source, target)[ids]

    def replacement_hooks(self) -> list[tuple[str, Callable]]:
        """fwd_hooks that make the model the replacement model: each layer's MLP output replaced by the
        transcoders' output, its features encoded from the replacement model's own MLP inputs (no error
        terms). A layer reads the features of the layers before it in the same run (cross-layer)."""
        live: dict[int, Tensor] = {}  # this run's features and MLP inputs, layer by layer
        inputs: dict[int, Tensor] = {}

        def read(layer):
            def hook(x, hook):
                live[layer], inputs[layer] = self.encode(layer, x), x
            return hook

        def write(layer):
            return lambda y, hook: self.decode_to(layer, live, inputs[layer]).to(y.dtype)

        return [hook for l in range(self.n_layers)
                for hook in ((self.input_hook(l), read(l)), (self.output_hook(l), write(l)))]

    def check_model(self, model) -> None:
        """Refuse a model these transcoders were not trained for (family, hidden size, layer count)."""
        if self.identity is not None:
            self.identity.check(model, f"{type(self).__name__}s")
            return
        if (model.cfg.hidden_size, model.cfg.num_layers) != (self.d_in, self.n_layers):
            raise ValueError(f"these transcoders read {self.d_in}-wide inputs over {self.n_layers} layers; the "
                             f"model has hidden_size={model.cfg.hidden_size}, num_layers={model.cfg.num_layers}")

    def _config(self, files: list[str], activation: str, k: int | None) -> dict:
        config = {"model_kind": self.model_kind, "feature_input_hook": FEATURE_INPUT_HOOK,
                  "feature_output_hook": FEATURE_OUTPUT_HOOK, "activation": activation}
        if k is not None:
            config["k"] = k
        if self.identity is not None:
            config.update(model_name=self.identity.family, model_family=self.identity.family,
                          hidden_size=self.identity.hidden_size, num_layers=self.identity.num_layers)
        config["d_transcoder"] = self.d_transcoder
        config["transcoders"] = files
        return config

    @staticmethod
    def _read_config(path: Path, kind: str) -> dict:
        config_file = path / "config.yaml"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.yaml in {path}: not a saved transcoder set")
        config = yaml.safe_load(config_file.read_text())
        if not isinstance(config, dict) or config.get("model_kind") != kind:
            found = config.get("model_kind") if isinstance(config, dict) else None
            raise ValueError(f"{config_file} has model_kind={found!r}, expected {kind!r}")
        hooks = (config.get("feature_input_hook"), config.get("feature_output_hook"))
        if hooks != (FEATURE_INPUT_HOOK, FEATURE_OUTPUT_HOOK):
            raise ValueError(f"{config_file} reads {hooks[0]!r} and writes {hooks[1]!r}; these transcoders read "
                             f"{FEATURE_INPUT_HOOK!r} and write {FEATURE_OUTPUT_HOOK!r} of each layer")
        return config

    @staticmethod
    def _identity_from(config: dict) -> ModelIdentity | None:
        if "model_family" not in config:
            return None
        return ModelIdentity(config["model_family"], int(config["hidden_size"]), int(config["num_layers"]))

    @staticmethod
    def _resolve_identity(model, identity: ModelIdentity | None) -> ModelIdentity | None:
        if model is not None and identity is not None and ModelIdentity.of(model) != identity:
            raise ValueError(f"model is {ModelIdentity.of(model)}, identity= says {identity}")
        return ModelIdentity.of(model) if model is not None else identity



def resolve_path(path: str | os.PathLike, model) -> Path:
    """A directory; "embedded" is the package's transcoders of `model`'s family."""
    if str(path) != "embedded":
        return Path(path)
    if model is None:
        raise ValueError('"embedded" transcoders are those of the embedded model: pass model=')
    from hooked_models.embedded import EMBEDDED_DIR

    return EMBEDDED_DIR / ModelIdentity.of(model).family / "transcoders"

