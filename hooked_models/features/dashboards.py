"""Feature dashboards: what one SAE or transcoder feature does over a harvest on disk.

    board = features.dashboard(model, "out/acts", sae, feature=3)     # top windows, histogram, logit effects
    features.search_by_token(model, "out/acts", sae, " Mary", k=10)   # the features that fire on a token

Anchors: SAELens's feature dashboards (sae-dashboard), Neuronpedia's: the top-activating windows with each
token's activation, the activation histogram and density, and the tokens the decoder direction promotes
and suppresses through the unembedding (W_dec[f] @ W_U, the final norm's weight not applied unless
`fold_ln` ran, as those dashboards read it).

The harvest is read a batch of windows at a time; a dashboard holds one float per harvested token (the
feature's activation), never the SAE's full output over the corpus.
"""

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch import Tensor

from hooked_models.features.reading import (
    ProgressFraction,
    batches,
    check_feature,
    d_sae_of,
    encode,
    harvest_column,
    open_harvest,
)
from hooked_models.features.results import Window


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


def logit_effects(model, sae: nn.Module, feature: int, k: int = 10):
    """The k tokens W_dec[feature] @ W_U raises most and the k it lowers most, as (token, weight), and a
    note: empty, or why there are none (a decoder whose width is not the residual stream's)."""
    with torch.no_grad():
        return _logit_effects(model, sae.W_dec[check_feature(feature, d_sae_of(sae))], k)


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
              radius: int = 8, bins: int = 40, batch_size: int = 256, progress: ProgressFraction | None = None) -> Dashboard:
    """One feature's dashboard over the harvest at `harvest_path` (see the module docstring).

    top_k windows by their peak activation, each shown `radius` tokens either side of the peak; a window
    where the feature never fires is not a top window.
    """
    harvest = open_harvest(harvest_path)
    column = harvest_column(model, harvest, sae, name)
    d_sae = d_sae_of(sae)
    check_feature(feature, d_sae)
    per_row, tokens = [], []
    with torch.no_grad():
        for _, ids, acts in batches(harvest, column, batch_size, progress):
            per_row.append(encode(sae, acts)[..., feature].cpu())
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
                    batch_size: int = 256, progress: ProgressFraction | None = None) -> list[dict]:
    """The k features with the largest mean activation where `token` (a string that is one token, or an id)
    occurs in the harvest: [{feature, mean, max, occurrences}], strongest first. A token the harvest never
    holds is a ValueError."""
    token_id = model.to_single_token(token) if isinstance(token, str) else int(token)
    if not 0 <= token_id < model.cfg.vocab_size:
        raise ValueError(f"token id {token_id} is outside [0, {model.cfg.vocab_size - 1}]")
    harvest = open_harvest(harvest_path)
    column = harvest_column(model, harvest, sae, name)
    total = torch.zeros(d_sae_of(sae), dtype=torch.float64)
    peak = torch.zeros(d_sae_of(sae))
    seen = 0
    with torch.no_grad():
        for _, ids, acts in batches(harvest, column, batch_size, progress):
            where = ids == token_id
            if where.any():
                features = encode(sae, acts[where]).cpu()  # [occurrence d_sae]
                total += features.double().sum(0)
                peak = torch.maximum(peak, features.max(0).values)
                seen += int(where.sum())
    if seen == 0:
        raise ValueError(f"token {token!r} (id {token_id}) never occurs in the harvest at {harvest_path}")
    mean = (total / seen).float()
    order = mean.argsort(descending=True, stable=True)[:k]
    return [{"feature": int(f), "mean": float(mean[f]), "max": float(peak[f]), "occurrences": seen}
            for f in order]
