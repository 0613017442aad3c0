"""alpha-er as transformers classes, registered with AutoConfig and AutoModelForCausalLM on import.

    import hooked_models.alpha_er_transformers  # or use any of its names
    model = AutoModelForCausalLM.from_pretrained("path/to/alpha-er-hf")

The two modules import nothing of hooked_models (torch and transformers only): `save_pretrained`
writes them beside the weights as remote code. The converters to and from the reference's checkpoint
and HookedAlphaEr are in weight_conversion/alpha_er_transformers.py. (`import hooked_models` alone
registers nothing: it imports neither torch nor transformers until a name is used.)
"""

from transformers import AutoConfig, AutoModelForCausalLM

from .configuration_alpha_er import AlphaErConfig
from .modeling_alpha_er import AlphaErForCausalLM, AlphaErModel, AlphaErPreTrainedModel

AutoConfig.register(AlphaErConfig.model_type, AlphaErConfig, exist_ok=True)
AutoModelForCausalLM.register(AlphaErConfig, AlphaErForCausalLM, exist_ok=True)

__all__ = ["AlphaErConfig", "AlphaErForCausalLM", "AlphaErModel", "AlphaErPreTrainedModel"]
