"""Partial feature statistics and the one reducer that merges them, exactly.

A `Partial` holds, for every feature of one SAE (or one layer of a transcoder set), what a stretch of the
corpus showed: tokens seen, how often each feature fired, its least and largest activation, a histogram,
its top-k windows and a sample of windows per activation interval. `merge(a, b)` combines two stretches,
and the result does not depend on how the corpus was cut or in which order the pieces arrive: every
statistic is an integer count, a min, a max or an exact selection (no float sum), so a batch, a shard, a
Ray worker's output and a resumed run's checkpoint are all merged by the same function to the same bits.

Histogram and intervals without knowing the maximum in advance: a feature's bins split [0, 2^e) evenly,
e the exponent of its largest activation so far (max < 2^e <= 2·max). When a larger activation raises e by
δ, bin j becomes bin j >> δ, which is exactly the bin the value would have had (the edges are powers of two
times integers), so coarsening commutes with counting. The sampled windows use the same trick with
`intervals` coarser bins: each interval keeps the `per_interval` windows of smallest priority, a
deterministic pseudo-random number of (token, feature), and the smallest of a union is the smallest of
the parts' smallest (a bottom-k sample, Cohen & Kaplan 2007), so sampling merges exactly too.

Top windows: one per corpus row (the row's peak, its first position on a tie), the k largest peaks, ties to
the earlier row. A window is the 2·radius + 1 positions centred on its token, those outside the row padded
(token -1, activation 0), so a window's extent is exactly [max(0, p - radius), min(seq, p + radius + 1)).
"""

from dataclasses import dataclass, fields

import torch
from jaxtyping import Float, Int
from torch import Tensor

# The exponent of a feature that never fired: below every float32's.
NEVER = -(2**20)
# The priority hash: multiply-add modulo the Mersenne prime 2^31 - 1 (products stay below 2^63).
_P, _A, _B, _C = 2**31 - 1, 48271, 69621, 1_103_515_245


@dataclass(frozen=True)
class Limits:
    """What a partial keeps per feature: `k` top windows, `intervals` activation intervals of
    `per_interval` sampled windows each, a histogram of `bins` bins (powers of two, `intervals` dividing
    `bins`), windows `radius` tokens either side of their token."""

    d_sae: int
    k: int = 8
    intervals: int = 8
    per_interval: int = 4
    bins: int = 64
    radius: int = 8

    def __post_init__(self):
        for name in ("d_sae", "k", "intervals", "per_interval", "bins"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if isinstance(self.radius, bool) or not isinstance(self.radius, int) or self.radius < 0:
            raise ValueError(f"radius={self.radius!r} must be a non-negative integer")
        for name in ("intervals", "bins"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two (its bins halve exactly)")
        if self.bins % self.intervals:
            raise ValueError(f"intervals={self.intervals} must divide bins={self.bins}")

    @property
    def width(self) -> int:
        return 2 * self.radius + 1


@dataclass
class Examples:
    """Windows as flat entries: the feature, its group (the interval of a sample; 0 for a top window),
    the priority (samples), the activation at the token, the token's corpus index (row · seq + position),
    and the window's token ids and activations [entry width]."""

    feature: Int[Tensor, " entry"]
    group: Int[Tensor, " entry"]
    priority: Int[Tensor, " entry"]
    act: Float[Tensor, " entry"]
    index: Int[Tensor, " entry"]
    tokens: Int[Tensor, "entry width"]
    acts: Float[Tensor, "entry width"]

    @classmethod
    def empty(cls, width: int) -> "Examples":
        long = torch.zeros(0, dtype=torch.long)
        return cls(long, long, long, torch.zeros(0), long, torch.zeros(0, width, dtype=torch.int32),
                   torch.zeros(0, width))

    def take(self, which: Tensor) -> "Examples":
        return Examples(*(getattr(self, f.name)[which] for f in fields(self)))

    @staticmethod
    def cat(parts: list["Examples"]) -> "Examples":
        return Examples(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(Examples)))


@dataclass
class Partial:
    """Every feature's statistics over a stretch of the corpus (see the module docstring)."""

    limits: Limits
    tokens: int
    active: Int[Tensor, " d_sae"]
    act_min: Float[Tensor, " d_sae"]
    act_max: Float[Tensor, " d_sae"]
    exponent: Int[Tensor, " d_sae"]
    histogram: Int[Tensor, "d_sae bins"]
    top: Examples
    samples: Examples

    @classmethod
    def empty(cls, limits: Limits) -> "Partial":
        d = limits.d_sae
        return cls(limits, 0, torch.zeros(d, dtype=torch.long), torch.full((d,), float("inf")),
                   torch.full((d,), float("-inf")), torch.full((d,), NEVER, dtype=torch.long),
                   torch.zeros(d, limits.bins, dtype=torch.long), Examples.empty(limits.width),
                   Examples.empty(limits.width))

    # ------------------------------------------------------------------------- (de)serialising
    def tensors(self, prefix: str = "") -> dict[str, Tensor]:
        """Every tensor, by name (for safetensors); `from_tensors` reads them back."""
        out = {f"{prefix}{name}": getattr(self, name) for name in ("active", "act_min", "act_max", "exponent",
                                                                   "histogram")}
        out[f"{prefix}tokens"] = torch.tensor([self.tokens])
        for kind in ("top", "samples"):
            for f in fields(Examples):
                out[f"{prefix}{kind}.{f.name}"] = getattr(getattr(self, kind), f.name).contiguous()
        return out

    @classmethod
    def from_tensors(cls, limits: Limits, tensors: dict[str, Tensor], prefix: str = "") -> "Partial":
        def examples(kind):
            return Examples(*(tensors[f"{prefix}{kind}.{f.name}"] for f in fields(Examples)))

        return cls(limits, int(tensors[f"{prefix}tokens"][0]),
                   *(tensors[f"{prefix}{name}"] for name in ("active", "act_min", "act_max", "exponent", "histogram")),
                   examples("top"), examples("samples"))


def priority(index: Int[Tensor, " entry"], feature: Int[Tensor, " entry"]) -> Int[Tensor, " entry"]:
    """A deterministic pseudo-random priority in [0, 2^31 - 1) of each (token index, feature)."""
    h = ((index % _P) * _A + feature * _B + _C) % _P
    return (h * _A + _C) % _P


def _ranked(entries: Examples, key: Tensor, group: Tensor, limit: int, in_index_order: bool = False) -> Examples:
    """The first `limit` entries of each `group` value (a prefix of `key`'s order), ordered by `key`, ties to
    the smaller corpus index, the kept entries in that order. `in_index_order`: entries of equal key come
    in increasing index already (a batch's, read row-major), so one stable sort does."""
    if in_index_order:
        order = torch.argsort(key, stable=True)
    else:
        order = torch.argsort(entries.index, stable=True)
        order = order[torch.argsort(key[order], stable=True)]
    g = group[order]
    n = g.numel()
    position = torch.arange(n)
    starts = torch.ones(n, dtype=torch.bool)
    starts[1:] = g[1:] != g[:-1]
    rank = position - torch.where(starts, position, 0).cummax(0).values
    return entries.take(order[rank < limit])


def _select_top(entries: Examples, limits: Limits, in_index_order: bool = False) -> Examples:
    # (feature, -act) in one int64: a positive float32's bits order as the float does
    descending = (2**31 - 1) - entries.act.float().view(torch.int32).long()
    return _ranked(entries, entries.feature * 2**31 + descending, entries.feature, limits.k, in_index_order)


def _select_samples(entries: Examples, limits: Limits, in_index_order: bool = False) -> Examples:
    group = entries.feature * limits.intervals + entries.group
    return _ranked(entries, group * _P + entries.priority, group, limits.per_interval, in_index_order)


def _windows(ids: Int[Tensor, "row seq"], flat: Float[Tensor, "token d_sae"], row: Tensor, pos: Tensor,
             feature: Tensor, radius: int) -> tuple[Tensor, Tensor]:
    """Each entry's window: token ids and the feature's activations at pos - radius ... pos + radius,
    token -1 and activation 0 outside the row (`flat` the batch's activations, row-major)."""
    seq, d = ids.shape[1], flat.shape[1]
    at = pos[:, None] + torch.arange(-radius, radius + 1)[None, :]
    inside = (at >= 0) & (at < seq)
    token = row[:, None] * seq + at.clamp(0, seq - 1)
    # one flat gather each (cheaper than indexing by three index tensors)
    tokens = torch.where(inside, ids.reshape(-1).take(token).to(torch.int32), -1)
    values = torch.where(inside, flat.reshape(-1).take(token * d + feature[:, None]), 0.0)
    return tokens, values


def _scaled_index(values: Tensor, exponent: Tensor, slots: int) -> Tensor:
    """floor(value · slots / 2^exponent): the bin of [0, 2^exponent) split in `slots` (exact: powers of two)."""
    shift = (slots.bit_length() - 1) - exponent
    # in float64: 2^shift and the product are exact there for any float32 value and exponent
    return torch.ldexp(values.double(), shift.double()).floor().long().clamp(0, slots - 1)


@torch.no_grad()
def of_batch(acts: Float[Tensor, "row seq d_sae"], ids: Int[Tensor, "row seq"], first_row: int,
             limits: Limits) -> Partial:
    """The statistics of one batch of corpus rows (the first one being row `first_row` of the corpus)."""
    acts = acts.float().cpu()
    ids = ids.cpu()
    rows, seq, d = acts.shape
    part = Partial.empty(limits)
    part.tokens = rows * seq
    if acts.numel() == 0:
        return part
    flat = acts.reshape(-1, d)
    # Everything from the nonzero entries alone (a TopK's few per token): one pass over the dense batch.
    token, feature = flat.nonzero(as_tuple=True)
    value = flat.reshape(-1).take(token * d + feature)
    # min and max exact from the nonzero ones, and 0 where a feature was zero somewhere
    some_zero = torch.bincount(feature, minlength=d) < rows * seq
    part.act_min = torch.full((d,), float("inf")).scatter_reduce_(0, feature, value, "amin")
    part.act_max = torch.full((d,), float("-inf")).scatter_reduce_(0, feature, value, "amax")
    part.act_min = torch.where(some_zero, part.act_min.clamp(max=0.0), part.act_min)
    part.act_max = torch.where(some_zero, part.act_max.clamp(min=0.0), part.act_max)
    fired = part.act_max > 0
    # max = m·2^e with m in [0.5, 1): every activation lies in [0, 2^e)
    part.exponent = torch.where(fired, torch.frexp(part.act_max).exponent.long(), NEVER)
    positive = value > 0
    token, feature, value = token[positive], feature[positive], value[positive]
    part.active = torch.bincount(feature, minlength=d)
    exponent = part.exponent[feature]
    bins = _scaled_index(value, exponent, limits.bins)
    part.histogram = torch.bincount(feature * limits.bins + bins, minlength=d * limits.bins).reshape(d, limits.bins)
    index = first_row * seq + token
    # a sample per interval: the smallest priorities of each (feature, interval)
    entries = _unwindowed(feature, _scaled_index(value, exponent, limits.intervals), priority(index, feature), value,
                          index)
    kept = _select_samples(entries, limits, in_index_order=True)  # nonzero() reads row-major
    part.samples = Examples(kept.feature, kept.group, kept.priority, kept.act, kept.index,
                            *_windows(ids, flat, kept.index // seq - first_row, kept.index % seq, kept.feature, limits.radius))
    # the top windows: one per row, at the row's peak (its first position on a tie), from the positive entries
    cell = (token // seq) * d + feature
    peak = torch.zeros(rows * d).scatter_reduce_(0, cell, value, "amax")
    at_peak = value == peak[cell]
    where = torch.full((rows * d,), seq).scatter_reduce_(0, cell[at_peak], token[at_peak] % seq, "amin")
    cell = (peak > 0).nonzero(as_tuple=True)[0]
    row, feature = cell // d, cell % d
    index = (first_row + row) * seq + where[cell]
    entries = _unwindowed(feature, torch.zeros_like(feature), torch.zeros_like(feature), peak[cell], index)
    kept = _select_top(entries, limits, in_index_order=True)  # a feature's cells in row order
    part.top = Examples(kept.feature, kept.group, kept.priority, kept.act, kept.index,
                        *_windows(ids, flat, kept.index // seq - first_row, kept.index % seq, kept.feature, limits.radius))
    return part


def _unwindowed(feature: Tensor, group: Tensor, priority: Tensor, act: Tensor, index: Tensor) -> Examples:
    """Candidate entries whose windows are gathered only once they are selected (zero-width for now)."""
    n = feature.numel()
    return Examples(feature, group, priority, act, index, torch.zeros(n, 0, dtype=torch.int32), torch.zeros(n, 0))


def _coarsened(part: Partial, exponent: Tensor) -> tuple[Tensor, Examples]:
    """`part`'s histogram and samples re-binned to the (larger or equal) exponents `exponent`."""
    limits = part.limits
    shift = (exponent - part.exponent).clamp(0, 62)
    target = torch.arange(limits.bins)[None, :] >> shift[:, None]
    histogram = torch.zeros_like(part.histogram).scatter_add_(1, target, part.histogram)
    s = part.samples
    return histogram, Examples(s.feature, s.group >> shift[s.feature], s.priority, s.act, s.index, s.tokens, s.acts)


def merge(a: Partial, b: Partial) -> Partial:
    """The statistics of the two stretches together: the same whatever the order or the cut."""
    return merge_all([a, b])


def merge_all(parts: list[Partial]) -> Partial:
    """The statistics of all the stretches together (one selection for all: cheaper than merging in pairs)."""
    limits = parts[0].limits
    for part in parts[1:]:
        if part.limits != limits:
            raise ValueError(f"partial statistics of different limits cannot merge: {limits} and {part.limits}")
    exponent = parts[0].exponent
    for part in parts[1:]:
        exponent = torch.maximum(exponent, part.exponent)
    coarse = [_coarsened(part, exponent) for part in parts]
    act_min, act_max = parts[0].act_min, parts[0].act_max
    for part in parts[1:]:
        act_min, act_max = torch.minimum(act_min, part.act_min), torch.maximum(act_max, part.act_max)
    return Partial(limits, sum(p.tokens for p in parts), sum(p.active for p in parts), act_min, act_max, exponent,
                   sum(h for h, _ in coarse), _select_top(Examples.cat([p.top for p in parts]), limits),
                   _select_samples(Examples.cat([s for _, s in coarse]), limits))
