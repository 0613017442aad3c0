"""`load_transcoders`: a saved per-layer set or cross-layer transcoder, by the kind its config names."""

import os

import torch
import yaml

from hooked_models.transcoders.cross_layer_transcoder import CrossLayerTranscoder
from hooked_models.transcoders.files import resolve_path
from hooked_models.transcoders.lazy import LazyTranscoderSet
from hooked_models.transcoders.single_layer_transcoder import TranscoderSet


def load_transcoders(path: str | os.PathLike, model=None, dtype: torch.dtype | None = None,
                     device=None, lazy: bool = False) -> TranscoderSet | CrossLayerTranscoder:
    """A TranscoderSet or CrossLayerTranscoder from a directory in circuit-tracer's layout, by the
    `model_kind` its config.yaml names; "embedded": the ones shipped for the embedded `model`.

    `lazy=True` (a per-layer set): a `LazyTranscoderSet`, whose layers stay in their files until used
    (hooked_models/transcoders/lazy.py); a cross-layer transcoder is always read whole."""
    path = resolve_path(path, model)
    config_file = path / "config.yaml"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.yaml in {path}: not a saved transcoder set")
    kind = (yaml.safe_load(config_file.read_text()) or {}).get("model_kind")
    classes = {c.model_kind: c for c in (TranscoderSet, CrossLayerTranscoder)}
    if kind not in classes:
        raise ValueError(f"{config_file} has model_kind={kind!r}; expected one of {sorted(classes)}")
    if lazy and kind == TranscoderSet.model_kind:
        return LazyTranscoderSet.load(path, model, dtype, device)
    if lazy:
        raise ValueError(f"lazy=True reads per-layer sets ({TranscoderSet.model_kind!r}); {config_file} is a {kind!r}, "
                         "read whole: pass lazy=False")
    return classes[kind].load(path, model, dtype, device)

