"""Hooked, TransformerLens-style ports of Arcee AFM-4.5B and alpha-er.

    from hooked_models import HookedArcee
    model = HookedArcee.from_pretrained("path/to/AFM-4.5B")
    logits, cache = model.run_with_cache(tokens)
    cache["layers.3.self_attn.attention_probabilities"]   # or cache["blocks.3.attn.hook_pattern"]
"""

from hooked_models.cache import HookedActivationCache
from hooked_models.families.alpha_er import ALPHA_ER, AlphaErConfig, HookedAlphaEr
from hooked_models.families.arcee import AFM_4_5B, AFM_4_5B_PRE_ANNEAL, ArceeConfig, HookedArcee
from hooked_models.model import HookedModel
from hooked_models.vocabulary import STANDARD_VALUES, VALUES, Value

__all__ = [
    "AFM_4_5B",
    "AFM_4_5B_PRE_ANNEAL",
    "ALPHA_ER",
    "AlphaErConfig",
    "ArceeConfig",
    "HookedActivationCache",
    "HookedAlphaEr",
    "HookedArcee",
    "HookedModel",
    "STANDARD_VALUES",
    "VALUES",
    "Value",
]
