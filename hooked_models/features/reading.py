"""Reading a harvest for an SAE: the column it reads, a batch of windows at a time, encoded.

`sae` is any module with `encode(x) -> [..., d_sae]` and `W_dec [d_sae d_out]` (a SAELens SAE, a `saes.py`
module, one layer of a transcoder set). It reads the harvest column of the value it was trained at
(`sae_hook_name`, standard or TransformerLens name, or `name=`), in the layout a harvest stores and an SAE
reads ([window position d_in], heads flattened position first).
"""

from collections.abc import Callable
from pathlib import Path

import torch.nn as nn
from torch import Tensor

from hooked_models.sae_metadata import sae_hook_name

# The dashboards' progress: the fraction of the harvest read.
ProgressFraction = Callable[[float], None]


def harvest_column(model, harvest, sae: nn.Module, name: str | None) -> str:
    """The harvest column the SAE reads: `name`, else the SAE's hook, in its standard spelling."""
    wanted = name or sae_hook_name(sae)
    if wanted is None:
        raise ValueError("the SAE names no hook (no cfg.metadata.hook_name or hook_name): pass name=")
    standard, _ = model.resolve_hook_name(wanted) if wanted in model.hook_dict else (wanted, None)
    if standard not in harvest.column_names:
        columns = [c for c in harvest.column_names if c != "token_ids"]
        raise ValueError(f"the harvest has no column {standard!r} (the SAE's value); it holds {columns}")
    return standard


def open_harvest(path):
    """The harvest at `path` as a `datasets.Dataset` (a ValueError if it is not one)."""
    import datasets

    if not (Path(path) / "manifest.json").is_file():
        raise ValueError(f"{path} is not a harvest (no manifest.json): write one with corpus.harvest")
    return datasets.load_from_disk(str(path))


def d_sae_of(sae: nn.Module) -> int:
    """How many features the SAE has (its decoder's rows)."""
    return int(sae.W_dec.shape[0])


def check_feature(feature: int, d_sae: int) -> int:
    """`feature` if it indexes one of `d_sae` features, else a ValueError naming the range."""
    if isinstance(feature, bool) or not isinstance(feature, int) or not 0 <= feature < d_sae:
        raise ValueError(f"feature={feature!r} is outside [0, {d_sae - 1}]: the SAE has {d_sae} features")
    return feature


def batches(harvest, column: str, batch_size: int, progress: ProgressFraction | None):
    """(first row, token ids [window seq], activations [window seq d]) a batch at a time."""
    rows = len(harvest)
    view = harvest.with_format("torch", columns=[column, "token_ids"])
    for start in range(0, rows, batch_size):
        batch = view[start:start + batch_size]
        yield start, batch["token_ids"], batch[column]
        if progress is not None:
            progress(min(start + batch_size, rows) / rows)


def encode(sae: nn.Module, acts: Tensor) -> Tensor:
    """The SAE's features of harvested activations, in float32 on the CPU's or the SAE's device."""
    weight = sae.W_dec
    return sae.encode(acts.to(weight.device, weight.dtype)).float()


