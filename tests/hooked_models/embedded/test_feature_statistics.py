"""The shipped feature statistics are what `python -m hooked_models.embedded.feature_statistics` computes
now (one CPU thread, as it runs), and small.

Bit for bit on a CPU of the kind that wrote them; across kinds (AVX2 and AVX-512 kernels sum in other orders)
the activations differ in their last bits, so: every integer (token ids, positions, counts) exactly, every
activation within 1e-6 of its tensor's largest (3.0e-7 seen between an AMD EPYC and an Intel Xeon), and a
histogram's counts equal but for the values that rounding moved across a bin edge (one, seen)."""

import pytest
import torch

from hooked_models import features
from hooked_models.embedded import EMBEDDED_DIR
from hooked_models.embedded.feature_statistics import statistics_of


def same_statistics(name: str, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two of a layer's statistics tensors agree as a recomputation on another CPU must."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if name == "histogram":  # [feature bin]: the same counts per feature, a few moved to a neighbouring bin
        moved = (a.cumsum(-1) - b.cumsum(-1)).abs()
        return (torch.equal(a.sum(-1), b.sum(-1)) and bool(moved.max() <= 2)
                and int((a != b).sum()) <= max(4, a.numel() // 1000))
    if a.is_floating_point():
        return bool((a - b).abs().max() <= 1e-6 * max(float(a.abs().max()), 1e-30)) if a.numel() else True
    return torch.equal(a, b)


@pytest.mark.parametrize("family", ["arcee", "alpha_er"])
def test_the_shipped_statistics_are_recomputed(family):
    path = EMBEDDED_DIR / family / "feature_statistics"
    shipped = features.FeatureStatistics.load(path)
    assert sum(p.stat().st_size for p in path.iterdir()) < 2 * 2**20
    torch.set_num_threads(1)
    fresh = statistics_of(family, progress=False)
    assert shipped.job == fresh.job and shipped.token_strings == fresh.token_strings
    assert len(shipped.layers) == len(fresh.layers)
    for mine, theirs in zip(shipped.layers, fresh.layers):
        ours, recomputed = mine.partial.tensors(), theirs.partial.tensors()
        assert list(ours) == list(recomputed)
        for name, a in ours.items():
            assert same_statistics(name, a, recomputed[name]), name
        assert torch.equal(mine.top_logits, theirs.top_logits)


def test_the_comparison_sees_a_change_beyond_rounding():
    acts = torch.tensor([1.0, 2.0, 4.0])
    assert same_statistics("top.act", acts, acts + torch.tensor([0.0, 0.0, 3e-6]))  # 7.5e-7 of 4
    assert not same_statistics("top.act", acts, acts + torch.tensor([0.0, 0.0, 5e-6]))
    assert not same_statistics("top.tokens", torch.tensor([3, 4]), torch.tensor([3, 5]))
    counts = torch.tensor([[5, 3, 0, 2]] * 8)
    one_moved = counts.clone()
    one_moved[0, :2] = torch.tensor([4, 4])
    assert same_statistics("histogram", counts, one_moved)
    shifted = counts.roll(1, -1)  # every feature's values one bin up: binning changed
    assert not same_statistics("histogram", counts, shifted)
    lost = counts.clone()
    lost[0, 0] = 4  # a value dropped
    assert not same_statistics("histogram", counts, lost)
