"""The logit lens where the installed TransformerLens has none (3.x; 4.x ships `tools.analysis.logit_lens`,
which `cache.logit_lens` uses there).

Every entry of the accumulated residual stream is read through the model's real readout, as the
model reads its last layer's output: `readout_split()` gives (module, W, b) with logits =
module(resid) @ W + b exactly (the final norm, W_U and b_U; for alpha-er's factored head, the final
norm, `down` and the bottleneck LayerNorm, then `up`), statistics recomputed per entry. The
arguments and the result's fields are TransformerLens 4.x's, so code written against one runs on the other.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens.utilities import Slice

_RETURN_TYPES = ("logits", "log_probs", "probs")


@dataclass
class LogitReadout:
    """What each entry reads as: `values` [entry ... selected] (the full vocabulary, the `targets`,
    the `vocab` ids, or the `top_k` largest with their `top_ids`); `entropy` and `target_ranks`
    (0 = the argmax) are over the full vocabulary."""

    values: Float[Tensor, "..."]
    return_type: str
    entropy: Float[Tensor, "..."]
    top_ids: Int[Tensor, "..."] | None = None
    vocab_ids: Int[Tensor, " v"] | None = None
    target_ids: Tensor | None = None
    target_ranks: Int[Tensor, "..."] | None = None
    per_row_targets: bool = False
    applied_ln: bool = True


@dataclass
class LogitLensResult:
    """The lens over the stack: `values` [entry batch pos selected] (as the selections leave it),
    `labels` the stack's entries ("0_pre", "1_mid", "final_post")."""

    readout: LogitReadout
    labels: list[str]
    has_batch_dim: bool
    target_names: list[str | None] | None = None

    @property
    def values(self) -> Tensor:
        return self.readout.values

    def rank_trajectory(self, target: str | int | None = None) -> Tensor:
        """The full-vocabulary rank of one target at every entry, [entry ...]."""
        ranks, ids = self.readout.target_ranks, self.readout.target_ids
        if ranks is None or ids is None:
            raise ValueError("rank_trajectory needs a lens run with targets=...")
        if self.readout.per_row_targets or target is None:
            if target is not None or (not self.readout.per_row_targets and ids.numel() != 1):
                raise ValueError("pass target= (one of the targets) when more than one target was requested, "
                                 "and none for per-row targets")
            return ranks[..., 0]
        if isinstance(target, str):
            if target not in (self.target_names or []):
                raise ValueError(f"unknown target {target!r}; the targets were {self.target_names}")
            return ranks[..., self.target_names.index(target)]
        matches = (ids == int(target)).nonzero(as_tuple=True)[0]
        if matches.numel() == 0:
            raise ValueError(f"token id {target} was not among the requested targets {ids.tolist()}")
        return ranks[..., int(matches[0])]


def logit_lens(
    cache,
    *,
    layers: Sequence[int] | None = None,
    incl_mid: bool = False,
    positions=-1,
    batch_slice=None,
    lens: Callable[[Tensor, int], Tensor] | None = None,
    apply_ln: bool = True,
    vocab: Sequence[int] | Tensor | None = None,
    targets=None,
    return_type: str = "logits",
    top_k: int | None = None,
    enable_grad: bool = False,
) -> LogitLensResult:
    """Read the cache's accumulated residual stream through the model's readout.

    `layers` indexes the stack (negative from the end); `positions` (default the last) and
    `batch_slice` select as `Slice` does; `lens(entry, index)` translates an entry first (a tuned
    lens). At most one of `targets` (one token or a list, shared by every row; a tensor is per row,
    right-aligned with the stack's [batch pos]), `vocab` (ids to keep) and `top_k`.
    `return_type` is "logits", "log_probs" or "probs".
    """
    model = cache.model
    if return_type not in _RETURN_TYPES:
        raise ValueError(f"return_type must be one of {_RETURN_TYPES}, got {return_type!r}")
    if sum(x is not None for x in (vocab, targets, top_k)) > 1:
        raise ValueError("pass at most one of vocab, targets and top_k")
    if any(module.training for module in model.modules()):
        raise ValueError("logit_lens requires the model in evaluation mode; call model.eval()")
    module, weight, bias = model.readout_split()
    if not apply_ln and module is not model.ln_final:
        raise ValueError("this model's head reads the stream only through its final norm and bottleneck; "
                         "apply_ln=False has no readout here")
    d_vocab = weight.shape[-1]
    if top_k is not None and not 1 <= top_k <= d_vocab:
        raise ValueError(f"top_k must be in [1, {d_vocab}], got {top_k}")

    pos_slice = positions if isinstance(positions, Slice) else Slice(positions)
    batch = batch_slice if isinstance(batch_slice, Slice) else Slice(batch_slice)
    stack, labels = cache.accumulated_resid(incl_mid=incl_mid, pos_slice=pos_slice, return_labels=True)
    keep = list(range(len(labels))) if layers is None else [_entry(i, labels) for i in layers]
    stack, labels = stack[keep], [labels[i] for i in keep]
    if cache.has_batch_dim:
        stack = batch.apply(stack, dim=1)
    has_batch_dim = cache.has_batch_dim and batch.mode != "int"

    with torch.enable_grad() if enable_grad else torch.no_grad():
        if lens is not None:
            stack = torch.stack([lens(stack[i], keep[i]) for i in range(stack.shape[0])])
        if apply_ln:  # the norms take [batch seq hidden_size]; their statistics are per vector
            stack = module(stack.reshape(1, -1, stack.shape[-1])).reshape(*stack.shape[:-1], -1)
        logits = stack @ weight + bias
        log_probs = logits.float().log_softmax(-1)
        quantity = {"logits": logits, "log_probs": log_probs, "probs": log_probs.exp()}[return_type]
        readout = LogitReadout(quantity, return_type, -(log_probs.exp() * log_probs).sum(-1), applied_ln=apply_ln)
        if vocab is not None:
            readout.vocab_ids = _ids(model, vocab, d_vocab, "vocab")
            readout.values = quantity[..., readout.vocab_ids.to(logits.device)]
        elif isinstance(targets, Tensor) and targets.ndim >= 1:
            rows = _ids(model, targets, d_vocab, "targets")
            lead = logits.shape[1:-1]
            if rows.ndim > len(lead):
                raise ValueError(f"per-row targets of shape {tuple(rows.shape)} have more dims than the stack's "
                                 f"{tuple(lead)}; they are right-aligned with it")
            rows = rows.reshape((1,) * (len(lead) - rows.ndim) + tuple(rows.shape)).expand(*lead)
            index = rows[None, ..., None].expand(logits.shape[0], *lead, 1).to(logits.device)
            readout.values = quantity.gather(-1, index)
            readout.target_ranks = (logits > logits.gather(-1, index)).sum(-1, keepdim=True)
            readout.target_ids, readout.per_row_targets = rows, True
        elif targets is not None:
            ids = _ids(model, targets, d_vocab, "targets")
            ids = ids.to(logits.device)
            readout.values = quantity[..., ids]
            readout.target_ranks = (logits[..., None, :] > logits[..., ids, None]).sum(-1)
            readout.target_ids = ids
        elif top_k is not None:
            top = logits.topk(top_k, dim=-1)
            readout.values, readout.top_ids = quantity.gather(-1, top.indices), top.indices
    names = None
    if targets is not None and not isinstance(targets, Tensor):
        names = [t if isinstance(t, str) else None for t in ([targets] if isinstance(targets, (str, int)) else targets)]
    return LogitLensResult(readout, labels, has_batch_dim, names)


def _entry(index: int, labels: list[str]) -> int:
    resolved = index + len(labels) if index < 0 else index
    if not 0 <= resolved < len(labels):
        raise ValueError(f"layer {index} is out of range for the accumulated stack: entries 0..{len(labels) - 1} "
                         f"are {labels}")
    return resolved


def _ids(model, tokens, d_vocab: int, what: str) -> Tensor:
    """Token ids as a long tensor (a single-token string, an int, a list of them, or a tensor), checked."""
    if isinstance(tokens, Tensor):
        if tokens.is_floating_point():
            raise ValueError(f"{what} must hold integer token ids, got dtype {tokens.dtype}")
        ids = tokens.long().reshape(-1) if tokens.ndim == 0 else tokens.long()
    else:
        listed = [tokens] if isinstance(tokens, (str, int)) else list(tokens)
        ids = torch.tensor([model.to_single_token(t) if isinstance(t, str) else int(t) for t in listed])
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= d_vocab:
        raise ValueError(f"{what} ids must be within [0, {d_vocab}), got {ids.tolist()}")
    return ids
