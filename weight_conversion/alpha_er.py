"""alpha-er: the reference's config and state dict <-> HookedAlphaEr's.

The converters are pure: `convert_alpha_er_config` maps the reference config's fields (native values,
or the strings of a safetensors header) to an `AlphaErConfig` and refuses fields it does not know;
`convert_alpha_er_name` maps one reference tensor name to the hooked one and
`reference_tensor_name` maps it back; `convert_alpha_er_state_dict` applies the first to a whole
state dict. The loaders around them read and write the reference's checkpoint format: one
safetensors file whose header metadata carries the config fields (or a config.json beside it), or
a torch state-dict file read with weights_only=True. They import no family: the family passes
`build`, which makes its model for a config on the meta device.
"""

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file

from hooked_models.devices import resolve_device
from hooked_models.dtypes import resolve_dtype
from hooked_models.config import REFERENCE_FIELDS, AlphaErConfig
from hooked_models.model import HookedModel
from weight_conversion.checkpoint import (
    CheckpointError,
    iter_tensors,
    load_tokenizer,
    save_tokenizer,
    read_json,
    rename_state_dict,
    safetensors_metadata,
    stream_into,
)

# Header and config.json entries that say nothing about the forward.
_IGNORED_FIELDS = {"format", "model_type", "architectures", "dtype", "torch_dtype"}
_FLOAT_FIELDS = {"attn_soft_cap", "layer_norm_eps"}
MODEL_TYPE = "alpha-er"

# Reference tensor name -> hooked name; {i} is a layer index.
_FACTORED = [("blocks.{i}.qkv", "layers.{i}.self_attn.qkv_proj"), ("blocks.{i}.proj", "layers.{i}.self_attn.o_proj"),
             ("lm_head", "lm_head")]
_FACTORED_LEAVES = [("down", "down"), ("mid_w", "norm.weight"), ("mid_b", "norm.bias"), ("up", "up")]
NAME_PAIRS: list[tuple[str, str]] = [
    ("wte.weight", "embed_tokens.weight"),
    ("wpe.weight", "embed_positions.weight"),
    *((f"blocks.{{i}}.ln1.{p}", f"layers.{{i}}.input_layernorm.{p}") for p in ("weight", "bias")),
    *((f"blocks.{{i}}.ln2.{p}", f"layers.{{i}}.post_attention_layernorm.{p}") for p in ("weight", "bias")),
    ("blocks.{i}.fc1s", "layers.{i}.mlp.up_proj.weight"),
    ("blocks.{i}.fc2s", "layers.{i}.mlp.down_proj.weight"),
    *((f"ln_f.{p}", f"norm.{p}") for p in ("weight", "bias")),
    *((f"{ref}.{leaf}", f"{hooked}.{hooked_leaf}")
      for ref, hooked in _FACTORED for leaf, hooked_leaf in _FACTORED_LEAVES),
]


def compile_names(pairs: list[tuple[str, str]]) -> list[tuple[re.Pattern, str]]:
    """(source, target) name pairs with `{i}` for a layer index -> (pattern, replacement) for `rename_with`."""
    return [(re.compile("^" + re.escape(source).replace(r"\{i\}", r"(\d+)") + "$"), target.replace("{i}", r"\1"))
            for source, target in pairs]


_TO_HOOKED = compile_names(NAME_PAIRS)
_TO_REFERENCE = compile_names([(hooked, ref) for ref, hooked in NAME_PAIRS])


def rename_with(name: str, table: list[tuple[re.Pattern, str]]) -> str:
    """`name` by the first pattern of `table` that matches it; KeyError if none does."""
    for pattern, target in table:
        if pattern.match(name):
            return pattern.sub(target, name)
    raise KeyError(name)


def convert_alpha_er_name(name: str) -> str:
    """`blocks.3.qkv.mid_w` -> `layers.3.self_attn.qkv_proj.norm.weight`; KeyError for a name with no place."""
    return rename_with(name, _TO_HOOKED)


def reference_tensor_name(name: str) -> str:
    """The way back: a hooked parameter name -> the reference's."""
    return rename_with(name, _TO_REFERENCE)


def _parse(name: str, value):
    """A config value, native or as a header string ("512", "30.0", "1e-05")."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise CheckpointError(f"config field {name}={value!r} is not a number") from None
    if name in _FLOAT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CheckpointError(f"config field {name}={value!r} is not a number")
        return float(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(f"config field {name}={value!r} is not an integer")
    return value


def convert_alpha_er_config(source: dict) -> AlphaErConfig:
    """The reference config's fields -> AlphaErConfig.

    Fields absent take the reference's defaults (as the reference's own config does); fields it does
    not know, a model_type other than alpha-er, and fields that contradict each other are refused,
    naming them.
    """
    model_type = source.get("model_type", MODEL_TYPE)
    if model_type != MODEL_TYPE:
        raise CheckpointError(f"model_type is {model_type!r}; HookedAlphaEr loads model_type {MODEL_TYPE!r} only")
    unknown = sorted(set(source) - _IGNORED_FIELDS - set(REFERENCE_FIELDS))
    if unknown:
        raise CheckpointError(f"config field(s) {unknown} are not understood by the alpha-er converter; "
                              f"it knows {list(REFERENCE_FIELDS)}")
    values = {name: _parse(name, source[name]) for name in REFERENCE_FIELDS if name in source}
    try:
        return AlphaErConfig(**values)
    except ValueError as error:
        raise CheckpointError(f"inconsistent config: {error}") from None


def reference_config_dict(cfg: AlphaErConfig) -> dict:
    """AlphaErConfig -> the reference config's fields, with the model type."""
    return {"model_type": MODEL_TYPE, **cfg.reference_fields()}


def convert_alpha_er_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A reference state dict -> HookedAlphaEr's names, every tensor consumed (unknown names refused)."""
    return rename_state_dict(state, convert_alpha_er_name, "alpha-er")


def hooked_to_reference_state_dict(model: HookedModel) -> dict[str, torch.Tensor]:
    """HookedAlphaEr's parameters under the reference's names; a CheckpointError for a parameter the
    reference has no place for (the biases `fold_ln` gives bias-free readers of a LayerNorm)."""
    out = {}
    for name, tensor in model.state_dict().items():
        try:
            out[reference_tensor_name(name)] = tensor
        except KeyError:
            raise CheckpointError(
                f"{name!r} has no place in alpha-er's reference format (fold_ln folds a LayerNorm's bias into "
                "a reader that has no bias there); save before fold_ln, or keep the hooked model"
            ) from None
    return out


# ------------------------------------------------------------------------------------------ loaders
# The family's constructor, called on the meta device: the model for a config, with no storage yet.
Build = Callable[[AlphaErConfig], HookedModel]


def build_alpha_er(cfg: AlphaErConfig, triples: Iterator[tuple[str, str, torch.Tensor]], dtype, device,
                   build: Build, rename: Callable[[str], str] = convert_alpha_er_name) -> HookedModel:
    """Build on the meta device and stream the tensors in: every target filled, each shape checked.
    `rename` maps a source tensor name to the hooked one (by default, the reference's names)."""
    cfg.dtype, cfg.device = dtype, torch.device(device)
    model = build(cfg)
    stream_into(model, triples, rename=rename, dtype=dtype, device=device)
    model.setup()
    return model.eval()


def _reference_cfg_fields(cfg) -> dict:
    try:
        return dict(vars(cfg))
    except TypeError:  # a config with __slots__
        return {name: getattr(cfg, name) for name in REFERENCE_FIELDS if hasattr(cfg, name)}


def load_from_reference(module: nn.Module, dtype: torch.dtype | str | None = None, device=None, *,
                        build: Build) -> HookedModel:
    """From an in-memory module with the reference's parameter names and `cfg`; the weights are copied."""
    dtype, device = resolve_dtype(dtype), None if device is None else resolve_device(device)
    if not hasattr(module, "cfg"):
        raise CheckpointError(f"{type(module).__name__} has no `cfg` with the reference config's fields")
    fields = _reference_cfg_fields(module.cfg)
    missing = [name for name in REFERENCE_FIELDS if name not in fields]
    if missing:
        raise CheckpointError(f"{type(module).__name__}.cfg is missing field(s) {missing}")
    cfg = convert_alpha_er_config(fields)
    first = next(module.parameters())
    dtype, device = dtype or first.dtype, device or first.device
    source = type(module).__name__
    triples = ((source, name, tensor.detach().clone()) for name, tensor in module.state_dict().items())
    return build_alpha_er(cfg, triples, dtype, device, build)


_TORCH_SUFFIXES = (".pt", ".pth", ".bin")


def _weight_file(path: Path) -> Path:
    """The one weight file a path names: the file itself, or the single one in a directory."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(f"{path} does not exist")
    if (path / "model.safetensors").exists():
        return path / "model.safetensors"
    found = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", *_TORCH_SUFFIXES))
    if len(found) != 1:
        names = [p.name for p in found]
        raise CheckpointError(f"{path} should hold one weight file (model.safetensors, or one .safetensors/"
                              f".pt/.pth/.bin), found {names or 'none'}")
    return found[0]


def _checkpoint_config(file: Path) -> AlphaErConfig:
    """The config from the safetensors header, or from a config.json beside the file; both must agree."""
    header = {}
    if file.suffix == ".safetensors":
        header = {k: v for k, v in safetensors_metadata(file).items() if k not in ("format",)}
    beside = file.parent / "config.json"
    from_json = read_json(beside) if beside.exists() else {}
    if not any(name in header for name in REFERENCE_FIELDS) and not from_json:
        raise CheckpointError(
            f"{file} carries no config: its header metadata has none of the fields {list(REFERENCE_FIELDS)} "
            f"and there is no config.json beside it"
        )
    if header and from_json:
        header_cfg, json_cfg = convert_alpha_er_config(header), convert_alpha_er_config(from_json)
        differ = [n for n in REFERENCE_FIELDS if getattr(header_cfg, n) != getattr(json_cfg, n)]
        if differ:
            raise CheckpointError(f"{file}'s header and {beside} disagree on {differ}")
        return header_cfg
    return convert_alpha_er_config(header or from_json)


def _tensors(file: Path) -> Iterator[tuple[str, str, torch.Tensor]]:
    for name, tensor in iter_tensors(file):
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"{file}: entry {name!r} is a {type(tensor).__name__}, not a tensor; "
                                  "give a plain state dict")
        yield str(file), name, tensor


def load_alpha_er_checkpoint(path, dtype: torch.dtype | str | None = None, device=None, *,
                             build: Build) -> HookedModel:
    """From a safetensors file (config in its header or a config.json beside it), a torch state-dict
    file with a config.json beside it, or a directory holding one of them. Tokenizer files beside
    the weights (tokenizer.json, ...) become `model.tokenizer`."""
    dtype, device = resolve_dtype(dtype), None if device is None else resolve_device(device)
    file = _weight_file(Path(path))
    if file.suffix != ".safetensors" and file.suffix not in _TORCH_SUFFIXES:
        raise CheckpointError(f"{file} is neither .safetensors nor a torch file ({', '.join(_TORCH_SUFFIXES)})")
    try:
        cfg = _checkpoint_config(file)
    except CheckpointError as error:  # name the file, whichever of its fields was at fault
        raise CheckpointError(error if str(file) in str(error) else f"{file}: {error}") from None
    model = build_alpha_er(cfg, _tensors(file), dtype or cfg.dtype, device or "cpu", build)
    model.tokenizer = load_tokenizer(file.parent, foreign_config=True)
    return model


def save_alpha_er_checkpoint(model: HookedModel, path) -> None:
    """The reference's format: one safetensors file, the config fields as JSON strings in its header.

    A path ending in .safetensors is that file; any other is a directory that gets model.safetensors
    and a config.json with the same fields. The model's tokenizer, if any, is saved beside the file.
    """
    path = Path(path)
    config = reference_config_dict(model.cfg)
    if path.suffix == ".safetensors":
        path.parent.mkdir(parents=True, exist_ok=True)
        file = path
    else:
        path.mkdir(parents=True, exist_ok=True)
        file = path / "model.safetensors"
        (path / "config.json").write_text(json.dumps(config, indent=2))
    fields = model.cfg.reference_fields()
    metadata = {"format": "pt", "model_type": MODEL_TYPE, **{name: json.dumps(value) for name, value in fields.items()}}
    state = {name: tensor.detach().contiguous() for name, tensor in hooked_to_reference_state_dict(model).items()}
    save_file(state, str(file), metadata=metadata)
    if model.tokenizer is not None:
        save_tokenizer(model.tokenizer, file.parent)
