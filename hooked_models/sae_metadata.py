"""What an SAE or transcoder says of itself (SAELens's `cfg` and its `metadata`, or plain attributes): the hook it
was trained at, the value it writes, its widths. Read without importing TransformerLens, so that reading feature
statistics or a graph store does not pay for it."""

import torch.nn as nn
from torch import Tensor


def sae_hook_name(sae: nn.Module) -> str | None:
    """The hook an SAE was trained at: SAELens's `cfg.metadata.hook_name`, else a `hook_name` attribute."""
    metadata = getattr(getattr(sae, "cfg", None), "metadata", None)
    name = getattr(metadata, "hook_name", None)
    return name if name is not None else getattr(sae, "hook_name", None)


def sae_hook_name_out(sae: nn.Module) -> str | None:
    """The value a transcoder writes: SAELens's `cfg.metadata.hook_name_out`, else `hook_name_out`."""
    metadata = getattr(getattr(sae, "cfg", None), "metadata", None)
    name = getattr(metadata, "hook_name_out", None)
    return name if name is not None else getattr(sae, "hook_name_out", None)


def sae_out_width(sae: nn.Module) -> int | None:
    """The width an SAE or transcoder writes (`cfg.d_out`, `d_out`, W_dec's columns; an SAE's d_in)."""
    for width in (getattr(getattr(sae, "cfg", None), "d_out", None), getattr(sae, "d_out", None)):
        if isinstance(width, int):
            return width
    w_dec = getattr(sae, "W_dec", None)
    return int(w_dec.shape[1]) if isinstance(w_dec, Tensor) and w_dec.ndim == 2 else sae_width(sae)


def sae_width(sae: nn.Module) -> int | None:
    """The width an SAE reads (SAELens's `cfg.d_in`, a `d_in` attribute, or W_enc's rows), if it says."""
    for width in (getattr(getattr(sae, "cfg", None), "d_in", None), getattr(sae, "d_in", None)):
        if isinstance(width, int):
            return width
    w_enc = getattr(sae, "W_enc", None)
    return int(w_enc.shape[0]) if isinstance(w_enc, Tensor) and w_enc.ndim == 2 else None
