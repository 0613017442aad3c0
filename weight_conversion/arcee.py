"""Arcee AFM: transformers' config and state dict <-> HookedArcee's.

The converters are pure: `convert_arcee_config` maps a config.json dict to an `ArceeConfig` and
refuses fields it does not understand; `convert_arcee_name` maps one tensor name; and
`convert_arcee_state_dict` applies it to a whole state dict, every source tensor consumed and every
target filled. The loaders around them read and write real checkpoint directories; they import no
family: the family passes `build`, which makes its model for a config on the meta device.
"""

import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hooked_models.devices import cuda_devices, parameter_placement, resolve_device, spread_layers
from hooked_models.dtypes import dtype_name, resolve_dtype
from hooked_models.config import ROPE_TYPES, ArceeConfig, RopeConfig
from hooked_models.model import HookedModel
from weight_conversion.checkpoint import (
    CheckpointError,
    checkpoint_bytes,
    iter_tensors,
    load_tokenizer,
    read_json,
    rename_state_dict,
    resolve_checkpoint_dir,
    save_sharded,
    save_tokenizer,
    stream_into,
    weight_files,
)

# config.json fields that change nothing about the forward (bookkeeping, training, generation).
_IGNORED_FIELDS = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "initializer_range",
    "use_cache", "attention_dropout", "_name_or_path", "auto_map", "output_attentions",
    "output_hidden_states", "return_dict", "pretraining_tp", "rope_theta", "rope_scaling", "rope_parameters",
    "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings", "hidden_act", "attention_bias",
    "mlp_bias", "head_dim", "num_key_value_heads", "max_position_embeddings", "rms_norm_eps",
    "quantization_config_ignored", "chunk_size_feed_forward", "id2label", "label2id", "problem_type",
    "tokenizer_class", "is_encoder_decoder", "tf_legacy_loss", "use_bfloat16", "pruned_heads",
    "finetuning_task", "add_cross_attention", "cross_attention_hidden_size", "is_decoder",
    "_attn_implementation_autoset", "layer_types",
}
_SHAPE_FIELDS = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"}
_ROPE_FIELDS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings",
                "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}

def convert_arcee_config(hf: dict) -> ArceeConfig:
    """A transformers Arcee config (config.json as a dict) -> ArceeConfig.

    Refuses a model_type other than "arcee", an activation other than relu2, biases, a rope type
    other than default or yarn, sizes that are not positive integers, fields that contradict each
    other, and any field it does not know, naming the field.
    """
    if not isinstance(hf, dict):
        raise CheckpointError(f"the config is a JSON {type(hf).__name__}, not an object of fields")
    model_type = hf.get("model_type")
    if model_type != "arcee":
        raise CheckpointError(f"model_type is {model_type!r}; HookedArcee loads model_type 'arcee' only")
    unknown = sorted(set(hf) - _IGNORED_FIELDS - _SHAPE_FIELDS)
    if unknown:
        raise CheckpointError(f"config field(s) {unknown} are not understood by the Arcee converter")
    missing = sorted(_SHAPE_FIELDS - set(hf))
    if missing:
        raise CheckpointError(f"config is missing field(s) {missing}")
    if hf.get("hidden_act", "relu2") != "relu2":
        raise CheckpointError(f"hidden_act is {hf['hidden_act']!r}; Arcee's MLP is relu2")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise CheckpointError(f"{flag} is true; Arcee checkpoints have no biases and none are supported")
    _check_sizes(hf)
    layer_types = set(hf.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise CheckpointError(f"layer_types {sorted(layer_types)}: only full attention is supported (no sliding window)")
    heads = hf["num_attention_heads"]
    return ArceeConfig(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        vocab_size=hf["vocab_size"],
        intermediate_size=hf["intermediate_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        rope=convert_rope(hf),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
        pad_token_id=hf.get("pad_token_id"),
        dtype=_config_dtype(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
    )


def _config_dtype(name) -> torch.dtype:
    try:
        return resolve_dtype(name)
    except ValueError as error:
        raise CheckpointError(f"dtype: {error}") from None


def _check_sizes(hf: dict) -> None:
    """Sizes must be positive integers: a string or a zero would otherwise fail deep inside torch."""
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings"):
        value = hf.get(name)
        if value is None and name not in _SHAPE_FIELDS:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise CheckpointError(f"{name} is {value!r}; it must be a positive integer")
    eps = hf.get("rms_norm_eps", 1e-5)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise CheckpointError(f"rms_norm_eps is {eps!r}; it must be a number in (0, 1)")


def convert_rope(hf: dict) -> RopeConfig:
    """Rotary parameters from either spelling: `rope_parameters` (transformers 5) or `rope_scaling`
    with a top-level `rope_theta` (older files, AFM-4.5B's own config.json)."""
    given = {k: hf[k] for k in ("rope_parameters", "rope_scaling") if hf.get(k)}
    for key, value in given.items():
        if not isinstance(value, dict):
            raise CheckpointError(f"{key} is {value!r}, not an object of fields")
    spellings = [{("rope_type" if k == "type" else k): v for k, v in p.items()} for p in given.values()]
    if len(spellings) == 2:
        clash = sorted(k for k in set(spellings[0]) & set(spellings[1]) if spellings[0][k] != spellings[1][k])
        if clash:
            raise CheckpointError(f"rope_parameters and rope_scaling disagree on {clash}: "
                                  f"{given['rope_parameters']} against {given['rope_scaling']}")
    params = dict(next(iter(given.values()), {}))
    if "rope_theta" in params and "rope_theta" in hf and params["rope_theta"] != hf["rope_theta"]:
        raise CheckpointError(f"rope_theta is {hf['rope_theta']} at the top level but {params['rope_theta']} "
                              "in the rope parameters")
    unknown = sorted(set(params) - _ROPE_FIELDS)
    if unknown:
        raise CheckpointError(f"rope parameter(s) {unknown} are not understood by the Arcee converter")
    rope_type = _rope_type(params)
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(f"rope_type {rope_type!r} is not supported; supported: {list(ROPE_TYPES)}")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    for name, value in (("rope_theta", theta), ("factor", params.get("factor", 1.0)),
                        ("original_max_position_embeddings", params.get("original_max_position_embeddings", 1))):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise CheckpointError(f"rope {name} is {value!r}; it must be a positive number")
    if rope_type == "default":
        return RopeConfig("default", theta=float(theta))
    return RopeConfig(
        "yarn",
        theta=float(theta),
        factor=params.get("factor"),
        original_max_position_embeddings=params.get("original_max_position_embeddings",
                                                    hf.get("max_position_embeddings")),
        attention_factor=params.get("attention_factor"),
        beta_fast=params.get("beta_fast") or 32.0,
        beta_slow=params.get("beta_slow") or 1.0,
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=params.get("truncate", True),
    )


def _rope_type(params) -> str:
    return params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else params


def convert_arcee_name(name: str) -> str:
    """`model.layers.3.mlp.up_proj.weight` -> `layers.3.mlp.up_proj.weight`: the hooked tree keeps
    transformers' module names without the `model.` prefix."""
    if name == "lm_head.weight":
        return name
    if name.startswith("model."):
        return name[len("model."):]
    raise KeyError(name)


def is_derived_arcee_tensor(name: str) -> bool:
    """Tensors some files carry that are computed, not learned (rotary frequencies)."""
    return name.endswith("rotary_emb.inv_freq")


def convert_arcee_state_dict(state: dict[str, torch.Tensor], cfg: ArceeConfig) -> dict[str, torch.Tensor]:
    """A transformers state dict -> HookedArcee's, with every tensor consumed and every target filled."""
    skip = lambda name: is_derived_arcee_tensor(name) or (cfg.tie_word_embeddings and name == "lm_head.weight")  # noqa: E731
    return rename_state_dict(state, convert_arcee_name, "Arcee", skip)


def hooked_to_hf_state_dict(model: HookedModel) -> dict[str, torch.Tensor]:
    """The way back: HookedArcee's parameters under transformers' names."""
    out = {}
    for name, tensor in model.state_dict().items():
        if model.cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        out[name if name == "lm_head.weight" else f"model.{name}"] = tensor
    return out


def hf_config_dict(cfg: ArceeConfig) -> dict:
    """ArceeConfig -> the config.json that transformers' ArceeConfig reads, 4.5x and 5.x alike.

    The rotary parameters are written in both layouts, which agree: 5.x reads `rope_parameters`
    (`rope_theta` inside), 4.x reads `rope_scaling` with a top-level `rope_theta` (AFM-4.5B's own
    layout) and ignores `rope_parameters`. 5.x takes `rope_scaling` over `rope_parameters` when both
    are there (`RotaryEmbeddingConfigMixin.convert_rope_params_to_dict`), so the two must be the same
    fields: a file with only `rope_parameters` loads in 4.x with the default rotary, YaRN dropped.
    `rope_scaling` holds exactly the keys 4.57's `_validate_yarn_parameters` accepts, factor a float.
    """
    rope = {"rope_type": cfg.rope.rope_type}
    if cfg.rope.rope_type == "yarn":
        for field in ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                      "mscale", "mscale_all_dim", "truncate"):
            value = getattr(cfg.rope, field)
            if value is not None:
                rope[field] = float(value) if field == "factor" else value
    dtype = dtype_name(cfg.dtype)
    return {
        "architectures": ["ArceeForCausalLM"], "model_type": "arcee", "hidden_act": "relu2",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope.theta, "rope_scaling": rope if cfg.rope.rope_type != "default" else None,
        "rope_parameters": {**rope, "rope_theta": cfg.rope.theta}, "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False, "mlp_bias": False, "dtype": dtype,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
    }


# ------------------------------------------------------------------------------------------ loaders
# The family's constructor, called on the meta device: the model for a config, with no storage yet.
Build = Callable[[ArceeConfig], HookedModel]


def _checked_device(device, n_devices: int | None):
    """One device, checked to exist (a clear error for "cuda" without CUDA); with n_devices, `device`
    is the first GPU and `cuda_devices` checks the range."""
    return resolve_device(device) if device is not None and n_devices is None else device


def _placement(cfg: ArceeConfig, device, n_devices: int | None):
    """(where each parameter goes, the devices) for `device`, or for layers spread over n_devices GPUs."""
    if n_devices is None:
        return device, None
    devices = cuda_devices(n_devices, device)
    return parameter_placement(cfg.num_layers, devices), devices


def _finish(model: HookedModel, dtype: torch.dtype, device, devices=None) -> HookedModel:
    model.tie_weights()
    model.cfg.dtype, model.cfg.device = dtype, torch.device(device if devices is None else devices[0])
    if devices is not None:
        spread_layers(model, devices)  # the weights are in place already; this adds the residual's moves
    model.setup()
    return model.eval()


def load_from_hf_model(hf_model, dtype: torch.dtype | str | None = None, device=None,
                       n_devices: int | None = None, *, build: Build) -> HookedModel:
    """From an in-memory `ArceeForCausalLM`; the weights are copied. `n_devices` spreads the layers
    over that many GPUs from `device` (cuda:0 by default), as TransformerLens does."""
    dtype, device = resolve_dtype(dtype), _checked_device(device, n_devices)
    cfg = convert_arcee_config(hf_model.config.to_dict())
    first = next(hf_model.parameters())
    dtype = dtype or first.dtype
    device = device or (first.device if n_devices is None else None)
    cfg.dtype = dtype
    placement, devices = _placement(cfg, device, n_devices)
    model = build(cfg)
    state = convert_arcee_state_dict(hf_model.state_dict(), cfg)
    triples = ((type(hf_model).__name__, name, tensor.detach().clone()) for name, tensor in state.items())
    stream_into(model, triples, rename=lambda name: name, dtype=dtype, device=placement)
    return _finish(model, dtype, device, devices)


def load_arcee_checkpoint(path_or_id, dtype: torch.dtype | str | None = None, device=None,
                          progress: bool | None = None, n_devices: int | None = None, *,
                          build: Build) -> HookedModel:
    """From an HF directory: config.json, safetensors shards (or a weights-only pickle), tokenizer.
    With `n_devices`, each tensor streams straight to its layer's GPU."""
    dtype, device = resolve_dtype(dtype), _checked_device(device, n_devices)
    directory = resolve_checkpoint_dir(path_or_id)
    config_path = directory / "config.json"
    config = read_json(config_path)
    try:
        cfg = convert_arcee_config(config)
    except ValueError as error:  # CheckpointError, or ArceeConfig's own checks: name the file
        raise CheckpointError(f"{config_path}: {error}") from None
    dtype = dtype or cfg.dtype
    device = device or ("cpu" if n_devices is None else None)
    cfg.dtype = dtype
    placement, devices = _placement(cfg, device, n_devices)
    files = weight_files(directory)
    model = build(cfg)
    if progress is None:
        progress = sys.stderr.isatty()
    bar = tqdm(total=checkpoint_bytes(files), unit="B", unit_scale=True, desc="loading", disable=not progress)
    triples = ((file, name, tensor) for file in files for name, tensor in iter_tensors(file))
    skip = lambda name: is_derived_arcee_tensor(name) or (cfg.tie_word_embeddings and name == "lm_head.weight")  # noqa: E731
    try:
        stream_into(model, triples, rename=convert_arcee_name, dtype=dtype, device=placement, skip=skip,
                    progress=bar)
    finally:
        bar.close()
    model = _finish(model, dtype, device, devices)
    model.tokenizer = load_tokenizer(directory)
    return model


def save_arcee_checkpoint(model: HookedModel, path, max_shard_size: int | str = "5GB") -> None:
    """config.json + safetensors (sharded past `max_shard_size`) + the tokenizer, for transformers."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config_dict(model.cfg), indent=2))
    save_sharded(hooked_to_hf_state_dict(model), directory, max_shard_size)
    if model.tokenizer is not None:
        save_tokenizer(model.tokenizer, directory)
