"""Neuronpedia's bulk-import layout, as SAEDashboard's `neuronpedia_export` writes it.

    {exports_dir}/{model_id}/{layer}-{source_set}/
        release.jsonl  model.jsonl  sourceset.jsonl  source.jsonl
        features/batch-0.jsonl.gz  activations/batch-0.jsonl.gz

One directory per layer (Neuronpedia's "source"), each record with the fields of the dataclasses in
`sae_dashboard/neuronpedia/neuronpedia_export.py` (SourceRelease, Model, SourceSet, Source, Feature,
Activation), in their order, one JSON object per line, dates in ISO format. SAEDashboard cannot be installed
beside this package's pins (it requires older torch, transformers and TransformerLens), so the layout is
transcribed from its source and checked field by field in the tests.

What a statistics result fills: a feature's `pos_str`/`pos_values` and `neg_str`/`neg_values` (its top and
bottom logits), `frac_nonzero`, `freq_hist_data_bar_heights`/`_values` (the histogram's counts and its bins'
centres), `maxActApprox`; an activation per top window (binMin -1, binMax the largest activation, binContains
-1, as SAEDashboard marks its top group) and per sampled window (its interval, and the share of the
feature's active tokens in it). What it does not compute stays as SAEDashboard's empty default: logit
histograms, correlated features and neurons, decoder weight distributions.
"""

import gzip
import json
import os
from datetime import datetime
from pathlib import Path

from hooked_models.features.results import FeatureStatistics, LayerStatistics, Window

# The creator id SAEDashboard's exporter falls back to (`FALLBACK_CREATOR_ID`).
CREATOR_ID = "clkht01d40000jv08hvalcvly"


def _jsonl(path: Path, rows: list[dict], compress: bool = False) -> None:
    data = b"".join(json.dumps(row, default=_iso).encode() + b"\n" for row in rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    if compress:
        path = path.with_name(path.name + ".gz")
        data = gzip.compress(data, compresslevel=5, mtime=0)
    path.write_bytes(data)


def _iso(value):
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON")


def _activation(window: Window, layer_id: str, model_id: str, feature: int, creator_id: str, created: datetime,
                aid: str, bin_min, bin_max, bin_contains) -> dict:
    values = window.activations
    peak = max(values)
    return {"id": aid, "tokens": window.tokens, "index": feature, "layer": layer_id, "modelId": model_id,
            "maxValue": peak, "maxValueTokenIndex": values.index(peak), "minValue": min(values), "values": values,
            "creatorId": creator_id, "dataSource": None, "dataIndex": None, "dfaValues": [], "dfaTargetIndex": None,
            "dfaMaxValue": None, "createdAt": created, "lossValues": [], "logitContributions": None,
            "binMin": bin_min, "binMax": bin_max, "binContains": bin_contains,
            "qualifyingTokenIndex": window.position - window.start, "zIndices": None, "zValues": None}


def _feature(layer: LayerStatistics, feature: int, layer_id: str, model_id: str, creator_id: str,
             created: datetime) -> dict:
    counts, edges = layer.histogram(feature)
    strings = layer.token_strings
    name = lambda ids: [strings.get(int(t), str(int(t))) for t in ids]  # noqa: E731
    return {"modelId": model_id, "layer": layer_id, "index": feature, "creatorId": creator_id, "createdAt": created,
            "maxActApprox": max(float(layer.partial.act_max[feature]), 0.0), "hasVector": False, "vector": [],
            "vectorLabel": None, "vectorDefaultSteerStrength": 10, "hookName": None, "topkCosSimIndices": [],
            "topkCosSimValues": [], "neuron_alignment_indices": [], "neuron_alignment_values": [],
            "neuron_alignment_l1": [], "correlated_neurons_indices": [], "correlated_neurons_pearson": [],
            "correlated_neurons_l1": [], "correlated_features_indices": [], "correlated_features_pearson": [],
            "correlated_features_l1": [], "neg_str": name(layer.bottom_logits[feature].tolist()),
            "neg_values": layer.bottom_values[feature].tolist(), "pos_str": name(layer.top_logits[feature].tolist()),
            "pos_values": layer.top_values[feature].tolist(), "frac_nonzero": float(layer.frequency()[feature]),
            "freq_hist_data_bar_heights": [float(c) for c in counts],
            "freq_hist_data_bar_values": [(a + b) / 2 for a, b in zip(edges, edges[1:])],
            "logits_hist_data_bar_heights": [], "logits_hist_data_bar_values": [], "decoder_weights_dist": [],
            "sourceSetName": None}


def write_neuronpedia(stats: FeatureStatistics, exports_dir: str | os.PathLike, model_id: str, source_set: str, *,
                      description: str = "", creator_name: str = "hooked_models", creator_id: str = CREATOR_ID,
                      release_id: str | None = None, dataset: str | None = None,
                      created: datetime | None = None) -> list[Path]:
    """Each layer of `stats` as a Neuronpedia source under `exports_dir/model_id/`; returns their directories."""
    created = created or datetime.now()
    release_id = release_id or source_set
    written = []
    for layer in stats.layers:
        number = 0 if layer.layer is None else layer.layer
        layer_id = f"{number}-{source_set}"
        out = Path(exports_dir) / model_id / layer_id
        _jsonl(out / "release.jsonl", [{
            "name": release_id, "description": description, "creatorName": creator_name, "creatorId": creator_id,
            "visibility": "PUBLIC", "isNewUi": False, "featured": False, "descriptionShort": description, "urls": [],
            "creatorEmail": None, "creatorNameShort": creator_name, "defaultSourceSetName": None,
            "defaultSourceId": None, "defaultUmapSourceIds": [], "createdAt": created}])
        _jsonl(out / "model.jsonl", [{
            "id": model_id, "instruct": model_id.endswith("-it"), "creatorId": creator_id,
            "displayNameShort": model_id, "displayName": model_id, "tlensId": None, "dimension": None,
            "visibility": "PUBLIC", "defaultSourceSetName": None, "defaultSourceId": None, "inferenceEnabled": False,
            "layers": 0, "neuronsPerLayer": 0, "createdAt": created, "owner": "", "updatedAt": created,
            "website": None}])
        _jsonl(out / "sourceset.jsonl", [{
            "modelId": model_id, "name": source_set, "creatorId": creator_id, "hasDashboards": True,
            "visibility": "PUBLIC", "description": description, "type": "", "creatorName": creator_name, "urls": [],
            "creatorEmail": None, "releaseName": release_id, "defaultOfModelId": None, "defaultRange": 1,
            "defaultShowBreaks": True, "showDfa": False, "showCorrelated": False, "showHeadAttribution": False,
            "showUmap": False, "createdAt": created}])
        _jsonl(out / "source.jsonl", [{
            "id": layer_id, "modelId": model_id, "setName": source_set, "creatorId": creator_id,
            "hasDashboards": True, "inferenceEnabled": False, "inferenceHosts": [], "saelensConfig": None,
            "saelensRelease": None, "saelensSaeId": None, "hfRepoId": None, "hfFolderId": None,
            "visibility": "PUBLIC", "defaultOfModelId": None, "hasUmap": False, "hasUmapLogSparsity": False,
            "hasUmapClusters": False, "num_prompts": stats.rows, "num_tokens_in_prompt": stats.context_size,
            "dataset": dataset, "notes": None, "createdAt": created}])
        feature_rows, activation_rows = [], []
        for f in range(layer.d_sae):
            feature_rows.append(_feature(layer, f, layer_id, model_id, creator_id, created))
            top = layer.top_windows(f)
            for w in top:
                aid = f"{layer_id}-{f}-top-{len(activation_rows)}"
                activation_rows.append(_activation(w, layer_id, model_id, f, creator_id, created, aid, -1,
                                                   float(layer.partial.act_max[f]), -1))
            active = max(int(layer.partial.active[f]), 1)
            counts, _ = layer.histogram(f)
            per = len(counts) // layer.partial.limits.intervals
            for low, high, windows in layer.interval_windows(f):
                g = round(low / (high - low))
                share = sum(counts[g * per:(g + 1) * per]) / active
                for w in windows:
                    aid = f"{layer_id}-{f}-interval-{len(activation_rows)}"
                    activation_rows.append(_activation(w, layer_id, model_id, f, creator_id, created, aid, low, high,
                                                       share))
        _jsonl(out / "features" / "batch-0.jsonl", feature_rows, compress=True)
        _jsonl(out / "activations" / "batch-0.jsonl", activation_rows, compress=True)
        written.append(out)
    return written
