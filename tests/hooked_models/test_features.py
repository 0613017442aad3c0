"""features.py against an independent computation: the SAE applied to every harvested row at once (read with
numpy from the dataset's Arrow files, not through features.py's batches), its statistics taken directly."""

import numpy as np
import pytest
import torch

from hooked_models import features

# The explorer tests' data (a harvest of the embedded Arcee, a random SAE), shared by importing its fixtures.
from .explorer.conftest import ReluSAE, alpha_er, arcee, data_dir, real_graph, sae, transcoders  # noqa: F401


def _everything(data_dir, sae, column="layers.1.layer_output"):
    """(token ids [window seq], the SAE's features [window seq d_sae]) over the whole harvest."""
    import datasets

    harvest = datasets.load_from_disk(str(data_dir / "acts")).with_format("numpy")
    acts = torch.from_numpy(np.stack(harvest[column]))
    with torch.no_grad():
        return torch.from_numpy(np.stack(harvest["token_ids"])).long(), sae.encode(acts)


@pytest.mark.parametrize("feature", [0, 5, 31])
def test_dashboard_equals_a_direct_computation(arcee, data_dir, sae, feature):
    ids, acts = _everything(data_dir, sae)
    f = acts[..., feature]
    board = features.dashboard(arcee, data_dir / "acts", sae, feature, top_k=4, radius=3, bins=10, batch_size=7)
    assert board.tokens == f.numel() == 64 * 16 and board.name == "layers.1.layer_output"
    assert board.density == pytest.approx(float((f > 0).float().mean()), abs=0)
    # batches of 7 windows there, all 64 here: equal on this CPU, within an ulp wherever matmul blocks otherwise
    assert board.max_activation == pytest.approx(float(f.max()), rel=1e-6)
    assert board.mean_active == pytest.approx(float(f[f > 0].mean()), rel=1e-6)
    assert board.counts == torch.histc(f[f > 0], bins=10, min=0, max=float(f.max())).int().tolist()
    assert sum(board.counts) == int((f > 0).sum())
    peaks, where = f.max(1)
    assert [w.row for w in board.windows] == peaks.argsort(descending=True, stable=True)[:4].tolist()
    for w in board.windows:
        assert w.position == int(where[w.row]) and w.peak == pytest.approx(float(peaks[w.row]), rel=1e-6)
        assert w.activations == pytest.approx(f[w.row, w.start:w.start + len(w.tokens)].tolist(), rel=1e-6)
        assert w.tokens == arcee.to_str_tokens(ids[w.row, w.start:w.start + len(w.tokens)])
        # the window is pinned to its exact extent: 3 tokens either side of the peak, cut at the row's ends
        assert w.start == max(0, w.position - 3) and len(w.tokens) == min(16, w.position + 4) - w.start
    logits = sae.W_dec[feature].detach() @ arcee.W_U
    assert [v for _, v in board.promoted] == logits.topk(10).values.tolist()
    assert [t for t, _ in board.suppressed] == arcee.to_str_tokens(logits.topk(10, largest=False).indices)


def test_dashboard_of_a_transcoder_on_alpha_er_logits_through_the_factored_head(alpha_er):
    # alpha-er's unembedding is a FactoredMatrix: the logit effects go through its factors
    direction = torch.randn(64, generator=torch.Generator().manual_seed(3))
    sae = ReluSAE(64, 4, "layers.0.layer_output")
    with torch.no_grad():
        sae.W_dec[2] = direction
    up, down, note = features.logit_effects(alpha_er, sae, 2, k=5)
    expected = direction @ alpha_er.W_U.AB
    assert note == "" and [t for t, _ in up] == alpha_er.to_str_tokens(expected.topk(5).indices)
    assert [v for _, v in down] == pytest.approx(expected.topk(5, largest=False).values.tolist(), rel=1e-5)


def test_search_by_token_equals_a_direct_computation(arcee, data_dir, sae):
    ids, acts = _everything(data_dir, sae)
    mary = arcee.to_single_token(" Mary")
    at = acts[ids == mary]  # [occurrence d_sae]
    found = features.search_by_token(arcee, data_dir / "acts", sae, " Mary", k=5, batch_size=5)
    mean = at.double().mean(0).float()
    assert [f["feature"] for f in found] == mean.argsort(descending=True, stable=True)[:5].tolist()
    for f in found:
        assert f["mean"] == pytest.approx(float(mean[f["feature"]]), rel=1e-6)
        # the SAE ran on these rows alone here, on whole windows there: matmul blocking differs by an ulp
        assert f["max"] == pytest.approx(float(at[:, f["feature"]].max()), rel=1e-6)
        assert f["occurrences"] == at.shape[0] > 0


def test_bad_input_is_a_clear_error(arcee, data_dir, sae, tmp_path):
    with pytest.raises(ValueError, match=r"feature=32 is outside \[0, 31\]: the SAE has 32 features"):
        features.dashboard(arcee, data_dir / "acts", sae, 32)
    with pytest.raises(ValueError, match="is not a harvest"):
        features.dashboard(arcee, tmp_path, sae, 0)
    with pytest.raises(ValueError, match="the harvest has no column 'layers.0.layer_output'"):
        features.dashboard(arcee, data_dir / "acts", ReluSAE(64, 4, "blocks.0.hook_resid_post"), 0)
    with pytest.raises(ValueError, match="never occurs in the harvest"):
        features.search_by_token(arcee, data_dir / "acts", sae, "<unk>")
    with pytest.raises(ValueError, match="names no hook"):
        features.dashboard(arcee, data_dir / "acts", ReluSAE(64, 4, None), 0)
    wide = ReluSAE(64, 4, "layers.1.layer_output")
    wide.W_dec = torch.nn.Parameter(torch.randn(4, 32))
    assert "not the residual stream's 64" in features.logit_effects(arcee, wide, 0)[2]
