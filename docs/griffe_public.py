"""A griffe extension for the package's public import paths, as Python resolves them at run time.

- A package whose `__all__` is computed (the lazy packages: `__all__ = sorted(_PUBLIC)`) exports what it
  computes, so mkdocstrings' "public" filter documents those names there. Griffe reads source statically and
  cannot evaluate the expression; the package is imported instead (cheap: its names load on first use).
- A package that exports a name its own submodule also has (`hooked_models.attribution.attribute`, the function
  imported from the module `attribute.py`) documents what the name is at run time, the function: griffe keeps
  the submodule under that name.
"""

import importlib
import inspect

import griffe


class RuntimeAll(griffe.Extension):
    def on_module_members(self, *, node, mod: griffe.Module, agent, **kwargs) -> None:
        if mod.exports or "__all__" not in mod.members:
            return
        names = getattr(importlib.import_module(mod.path), "__all__", None)
        if names:
            mod.exports = list(names)

    def on_package(self, *, pkg: griffe.Module, loader, **kwargs) -> None:
        for module in _modules(pkg):
            for name in module.exports or ():
                member = module.members.get(name)
                if member is None or member.is_alias or not member.is_module:
                    continue
                value = getattr(importlib.import_module(module.path), name, None)
                if inspect.ismodule(value) or not hasattr(value, "__qualname__"):
                    continue
                module.set_member(name, griffe.Alias(name, f"{value.__module__}.{value.__qualname__}", parent=module))


def _modules(module: griffe.Module):
    yield module
    for member in module.modules.values():
        if not member.is_alias:
            yield from _modules(member)
