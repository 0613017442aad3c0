"""An ActivationCache that answers to standard and TransformerLens names alike."""

from transformer_lens.utilities import get_act_name

from hooked_models.hooks import UnknownHookError
from hooked_models.transformer_lens_compat import TransformerLensCache


class HookedActivationCache(TransformerLensCache):
    """transformer_lens's ActivationCache, keyed by standard names, with every alias resolved.

    `cache["layers.0.layer_input"]`, `cache["blocks.0.hook_resid_pre"]` and `cache["resid_pre", 0]`
    are the same tensor. A TransformerLens name gives TransformerLens's layout (`hook_q` is
    [batch pos head d_head]); the standard name gives the standard one.
    """

    def __getitem__(self, key):
        if isinstance(key, tuple):
            if len(key) > 1 and key[1] is not None and key[1] < 0:
                key = (key[0], self.model.cfg.n_layers + key[1], *key[2:])
            key = get_act_name(*key)
        if key in self.cache_dict:
            return self.cache_dict[key]
        suffix = "_grad" if key.endswith("_grad") else ""
        name = key[: -len(suffix)] if suffix else key
        if name not in self.model.hook_dict and name not in self.model.aliases and "." not in name:
            name = get_act_name(name)  # a TransformerLens shorthand such as "embed"
        canonical, value = self._resolve(name)
        if canonical + suffix not in self.cache_dict:
            raise KeyError(
                f"{key!r} (standard name {canonical + suffix!r}) is not in this cache; it holds "
                f"{len(self.cache_dict)} values. Run run_with_cache without a names_filter that excludes it."
            )
        tensor = self.cache_dict[canonical + suffix]
        return tensor if value is None else value.to_tl(tensor)

    def _resolve(self, name: str):
        """The model's resolution; a name under a value (a spliced SAE's `<value>.hook_sae_acts_post`)
        resolves through the value's name, also once the SAE is gone from the model."""
        try:
            return self.model.resolve_hook_name(name)
        except UnknownHookError as error:
            parent, _, leaf = name.rpartition(".")
            try:
                canonical, _ = self.model.resolve_hook_name(parent)
            except UnknownHookError:
                raise error from None
            return f"{canonical}.{leaf}", None

    def __contains__(self, key) -> bool:
        try:
            self[key]
        except (KeyError, ValueError):
            return False
        return True
