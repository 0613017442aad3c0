"""Feature dashboards: what one SAE or transcoder feature does over a harvest on disk.

    from hooked_models import features
    board = features.dashboard(model, "out/acts", sae, feature=3)     # top windows, histogram, logit effects
    features.search_by_token(model, "out/acts", sae, " Mary", k=10)   # the features that fire on a token

`sae` is any module with `encode(x) -> [..., d_sae]` and `W_dec [d_sae d_out]` (a SAELens SAE, a
`saes.py` module, one layer of a transcoder set). It reads the harvest column of the value it was
trained at (`sae_hook_name`, standard or TransformerLens name, or `name=`), in the layout a harvest
stores and an SAE reads ([window position d_in], heads flattened position first). Anchors: SAELens's
feature dashboards (sae-dashboard), Neuronpedia's: the top-activating windows with each token's
activation, the activation histogram and density, and the tokens the decoder direction promotes and
suppresses through the unembedding (W_dec[f] @ W_U, the final norm's weight not applied unless
`fold_ln` ran, as those dashboards read it).

The harvest is read a batch of windows at a time; a dashboard holds one float per harvested token (the
feature's activation), never the SAE's full output over the corpus.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
from torch import Tensor

from hooked_models.saes import sae_hook_name

Progress = Callable[[float], None]


@dataclass
class Window:
    """A stretch of one harvested window around the feature's strongest position there."""

    row: int  # the window's index in the harvest
    position: int  # where the feature peaks, in the window
    start: int  # the first position shown
    tokens: list[str]
    activations: list[float]  # the feature's activation at each token shown

    @property
    def peak(self) -> float:
        return self.activations[self.position - self.start]


@dataclass
class Dashboard:
    """One feature over a harvest. `density` is the fraction of tokens where it is active (> 0);
    `histogram` counts its positive activations in `bins` equal bins from 0 to `max_activation`
    (`edges` has bins + 1 entries); `promoted`/`suppressed` are (token, logit weight) pairs of
    W_dec[f] @ W_U, or empty with `logit_note` saying why (a decoder that does not write the residual
    stream's width)."""

    feature: int
    name: str
    d_sae: int
    tokens: int
    density: float
    max_activation: float
    mean_active: float
    windows: list[Window]
    counts: list[int]
    edges: list[float]
    promoted: list[tuple[str, float]] = field(default_factory=list)
    suppressed: list[tuple[str, float]] = field(default_factory=list)
    logit_note: str = ""


def _column(model, harvest, sae: nn.Module, name: str | None) -> str:
    """The harvest column the SAE reads: `name`, else the SAE's hook, in its standard spelling."""
    wanted = name or sae_hook_name(sae)
    if wanted is None:
        raise ValueError("the SAE names no hook (no cfg.metadata.hook_name or hook_name): pass name=")
    standard, _ = model.resolve_hook_name(wanted) if wanted in model.hook_dict else (wanted, None)
    if standard not in harvest.column_names:
        columns = [c for c in harvest.column_names if c != "token_ids"]
        raise ValueError(f"the harvest has no column {standard!r} (the SAE's value); it holds {columns}")
    return standard


def _open(path):
    """The harvest at `path` as a `datasets.Dataset` (a ValueError if it is not one)."""
    import datasets

    if not (Path(path) / "manifest.json").is_file():
        raise ValueError(f"{path} is not a harvest (no manifest.json): write one with corpus.harvest")
    return datasets.load_from_disk(str(path))


def _d_sae(sae: nn.Module) -> int:
    return int(sae.W_dec.shape[0])


def check_feature(feature: int, d_sae: int) -> int:
    """`feature` if it indexes one of `d_sae` features, else a ValueError naming the range."""
    if isinstance(feature, bool) or not isinstance(feature, int) or not 0 <= feature < d_sae:
        raise ValueError(f"feature={feature!r} is outside [0, {d_sae - 1}]: the SAE has {d_sae} features")
    return feature


def _batches(harvest, column: str, batch_size: int, progress: Progress | None):
    """(first row, token ids [window seq], activations [window seq d]) a batch at a time."""
    rows = len(harvest)
    view = harvest.with_format("torch", columns=[column, "token_ids"])
    for start in range(0, rows, batch_size):
        batch = view[start:start + batch_size]
        yield start, batch["token_ids"], batch[column]
        if progress is not None:
            progress(min(start + batch_size, rows) / rows)


def _encode(sae: nn.Module, acts: Tensor) -> Tensor:
    weight = sae.W_dec
    return sae.encode(acts.to(weight.device, weight.dtype)).float()


def logit_effects(model, sae: nn.Module, feature: int, k: int = 10):
    """The k tokens W_dec[feature] @ W_U raises most and the k it lowers most, as (token, weight), and a
    note: empty, or why there are none (a decoder whose width is not the residual stream's)."""
    with torch.no_grad():
        return _logit_effects(model, sae.W_dec[check_feature(feature, _d_sae(sae))], k)


def _logit_effects(model, direction: Tensor, k: int):
    hidden = model.cfg.hidden_size
    if direction.shape[-1] != hidden:
        return [], [], (f"the decoder writes width {direction.shape[-1]}, not the residual stream's {hidden}: "
                        "no logit effect through the unembedding")
    W_U = model.W_U
    direction = direction.to(W_U.A.dtype if hasattr(W_U, "A") else W_U.dtype)
    # alpha-er's unembedding is a FactoredMatrix: multiply through its factors, never materialise A @ B.
    logits = (direction @ W_U.A @ W_U.B if hasattr(W_U, "A") else direction @ W_U).float()
    k = min(k, logits.numel())
    up, down = logits.topk(k), (-logits).topk(k)
    name = model.to_str_tokens
    return ([(t, float(v)) for t, v in zip(name(up.indices), up.values)],
            [(t, float(-v)) for t, v in zip(name(down.indices), down.values)], "")


def dashboard(model, harvest_path, sae: nn.Module, feature: int, *, name: str | None = None, top_k: int = 8,
              radius: int = 8, bins: int = 40, batch_size: int = 256, progress: Progress | None = None) -> Dashboard:
    """One feature's dashboard over the harvest at `harvest_path` (see the module docstring).

    top_k windows by their peak activation, each shown `radius` tokens either side of the peak; a window
    where the feature never fires is not a top window.
    """
    harvest = _open(harvest_path)
    column = _column(model, harvest, sae, name)
    d_sae = _d_sae(sae)
    check_feature(feature, d_sae)
    per_row, tokens = [], []
    with torch.no_grad():
        for _, ids, acts in _batches(harvest, column, batch_size, progress):
            per_row.append(_encode(sae, acts)[..., feature].cpu())
            tokens.append(ids)
    acts, ids = torch.cat(per_row), torch.cat(tokens)  # [window seq]
    active = acts[acts > 0]
    peak = float(acts.max()) if acts.numel() else 0.0
    top = 0.0 if active.numel() == 0 else peak
    counts = torch.histc(active, bins=bins, min=0.0, max=top or 1.0) if active.numel() else torch.zeros(bins)
    edges = torch.linspace(0.0, top or 1.0, bins + 1)
    row_peaks, row_argmax = acts.max(dim=1)
    order = row_peaks.argsort(descending=True, stable=True)[:top_k]
    windows = []
    for row in order.tolist():
        if row_peaks[row] <= 0:
            break
        position = int(row_argmax[row])
        start, stop = max(0, position - radius), min(acts.shape[1], position + radius + 1)
        windows.append(Window(row, position, start, model.to_str_tokens(ids[row, start:stop]),
                              acts[row, start:stop].tolist()))
    promoted, suppressed, note = logit_effects(model, sae, feature)
    return Dashboard(feature, column, d_sae, acts.numel(), active.numel() / max(acts.numel(), 1), peak,
                     float(active.mean()) if active.numel() else 0.0, windows, [int(c) for c in counts.tolist()],
                     edges.tolist(), promoted, suppressed, note)


def search_by_token(model, harvest_path, sae: nn.Module, token: str | int, *, k: int = 10, name: str | None = None,
                    batch_size: int = 256, progress: Progress | None = None) -> list[dict]:
    """The k features with the largest mean activation where `token` (a string that is one token, or an id)
    occurs in the harvest: [{feature, mean, max, occurrences}], strongest first. A token the harvest never
    holds is a ValueError."""
    token_id = model.to_single_token(token) if isinstance(token, str) else int(token)
    if not 0 <= token_id < model.cfg.vocab_size:
        raise ValueError(f"token id {token_id} is outside [0, {model.cfg.vocab_size - 1}]")
    harvest = _open(harvest_path)
    column = _column(model, harvest, sae, name)
    total = torch.zeros(_d_sae(sae), dtype=torch.float64)
    peak = torch.zeros(_d_sae(sae))
    seen = 0
    with torch.no_grad():
        for _, ids, acts in _batches(harvest, column, batch_size, progress):
            where = ids == token_id
            if where.any():
                features = _encode(sae, acts[where]).cpu()  # [occurrence d_sae]
                total += features.double().sum(0)
                peak = torch.maximum(peak, features.max(0).values)
                seen += int(where.sum())
    if seen == 0:
        raise ValueError(f"token {token!r} (id {token_id}) never occurs in the harvest at {harvest_path}")
    mean = (total / seen).float()
    order = mean.argsort(descending=True, stable=True)[:k]
    return [{"feature": int(f), "mean": float(mean[f]), "max": float(peak[f]), "occurrences": seen}
            for f in order]
