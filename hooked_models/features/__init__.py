"""Features people can read: what SAE and transcoder features do over a corpus.

    from hooked_models import features
    stats = features.statistics("out/acts", transcoders, model=model)   # every feature, one pass
    stats[1].top_windows(37), stats[1].interval_windows(37)            # layer 1, feature 37
    board = features.dashboard(model, "out/acts", sae, feature=3)     # one feature: top windows, histogram
    features.search_by_token(model, "out/acts", sae, " Mary", k=10)   # the features that fire on a token
    graph.to_json("graphs/ioi.json", features=stats)                  # circuit-tracer's viewer, labelled
    features.write_neuronpedia(stats, "exports", "my-model", "tc")    # Neuronpedia's bulk layout
"""

# For developers, the package's layout: one module per concern, each importing only those listed before it (the
# contract in pyproject.toml): `reading` (a harvest's column for an SAE, a batch at a time) and `partial` (partial
# statistics and the one reducer that merges them exactly); `results` (a statistics result, saved and loaded);
# `statistics` (the one pass, local or Ray) and `dashboards` (one feature at a time); `labels` and `exporters`
# (circuit-tracer's feature files, Neuronpedia's bulk layout), plain readers and writers of one result.

from hooked_models.features.circuit_tracer_files import write_feature_files
from hooked_models.features.dashboards import Dashboard, dashboard, logit_effects, search_by_token
from hooked_models.features.labels import heuristic_label, labels
from hooked_models.features.neuronpedia import write_neuronpedia
from hooked_models.features.partial import Limits, Partial, merge
from hooked_models.features.reading import check_feature
from hooked_models.features.results import FeatureStatistics, LayerStatistics, Window
from hooked_models.features.statistics import statistics

__all__ = ["Dashboard", "FeatureStatistics", "LayerStatistics", "Limits", "Partial", "Window", "check_feature",
           "dashboard", "heuristic_label", "labels", "logit_effects", "merge", "search_by_token", "statistics",
           "write_feature_files", "write_neuronpedia"]
