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

    # Whether run_with_cache was given a names_filter (None: built elsewhere), for the missing-value message.
    names_filter_given: bool | None = None

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
            raise KeyError(f"{key!r} (standard name {canonical + suffix!r}) is not in this cache; it holds "
                           f"{len(self.cache_dict)} values. {self._how_to_cache(key, canonical, suffix)}")
        tensor = self.cache_dict[canonical + suffix]
        return tensor if value is None else value.to_tl(tensor)

    def _how_to_cache(self, key: str, canonical: str, suffix: str) -> str:
        """What would have put `canonical` in the cache, by why it is missing: a value cached only on
        request (TransformerLens's switches), a gradient without `incl_bwd`, or the names_filter given."""
        point = self.model.standard_hook_dict.get(canonical)
        value = getattr(point, "value", None)
        name = key if isinstance(key, str) and not suffix else canonical
        if self.names_filter_given is False and value is not None and value.on_request:
            return (f"A run_with_cache without a names_filter caches it only on request, as TransformerLens "
                    f"does: call model.set_{value.on_request}(True) first, or name it: "
                    f"model.run_with_cache(..., names_filter=[{name!r}]).")
        if suffix and not any(n.endswith("_grad") for n in self.cache_dict):
            return "Gradients are cached by run_with_cache(tokens, return_type=\"loss\", incl_bwd=True)."
        if self.names_filter_given:
            return f"The names_filter given leaves it out: name it there ({name!r}) or let the filter match it."
        return "Run run_with_cache with a names_filter that includes it."

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
