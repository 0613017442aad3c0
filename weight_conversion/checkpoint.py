"""Reading and writing checkpoint files: safetensors shards and their index, pickles (weights only),
and the streaming load that fills a model built on the meta device one tensor at a time.

These functions know files, not families: each family's converter says how a source tensor's name
maps to a hooked one (`rename`), and this module enforces that every target is filled exactly once.
"""

import json
import math
import os
import warnings
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is: names the file and the tensor at fault."""


def resolve_checkpoint_dir(path_or_id: str | os.PathLike) -> Path:
    """A local directory, or a Hub id already in the local HF cache (no network is used)."""
    path = Path(path_or_id)
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{path} is a file; give the checkpoint directory that holds config.json")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(path_or_id), local_files_only=True))
    except Exception as error:  # the hub raises several kinds for "not cached"
        raise CheckpointError(
            f"{str(path_or_id)!r} is neither a directory nor a Hub id in the local HF cache "
            f"(loading is offline): {type(error).__name__}"
        ) from None


def read_json(path: Path) -> dict:
    try:
        content = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(content, dict):
        raise CheckpointError(f"{path} holds a JSON {type(content).__name__}, not an object of fields")
    return content


def weight_files(directory: Path) -> list[Path]:
    """The checkpoint's weight files: the shards its index names, or its single file."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index_path = directory / index_name
        if index_path.exists():
            index = read_json(index_path)
            if "weight_map" not in index:
                raise CheckpointError(f"{index_path} has no weight_map")
            shards = sorted(set(index["weight_map"].values()))
            missing = [s for s in shards if not (directory / s).exists()]
            if missing:
                raise CheckpointError(f"{index_path} names shards that are missing: {missing}")
            return [directory / s for s in shards]
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (directory / single).exists():
            return [directory / single]
    found = sorted(p.name for p in directory.glob("*.safetensors"))
    if found:
        return [directory / name for name in found]
    raise CheckpointError(f"{directory} has no model.safetensors, no shards index and no pytorch_model.bin")


def iter_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for each tensor of one file, read one at a time."""
    if path.suffix == ".safetensors":
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as error:
            raise CheckpointError(f"{path} is not a readable safetensors file: {error}") from None
        with handle as f:
            for name in f.keys():
                try:
                    tensor = f.get_tensor(name)
                except Exception as error:
                    raise CheckpointError(f"{path}: tensor {name!r} cannot be read ({error})") from None
                yield name, tensor
        return
    # Pickles only through weights_only=True: nothing in a checkpoint may run code. mmap needs
    # torch.save's zip format; an older plain pickle is read whole, through the same restricted unpickler.
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as error:
        raise CheckpointError(f"{path} cannot be loaded with torch.load(weights_only=True): {error}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a state dict")
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"{path}: entry {name!r} is a {type(tensor).__name__}, not a tensor")
        yield name, tensor


def safetensors_metadata(path: Path) -> dict[str, str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except Exception as error:
        raise CheckpointError(f"{path} is not a readable safetensors file: {error}") from None


def assign_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Replace a (meta) parameter by `tensor`, keeping it a Parameter; no copy beyond the cast."""
    module_path, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    module._parameters[leaf] = nn.Parameter(tensor, requires_grad=True)


def stream_into(
    model: nn.Module,
    tensors: Iterator[tuple[str, str, torch.Tensor]],
    rename: Callable[[str], str | list[tuple[str, Callable]]],
    dtype: torch.dtype,
    device,
    skip: Callable[[str], bool] = lambda name: False,
    progress=None,
) -> None:
    """Fill every parameter of a meta-device `model` from (file, source name, tensor) triples.

    `device` is one device, or a function of the hooked name giving each parameter's device
    (layers spread over several GPUs: `hooked_models.devices.parameter_placement`).

    `rename(source)` gives the hooked name of a source tensor, or raises KeyError for a tensor the
    model has no place for. Each tensor is checked against the target's shape, cast, moved and
    assigned before the next is read, so at most one source tensor is held beside the model.
    Raises CheckpointError on an unexpected, mis-shaped, non-float, repeated or missing tensor;
    warns on NaN or inf.
    """
    expected = {name: p.shape for name, p in model.named_parameters()}
    filled: dict[str, str] = {}
    files: dict[str, None] = {}
    for file, source, tensor in tensors:
        files[str(file)] = None
        if skip(source):
            continue
        try:
            target = rename(source)
        except KeyError:
            raise CheckpointError(f"{file}: unexpected tensor {source!r}, which this model has no place for") from None
        if target not in expected:
            raise CheckpointError(f"{file}: unexpected tensor {source!r} (would be {target!r})")
        if target in filled:
            raise CheckpointError(f"{file}: tensor {source!r} appears twice (first in {filled[target]})")
        if tuple(tensor.shape) != tuple(expected[target]):
            raise CheckpointError(
                f"{file}: tensor {source!r} has shape {tuple(tensor.shape)}, but the config makes "
                f"{target!r} {tuple(expected[target])}"
            )
        # A quantized or integer tensor cast to float would load without complaint and compute nonsense.
        if not tensor.is_floating_point():
            raise CheckpointError(f"{file}: tensor {source!r} has dtype {tensor.dtype}; weights must be floating point")
        bad = count_nonfinite(tensor)
        if bad:
            warnings.warn(f"{file}: tensor {source!r} has {bad} NaN or inf values", stacklevel=3)
        target_device = device(target) if callable(device) else device
        assign_tensor(model, target, tensor.to(device=target_device, dtype=dtype))
        filled[target] = str(file)
        if progress is not None:
            progress.update(tensor.numel() * tensor.element_size())
    missing = [name for name in expected if name not in filled]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"the checkpoint ({', '.join(files) or 'no tensors'}) is missing tensors: {shown}")


def count_nonfinite(tensor: torch.Tensor, chunk: int = 1 << 24) -> int:
    """How many NaN or inf values `tensor` holds, checked in chunks: a boolean mask of a whole
    128k x 2560 embedding would be 330 MB beside the weights, at the loader's peak."""
    flat = tensor.reshape(-1)
    return sum(int((~torch.isfinite(flat[i:i + chunk])).sum()) for i in range(0, flat.numel(), chunk))


def load_tokenizer(directory: Path, foreign_config: bool = False):
    """The tokenizer whose files sit in `directory` (tokenizer.json, ...), else None. Offline.

    `foreign_config`: a config.json there is not a transformers model's (alpha-er's), so transformers
    must not read it: it would warn that it is "using a model of type alpha-er to instantiate a model of
    type ..." (the tokenizer's own files say what it is)."""
    if not any((directory / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer, PretrainedConfig

    extra = {"config": PretrainedConfig()} if foreign_config else {}
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True, **extra)



# transformers 5 names its fast tokenizer class TokenizersBackend, which 4.x does not know;
# PreTrainedTokenizerFast is the same class in 5.x (an alias) and the fast tokenizer in 4.x.
PORTABLE_TOKENIZER_CLASSES = {"TokenizersBackend": "PreTrainedTokenizerFast"}


def save_tokenizer(tokenizer, directory: Path) -> None:
    """`tokenizer.save_pretrained(directory)`, its tokenizer_config.json naming a class that
    transformers 4.5x and 5.x both load (`PORTABLE_TOKENIZER_CLASSES`)."""
    tokenizer.save_pretrained(str(directory))
    path = Path(directory) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    name = config.get("tokenizer_class")
    if name in PORTABLE_TOKENIZER_CLASSES:
        config["tokenizer_class"] = PORTABLE_TOKENIZER_CLASSES[name]
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")

def rename_state_dict(state: dict[str, torch.Tensor], rename: Callable[[str], str], family: str,
                      skip: Callable[[str], bool] = lambda name: False) -> dict[str, torch.Tensor]:
    """A source state dict under hooked names: every tensor consumed (`skip`ped or renamed), an unknown
    name refused. `rename` raises KeyError for a name the family has no place for."""
    out = {}
    for name, tensor in state.items():
        if skip(name):
            continue
        try:
            out[rename(name)] = tensor
        except KeyError:
            raise CheckpointError(f"unexpected tensor {name!r}, which {family} has no place for") from None
    return out


def checkpoint_bytes(files: list[Path]) -> int:
    return sum(f.stat().st_size for f in files)


def parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    text = size.strip().upper()
    for unit, factor in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def save_sharded(state: dict[str, torch.Tensor], directory: Path, max_shard_size: int | str,
                 metadata: dict[str, str] | None = None) -> None:
    """Write safetensors shards (with an index when there is more than one), as transformers does."""
    limit = parse_size(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().contiguous()
        size += nbytes
    meta = {"format": "pt", **(metadata or {})}
    if len(shards) == 1:
        save_file(shards[0], str(directory / "model.safetensors"), metadata=meta)
        return
    width = max(5, int(math.log10(len(shards))) + 1)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:0{width}d}-of-{len(shards):0{width}d}.safetensors"
        save_file(shard, str(directory / file), metadata=meta)
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
