"""Features people can read: what SAE and transcoder features do over a corpus.

    from hooked_models import features
    board = features.dashboard(model, "out/acts", sae, feature=3)     # top windows, histogram, logit effects
    features.search_by_token(model, "out/acts", sae, " Mary", k=10)   # the features that fire on a token

One module per concern, each importing only those listed before it (the contract in pyproject.toml):
`reading` (a harvest's column for an SAE, a batch at a time) and `dashboards` (one feature at a time).
"""

from hooked_models.features.dashboards import Dashboard, Window, dashboard, logit_effects, search_by_token
from hooked_models.features.reading import check_feature

__all__ = ["Dashboard", "Window", "check_feature", "dashboard", "logit_effects", "search_by_token"]
