"""The model a corpus run uses: a path workers load their replica from, or (locally) a model object,
and the identity a harvest records (family, config, a fingerprint of the weights)."""

import hashlib
import os
import sys
from dataclasses import dataclass, fields, is_dataclass

import torch

from hooked_models.dtypes import resolve_dtype
from hooked_models.families import detect_family, family_name, load_model


def _family(family: str | None, source) -> str:
    return detect_family(source) if family is None else family_name(family)


@dataclass(frozen=True)
class ModelSource:
    """Where a worker loads its replica from: a checkpoint path, "embedded" or a cached Hub id."""

    source: str
    family: str
    dtype: torch.dtype | None = None

    def load(self, device=None):
        return load_model(self.source, self.family, self.dtype, device)


def is_hooked_model(obj) -> bool:
    """Whether `obj` is a loaded hooked model, without importing the model's module (and TransformerLens,
    seconds) where no model was ever made: then nothing can be one."""
    module = sys.modules.get("hooked_models.model")
    return module is not None and isinstance(obj, module.HookedModel)


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def model_source(model, family, dtype) -> ModelSource:
    """Where workers load the model from; a model object has no path to load from."""
    if is_hooked_model(model):
        raise ValueError("engine='ray' loads the model in each worker from a path; pass the checkpoint "
                         "path (model.save_pretrained(dir) writes one), or use engine='local'")
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be a checkpoint path, 'embedded', a Hub id or a hooked model, "
                         f"not {type(model).__name__}")
    return ModelSource(str(model), _family(family, model), resolve_dtype(dtype))


def resolve_model(model, family, dtype, engine: str):
    """(the model, its source for workers or None for an object)."""
    if is_hooked_model(model) and engine == "local":
        if dtype is not None and resolve_dtype(dtype) != next(model.parameters()).dtype:
            raise ValueError(f"dtype={dtype} differs from the model's {next(model.parameters()).dtype}; "
                             "dtype applies when the model is loaded from a path")
        return model, None
    source = model_source(model, family, dtype)
    # This process loads it too: to plan (shapes, tokenizer, fingerprint), and to run it for engine="local".
    return source.load(_default_device() if engine == "local" else "cpu"), source


def model_identity(model) -> dict:
    """What makes two models the same for a harvest: family, config fields and a weights fingerprint
    (every tensor's name, shape, dtype and up to 1024 evenly spaced elements)."""
    return {"family": type(model).__name__, "config": _jsonable(model.cfg), "weights": weights_digest(model)}


def weights_digest(module) -> str:
    """A fingerprint of a module's weights: every tensor's name, shape, dtype and up to 1024 evenly spaced
    elements (cheap at any size, and different for any two trainings or random draws)."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        flat = tensor.detach().reshape(-1)
        spaced = torch.linspace(0, flat.numel() - 1, min(1024, flat.numel()), dtype=torch.float64).long()
        sample = flat[spaced.to(flat.device)]
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}".encode())
        digest.update(sample.float().cpu().numpy().tobytes())
    return digest.hexdigest()


def _jsonable(value):
    if is_dataclass(value):
        return {f.name: _jsonable(getattr(value, f.name)) for f in fields(value) if f.name not in ("device", "dtype")}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
