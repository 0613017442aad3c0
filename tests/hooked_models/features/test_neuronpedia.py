"""Neuronpedia's bulk layout against SAEDashboard's exporter, field by field: SAEDashboard cannot be installed
beside this package's pins, so the fields of each record are transcribed here from the dataclasses of
`sae_dashboard/neuronpedia/neuronpedia_export.py` (jbloomAus/SAEDashboard), in their order, and the values
are checked against the statistics they come from."""

import gzip
import json
from datetime import datetime

import pytest

from hooked_models import features
from hooked_models.features.neuronpedia import write_neuronpedia

from ..explorer.conftest import ReluSAE, alpha_er, arcee, data_dir, real_graph, sae, transcoders  # noqa: F401

FIELDS = {  # transcribed from SAEDashboard's neuronpedia_export.py
    "activations": "id tokens index layer modelId maxValue maxValueTokenIndex minValue values creatorId dataSource "
                   "dataIndex dfaValues dfaTargetIndex dfaMaxValue createdAt lossValues logitContributions binMin "
                   "binMax binContains qualifyingTokenIndex zIndices zValues",
    "features": "modelId layer index creatorId createdAt maxActApprox hasVector vector vectorLabel "
                "vectorDefaultSteerStrength hookName topkCosSimIndices topkCosSimValues neuron_alignment_indices "
                "neuron_alignment_values neuron_alignment_l1 correlated_neurons_indices correlated_neurons_pearson "
                "correlated_neurons_l1 correlated_features_indices correlated_features_pearson correlated_features_l1 "
                "neg_str neg_values pos_str pos_values frac_nonzero freq_hist_data_bar_heights "
                "freq_hist_data_bar_values logits_hist_data_bar_heights logits_hist_data_bar_values "
                "decoder_weights_dist sourceSetName",
    "model": "id instruct creatorId displayNameShort displayName tlensId dimension visibility defaultSourceSetName "
             "defaultSourceId inferenceEnabled layers neuronsPerLayer createdAt owner updatedAt website",
    "source": "id modelId setName creatorId hasDashboards inferenceEnabled inferenceHosts saelensConfig "
              "saelensRelease saelensSaeId hfRepoId hfFolderId visibility defaultOfModelId hasUmap hasUmapLogSparsity "
              "hasUmapClusters num_prompts num_tokens_in_prompt dataset notes createdAt",
    "release": "name description creatorName creatorId visibility isNewUi featured descriptionShort urls creatorEmail "
               "creatorNameShort defaultSourceSetName defaultSourceId defaultUmapSourceIds createdAt",
    "sourceset": "modelId name creatorId hasDashboards visibility description type creatorName urls creatorEmail "
                 "releaseName defaultOfModelId defaultRange defaultShowBreaks showDfa showCorrelated "
                 "showHeadAttribution showUmap createdAt",
}


def activations(data_dir, source, layer, layered):
    """The feature activations [row seq d_sae] the statistics saw: the harvest's column through the SAE
    (or layer's transcoder), in the statistics' batches of 32 rows (so the same floats)."""
    import datasets
    import numpy as np
    import torch

    column = f"layers.{layer}.mlp_input" if layered else "layers.1.layer_output"
    x = torch.from_numpy(np.stack(datasets.load_from_disk(str(data_dir / "acts")).with_format("numpy")[column]))
    encode = (lambda v: source.encode(layer, v)) if layered else source.encode
    with torch.no_grad():
        return torch.cat([encode(x[i:i + 32]).float() for i in range(0, len(x), 32)])


def rows(path):
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return [json.loads(line) for line in data.splitlines()]


@pytest.mark.parametrize("layered", [False, True])
def test_the_layout_is_saedashboards_field_by_field(arcee, data_dir, sae, transcoders, tmp_path, layered):
    source = transcoders if layered else sae
    stats = features.statistics(data_dir / "acts", source, model=arcee, k=3, radius=2, progress=False)
    when = datetime(2026, 1, 2, 3, 4, 5, 6)
    dirs = write_neuronpedia(stats, tmp_path, "hooked-arcee", "tc" if layered else "res-sae", created=when)
    assert [d.relative_to(tmp_path).as_posix() for d in dirs] == (
        ["hooked-arcee/0-tc", "hooked-arcee/1-tc"] if layered else ["hooked-arcee/1-res-sae"])
    for d, layer in zip(dirs, stats.layers):
        decoder = (source[layer.layer] if layered else source).W_dec.detach()
        logits = decoder @ arcee.W_U  # [d_sae vocab]: what each feature writes, through the unembedding
        fired = activations(data_dir, source, layer.layer, layered)
        files = sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())
        assert files == ["activations/batch-0.jsonl.gz", "features/batch-0.jsonl.gz", "model.jsonl", "release.jsonl",
                         "source.jsonl", "sourceset.jsonl"]
        for kind in ("model", "source", "release", "sourceset"):
            (row,) = rows(d / f"{kind}.jsonl")
            assert list(row) == FIELDS[kind].split() and row["createdAt"] == when.isoformat()
        feats, acts = rows(d / "features/batch-0.jsonl.gz"), rows(d / "activations/batch-0.jsonl.gz")
        assert [list(f) for f in feats] == [FIELDS["features"].split()] * layer.d_sae
        assert all(list(a) == FIELDS["activations"].split() for a in acts)
        for f, row in enumerate(feats):
            assert row["index"] == f and row["layer"] == d.name
            assert row["pos_str"] == arcee.to_str_tokens(layer.top_logits[f]) and len(row["neg_values"]) == 10
            # the top and bottom logits' values: the largest and the smallest, each on its side
            assert row["pos_values"] == pytest.approx(logits[f].topk(10).values.tolist(), rel=1e-5, abs=1e-6)
            assert row["neg_values"] == pytest.approx(logits[f].topk(10, largest=False).values.tolist(),
                                                      rel=1e-5, abs=1e-6)
            assert row["frac_nonzero"] == int(layer.partial.active[f]) / layer.partial.tokens
            assert sum(row["freq_hist_data_bar_heights"]) == int(layer.partial.active[f])
            mine = [a for a in acts if a["index"] == f]
            top = [a for a in mine if a["binMin"] == -1]
            assert [a["tokens"] for a in top] == [w.tokens for w in layer.top_windows(f)]
            assert row["maxActApprox"] == max([a["maxValue"] for a in top], default=0.0)
            sampled = sum(len(ws) for _, _, ws in layer.interval_windows(f))
            assert len(mine) - len(top) == sampled
            for a in mine:
                assert a["values"][a["qualifyingTokenIndex"]] > 0 and a["maxValue"] == max(a["values"])
            # a sampled window's binContains: the share of the feature's active tokens in its interval
            a_f = fired[..., f]
            for a in mine:
                if a["binMin"] != -1:
                    inside = int(((a_f > 0) & (a_f >= a["binMin"]) & (a_f < a["binMax"])).sum())
                    assert a["binContains"] == inside / int((a_f > 0).sum()), (f, a["binMin"])
            assert any(0 < a["binContains"] < 1 for a in mine if a["binMin"] != -1) or not sampled
