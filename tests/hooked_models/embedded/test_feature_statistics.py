"""The shipped feature statistics are what `python -m hooked_models.embedded.feature_statistics` computes
now, bit for bit (one CPU thread, as it runs), and small."""

import pytest
import torch

from hooked_models import features
from hooked_models.embedded import EMBEDDED_DIR
from hooked_models.embedded.feature_statistics import statistics_of


@pytest.mark.parametrize("family", ["arcee", "alpha_er"])
def test_the_shipped_statistics_are_recomputed_bit_for_bit(family):
    path = EMBEDDED_DIR / family / "feature_statistics"
    shipped = features.FeatureStatistics.load(path)
    assert sum(p.stat().st_size for p in path.iterdir()) < 2 * 2**20
    torch.set_num_threads(1)
    fresh = statistics_of(family, progress=False)
    assert shipped.job == fresh.job and shipped.token_strings == fresh.token_strings
    for mine, theirs in zip(shipped.layers, fresh.layers):
        for (name, a), b in zip(mine.partial.tensors().items(), theirs.partial.tensors().values()):
            assert torch.equal(a, b), name
        assert torch.equal(mine.top_logits, theirs.top_logits)
