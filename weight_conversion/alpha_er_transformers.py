"""alpha-er: the reference's checkpoint <-> the transformers one (hooked_models.alpha_er_transformers).

The converters are pure: `transformers_config` maps the reference config's fields to an AlphaErConfig
(transformers) and `reference_config_fields` maps one back, refusing what the reference cannot say;
`transformers_tensor_name` / `reference_name_of` map one tensor name each way, and the `*_state_dict`
functions apply them to a whole state dict, every tensor consumed and an unknown name refused. Around
them: HookedAlphaEr from an in-memory AlphaErForCausalLM or a transformers checkpoint directory, the
way back (`to_transformers`, `save_transformers_checkpoint`, which writes auto_map and the two source
files beside the weights), and the loader that takes either format (`load_alpha_er`).
"""

from pathlib import Path

import torch

from hooked_models.alpha_er_transformers import AlphaErConfig as TransformersAlphaErConfig
from hooked_models.alpha_er_transformers import AlphaErForCausalLM
from hooked_models.alpha_er_transformers.configuration_alpha_er import REFERENCE_NAMES
from hooked_models.config import REFERENCE_FIELDS
from hooked_models.devices import resolve_device
from hooked_models.dtypes import resolve_dtype
from hooked_models.model import HookedModel
from weight_conversion.alpha_er import (
    Build,
    build_alpha_er,
    compile_names,
    convert_alpha_er_config,
    convert_alpha_er_name,
    hooked_to_reference_state_dict,
    load_alpha_er_checkpoint,
    reference_config_dict,
    rename_with,
)
from weight_conversion.checkpoint import (
    CheckpointError,
    iter_tensors,
    load_tokenizer,
    read_json,
    rename_state_dict,
    save_tokenizer,
)

ARCHITECTURE = "AlphaErForCausalLM"

# Reference tensor name -> transformers name; {i} is a layer index.
_FACTORED = [("blocks.{i}.qkv", "model.layers.{i}.self_attn.qkv_proj"),
             ("blocks.{i}.proj", "model.layers.{i}.self_attn.o_proj"), ("lm_head", "lm_head")]
_FACTORED_LEAVES = [("down", "down_proj.weight"), ("mid_w", "norm.weight"), ("mid_b", "norm.bias"),
                    ("up", "up_proj.weight")]
NAME_PAIRS: list[tuple[str, str]] = [
    ("wte.weight", "model.embed_tokens.weight"),
    ("wpe.weight", "model.embed_positions.weight"),
    *((f"blocks.{{i}}.ln1.{p}", f"model.layers.{{i}}.input_layernorm.{p}") for p in ("weight", "bias")),
    *((f"blocks.{{i}}.ln2.{p}", f"model.layers.{{i}}.post_attention_layernorm.{p}") for p in ("weight", "bias")),
    ("blocks.{i}.fc1s", "model.layers.{i}.mlp.up_proj"),
    ("blocks.{i}.fc2s", "model.layers.{i}.mlp.down_proj"),
    *((f"ln_f.{p}", f"model.norm.{p}") for p in ("weight", "bias")),
    *((f"{ref}.{leaf}", f"{ours}.{our_leaf}") for ref, ours in _FACTORED for leaf, our_leaf in _FACTORED_LEAVES),
]


_TO_TRANSFORMERS = compile_names(NAME_PAIRS)
_TO_REFERENCE = compile_names([(ours, ref) for ref, ours in NAME_PAIRS])


def transformers_tensor_name(name: str) -> str:
    """`blocks.3.qkv.mid_w` -> `model.layers.3.self_attn.qkv_proj.norm.weight`; KeyError for a name with no place."""
    return rename_with(name, _TO_TRANSFORMERS)


def reference_name_of(name: str) -> str:
    """The way back: a transformers tensor name -> the reference's; KeyError for a name with no place."""
    return rename_with(name, _TO_REFERENCE)


def reference_to_transformers_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A reference state dict under the transformers names (the same tensors); an unknown name refused."""
    return rename_state_dict(state, transformers_tensor_name, "the reference's alpha-er")


def transformers_to_reference_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An AlphaErForCausalLM state dict under the reference's names (the same tensors); an unknown name refused."""
    return rename_state_dict(state, reference_name_of, "the transformers alpha-er")


def transformers_config(fields: dict) -> TransformersAlphaErConfig:
    """The reference config's fields (native values or a header's strings) -> the transformers config.
    Unknown fields and a model_type other than alpha-er are refused (convert_alpha_er_config)."""
    cfg = convert_alpha_er_config(fields).reference_fields()
    return TransformersAlphaErConfig(**{REFERENCE_NAMES.get(name, name): value for name, value in cfg.items()},
                                     architectures=[ARCHITECTURE])


def reference_config_fields(config: TransformersAlphaErConfig) -> dict:
    """The transformers config -> the reference config's fields (with its model type)."""
    if not isinstance(config, TransformersAlphaErConfig):
        raise CheckpointError(f"{type(config).__name__} is not an alpha-er config (model_type "
                              f"{getattr(config, 'model_type', None)!r}); the converter reads AlphaErConfig")
    fields = {name: getattr(config, REFERENCE_NAMES.get(name, name)) for name in REFERENCE_FIELDS}
    return reference_config_dict(convert_alpha_er_config(fields))


# ------------------------------------------------------------------------------------ in memory
def load_from_transformers_model(hf_model, dtype: torch.dtype | str | None = None, device=None, *,
                                 build: Build) -> HookedModel:
    """HookedAlphaEr from an in-memory AlphaErForCausalLM (the weights are copied)."""
    if not isinstance(hf_model, AlphaErForCausalLM):
        raise CheckpointError(f"{type(hf_model).__name__} is not an AlphaErForCausalLM (model_type "
                              f"{getattr(getattr(hf_model, 'config', None), 'model_type', None)!r})")
    dtype, device = resolve_dtype(dtype), None if device is None else resolve_device(device)
    cfg = convert_alpha_er_config(reference_config_fields(hf_model.config))
    first = next(hf_model.parameters())
    source = type(hf_model).__name__
    triples = ((source, name, tensor.detach().clone()) for name, tensor in hf_model.state_dict().items())
    return build_alpha_er(cfg, triples, dtype or first.dtype, device or first.device, build,
                          rename=_hooked_name)


def _hooked_name(name: str) -> str:
    return convert_alpha_er_name(reference_name_of(name))


def to_transformers(model: HookedModel) -> AlphaErForCausalLM:
    """A HookedAlphaEr as an AlphaErForCausalLM (eval mode) holding the same tensors (not copies)."""
    config = transformers_config(model.cfg.reference_fields())
    with torch.device("meta"):
        hf_model = AlphaErForCausalLM(config)
    state = reference_to_transformers_state_dict(hooked_to_reference_state_dict(model))
    hf_model.load_state_dict(state, strict=True, assign=True)
    return hf_model.eval()


# ---------------------------------------------------------------------------------------- files
def is_transformers_checkpoint(path) -> bool:
    """Whether `path` (a directory, or a weight file in one) holds a transformers alpha-er: a config.json of
    model_type alpha-er naming AlphaErForCausalLM or with the transformers field names."""
    path = Path(path)
    config = (path if path.is_dir() else path.parent) / "config.json"
    if not config.is_file():
        return False
    fields = read_json(config)
    return fields.get("model_type") == "alpha-er" and (
        ARCHITECTURE in (fields.get("architectures") or []) or "hidden_size" in fields)


def load_transformers_checkpoint(path, dtype: torch.dtype | str | None = None, device=None, *,
                                 build: Build) -> HookedModel:
    """HookedAlphaEr from a directory AlphaErForCausalLM.save_pretrained wrote (config.json,
    model.safetensors, tokenizer files); transformers itself is not run."""
    path = Path(path)
    directory = path if path.is_dir() else path.parent
    fields = read_json(directory / "config.json")
    try:
        config = TransformersAlphaErConfig(**{k: v for k, v in fields.items() if k != "auto_map"})
    except ValueError as error:
        raise CheckpointError(f"{directory / 'config.json'}: {error}") from None
    cfg = convert_alpha_er_config(reference_config_fields(config))
    file = directory / "model.safetensors"
    if not file.is_file():
        raise CheckpointError(f"{directory} has no model.safetensors")
    dtype, device = resolve_dtype(dtype), None if device is None else resolve_device(device)
    triples = ((str(file), name, tensor) for name, tensor in iter_tensors(file))
    model = build_alpha_er(cfg, triples, dtype or cfg.dtype, device or "cpu", build, rename=_hooked_name)
    model.tokenizer = load_tokenizer(directory)
    return model


def load_alpha_er(path, dtype: torch.dtype | str | None = None, device=None, *, build: Build) -> HookedModel:
    """HookedAlphaEr from either format: the transformers one, or the reference's."""
    if is_transformers_checkpoint(path):
        return load_transformers_checkpoint(path, dtype=dtype, device=device, build=build)
    return load_alpha_er_checkpoint(path, dtype=dtype, device=device, build=build)


def save_transformers_checkpoint(model: HookedModel, path) -> None:
    """`AlphaErForCausalLM.save_pretrained(path)` of the same weights: config.json with auto_map,
    model.safetensors, configuration_alpha_er.py and modeling_alpha_er.py, and the model's tokenizer."""
    if Path(path).suffix == ".safetensors":
        raise CheckpointError(f"{path}: a transformers checkpoint is a directory, not a .safetensors file")
    hf_model = to_transformers(model)
    hf_model.save_pretrained(path)
    if model.tokenizer is not None:
        save_tokenizer(model.tokenizer, Path(path))


__all__ = ["NAME_PAIRS", "is_transformers_checkpoint", "load_alpha_er",
           "load_from_transformers_model", "load_transformers_checkpoint", "reference_config_fields",
           "reference_name_of", "reference_to_transformers_state_dict", "save_transformers_checkpoint",
           "to_transformers", "transformers_config", "transformers_tensor_name",
           "transformers_to_reference_state_dict"]
