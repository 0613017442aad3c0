"""The root of every hooked model: names, hooks, the cache, the printout and the forward's edges.

A family subclasses `HookedModel`, builds its modules, calls `setup()`, and implements `_embed` and
`_attention_inputs`.
Everything a user touches by name goes through `resolve_hook_name`, which accepts the standard name
(`layers.0.self_attn.attention_queries`) or the TransformerLens one (`blocks.0.attn.hook_rot_q`) and
maps the second onto the first: one HookPoint per value, an alias is only a second name.
"""

# For developers, the package's layout: `HookedModel` is composed of one mixin per concern, each in its own module
# (the contract in pyproject.toml): names (standard and TransformerLens names, filters, `add_hook`), caching
# (`run_with_cache`), inputs (tokens and their checks), and root (the class, its views and the forward).

from hooked_models.model.root import HookedModel

__all__ = ["HookedModel"]
