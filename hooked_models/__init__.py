"""Hooked, TransformerLens-style ports of Arcee AFM-4.5B and alpha-er.

    from hooked_models import HookedArcee
    model = HookedArcee.from_pretrained("path/to/AFM-4.5B")
    logits, cache = model.run_with_cache(tokens)
    cache["layers.3.self_attn.attention_probabilities"]   # or cache["blocks.3.attn.hook_pattern"]

The public names are imported on first use (PEP 562), so `python -m hooked_models --help` and a
module that needs only the vocabulary do not import torch and TransformerLens.
"""

import importlib
from typing import TYPE_CHECKING

# Each public name and the module that defines it.
_PUBLIC = {
    "HookedActivationCache": "hooked_models.cache",
    "ALPHA_ER": "hooked_models.families.alpha_er",
    "AlphaErConfig": "hooked_models.families.alpha_er",
    "AlphaErForCausalLM": "hooked_models.alpha_er_transformers",
    "HookedAlphaEr": "hooked_models.families.alpha_er",
    "AFM_4_5B": "hooked_models.families.arcee",
    "AFM_4_5B_PRE_ANNEAL": "hooked_models.families.arcee",
    "ArceeConfig": "hooked_models.families.arcee",
    "HookedArcee": "hooked_models.families.arcee",
    "HookedModel": "hooked_models.model",
    "STANDARD_VALUES": "hooked_models.vocabulary",
    "VALUES": "hooked_models.vocabulary",
    "Value": "hooked_models.vocabulary",
}
__all__ = sorted(_PUBLIC)

if TYPE_CHECKING:
    from hooked_models.alpha_er_transformers import AlphaErForCausalLM
    from hooked_models.cache import HookedActivationCache
    from hooked_models.families.alpha_er import ALPHA_ER, AlphaErConfig, HookedAlphaEr
    from hooked_models.families.arcee import AFM_4_5B, AFM_4_5B_PRE_ANNEAL, ArceeConfig, HookedArcee
    from hooked_models.model import HookedModel
    from hooked_models.vocabulary import STANDARD_VALUES, VALUES, Value


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'hooked_models' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
