"""A griffe extension: a package whose `__all__` is computed (the lazy packages: `__all__ =
sorted(_PUBLIC)`) exports what it computes, so mkdocstrings' "public" filter documents those names there.

Griffe reads source statically and cannot evaluate the expression; the package is imported instead
(cheap: its names are imported on first use) and its runtime `__all__` taken.
"""

import importlib

import griffe


class RuntimeAll(griffe.Extension):
    def on_module_members(self, *, node, mod: griffe.Module, agent, **kwargs) -> None:
        if mod.exports or "__all__" not in mod.members:
            return
        names = getattr(importlib.import_module(mod.path), "__all__", None)
        if names:
            mod.exports = list(names)
