"""Names: every HookPoint under its standard name and its TransformerLens names, filters over both, and
hooks added by either (a hook added under a TransformerLens name sees that name's layout)."""

import difflib
import re
from collections.abc import Callable

from torch import Tensor
from transformer_lens.hook_points import HookPoint, _AliasedHookPoint

from hooked_models.hooks import UnknownHookError, ValueHook, check_hook_write
from hooked_models.vocabulary import SYNONYMS, Value, tl_module_path


class _AliasHook:
    """A user's hook added under a TransformerLens name: it sees that name and that layout,
    and what it returns is mapped back to the standard layout. (A HookPoint that carries no value,
    a spliced SAE's, has one layout: the hook only sees the name.)"""

    def __init__(self, fn: Callable, alias: str, value: Value | None):
        self.fn, self.alias, self.value = fn, alias, value

    def __repr__(self) -> str:
        return repr(self.fn)

    def __call__(self, tensor: Tensor, *, hook: HookPoint):
        if self.value is None:
            return self.fn(tensor, hook=_AliasedHookPoint(self.alias, hook))
        given = self.value.to_tl(tensor)
        out = self.fn(given, hook=_AliasedHookPoint(self.alias, hook))
        if out is None:
            return None
        # Checked in the layout the user saw, before einops could fail on a wrong shape.
        check_hook_write(out, given, f"{self.alias!r} (standard name {hook.name!r})", self.value)
        return self.value.from_tl(out)



class HookNames:
    """`HookedModel`'s names: `setup` indexes the HookPoints and their aliases, `resolve_hook_name` maps a
    TransformerLens name onto the standard one, `filter_matches` asks a filter about both, and `add_hook`
    takes either."""

    def setup(self):
        """Index every HookPoint by its standard name and every alias by its TransformerLens name.

        Call at the end of `__init__`, and again after replacing a submodule.
        """
        super().setup()
        # hook_dict answers to both names (TransformerLens code iterates it for "...hook_z" names);
        # standard_hook_dict holds each HookPoint once, under its standard name.
        self.standard_hook_dict: dict[str, HookPoint] = dict(self.hook_dict)
        self.aliases = {}
        for name, point in self.standard_hook_dict.items():
            value = getattr(point, "value", None)
            if value is None or value.tl is None:
                continue
            module_path = name.rpartition(".")[0]
            host = module_path.rpartition(".")[0] if value.tl_on_parent else module_path
            hosts = [host, host.rpartition(".")[0]] if value.tl_also_on_parent else [host]
            for tl_host in map(tl_module_path, hosts):
                if tl_host is not None:
                    self.aliases[f"{tl_host}.{value.tl}" if tl_host else value.tl] = name
        self._tl_fallback_aliases()
        # HookPoints under a value (a spliced SAE's) answer under each of its names too.
        for name in self.standard_hook_dict:
            parent, _, leaf = name.rpartition(".")
            if not isinstance(self.standard_hook_dict.get(parent), ValueHook):
                continue
            for alias in [a for a, c in self.aliases.items() if c == parent]:
                self.aliases[f"{alias}.{leaf}"] = name
        self._alias_names: dict[str, list[str]] = {}
        for alias, canonical in self.aliases.items():
            self._alias_names.setdefault(canonical, []).append(alias)
        self.hook_dict = {**self.standard_hook_dict,
                          **{alias: self.standard_hook_dict[c] for alias, c in self.aliases.items()}}

    def remove_all_hook_fns(self, direction="both", including_permanent=False, level=None):
        """TransformerLens's, visiting each HookPoint once (hook_dict lists it under its aliases too) and
        only those holding hooks: every run_with_hooks and run_with_cache calls it on exit, and the
        131 visits of the embedded Arcee cost as much as its forward."""
        if direction not in ("fwd", "bwd", "both"):
            raise ValueError(f"Invalid direction {direction}")
        for point in {id(p): p for p in self.hook_dict.values()}.values():
            if point.fwd_hooks or point.bwd_hooks:
                point.remove_hooks(direction, including_permanent=including_permanent, level=level)

    def resolve_hook_name(self, name: str) -> tuple[str, Value | None]:
        """(standard name, the Value whose layout an alias converts, or None where none is needed)."""
        if name in self.standard_hook_dict:
            return name, None
        if name in self.aliases:
            canonical = self.aliases[name]
            value = getattr(self.standard_hook_dict[canonical], "value", None)
            return canonical, value if value is not None and value.tl_layout else None
        raise UnknownHookError(f"no hook named {name!r} on {type(self).__name__}", lambda: self._name_hint(name))

    def _name_hint(self, name: str) -> str:
        """The values a name means: a synonym's (vocabulary.SYNONYMS: `pattern`, `resid_pre`,
        `attentions_output`), else the nearest standard or TransformerLens names, compared with the layer
        index set aside, so a typo in layer 3 suggests layer 3's names and a shorthand suggests its hook."""
        layered = re.compile(r"^(layers|blocks)\.(\d+)\.")
        names = list(self.hook_dict)
        num_layers = 1 + max((int(m.group(2)) for n in names if (m := layered.match(n))), default=-1)
        templates = list(dict.fromkeys(layered.sub(r"\1.{i}.", n) for n in names))
        match = layered.match(name)
        if match and int(match.group(2)) >= num_layers:
            return f": layer {match.group(2)} is out of range, the model has {num_layers} layers (0 to {num_layers - 1})"
        layer = match.group(2) if match else "0"
        meant = self._synonym_names(name.rpartition(".")[2].removeprefix("hook_").lower(), layer)
        if meant:
            shown = [f"{n!r}" + (f" (TransformerLens {self._alias_names[n][0]!r})" if n in self._alias_names else "")
                     for n in meant]
            return f"; did you mean {' or '.join(shown)}?"
        query = layered.sub(r"\1.{i}.", name)
        close = difflib.get_close_matches(query, templates, n=3, cutoff=0.6)
        if not close and "." not in name:
            # A bare TransformerLens hook ("resid_pre", "hook_z"): match it against the last part of each name.
            tails = {t.rpartition(".")[2].removeprefix("hook_"): t for t in templates}
            close = [tails[t] for t in difflib.get_close_matches(name.removeprefix("hook_"), tails, n=3, cutoff=0.75)]
        close = [c.replace("{i}", layer) for c in close]
        return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""

    def _synonym_names(self, word: str, layer: str) -> list[str]:
        """Up to three names of the value a synonym means, those of `layer` where the value is per layer,
        those TransformerLens also has first (a residual norm's scale before a bottleneck's)."""
        for value_name in SYNONYMS.get(word, ()):
            found = [n for n, point in self.standard_hook_dict.items()
                     if getattr(point, "value", None) is not None and point.value.name == value_name
                     and (not n.startswith("layers.") or n.startswith(f"layers.{layer}."))]
            if found:
                return sorted(found, key=lambda n: n not in self._alias_names)[:3]
        return []

    def hook_names(self, name: str) -> list[str]:
        """Every name a HookPoint answers to: its standard name first, then its aliases."""
        return [name, *self._alias_names.get(name, [])]

    def filter_matches(self, names_filter: Callable[[str], bool]) -> Callable[[str], str | None]:
        """The rule for a filter on names (a `names_filter`, or a filter in `fwd_hooks` or `add_hook`).

        A value answers to its standard name and to its TransformerLens names, and the filter is asked
        about each. A filter that turns down a name no model has (an inclusion filter, such as
        `lambda n: n.endswith("hook_z")`) selects a value if it accepts any of its names; a filter that
        accepts such a name (an exclusion filter, such as `lambda n: not n.endswith("attention_scores")`)
        selects it only if it accepts all of them. So a filter written in either naming selects the same
        values: the other naming can neither add a value it excludes nor drop one it names.

        Returns: standard name -> the name the value matched under (the standard name, or the
        TransformerLens name an inclusion filter accepted first), or None.
        """
        excludes = bool(names_filter(""))  # "" is no model's name

        def match(canonical: str) -> str | None:
            names = self.hook_names(canonical)
            accepted = [n for n in names if names_filter(n)]
            if excludes:
                return canonical if len(accepted) == len(names) else None
            return accepted[0] if accepted else None

        return match

    def _matching_points(self, name: str | Callable[[str], bool]):
        """(HookPoint, standard name, alias or None) for a name or a filter on names."""
        if isinstance(name, str):
            canonical, _ = self.resolve_hook_name(name)
            yield self.standard_hook_dict[canonical], canonical, (name if name != canonical else None)
            return
        match = self.filter_matches(name)
        for canonical, point in self.standard_hook_dict.items():
            matched = match(canonical)
            if matched is not None:
                yield point, canonical, (matched if matched != canonical else None)

    def _wrap_for_alias(self, hook: Callable, canonical: str, alias: str | None) -> Callable:
        if alias is None:
            return hook
        return _AliasHook(hook, alias, getattr(self.standard_hook_dict[canonical], "value", None))

    # ----------------------------------------------------------------------------------- hooks
    def add_hook(self, name, hook, dir="fwd", is_permanent=False, level=None, prepend=False) -> None:
        """Add a hook by standard name, TransformerLens name, or a filter on names."""
        for point, canonical, alias in list(self._matching_points(name)):
            self.check_and_add_hook(point, canonical, self._wrap_for_alias(hook, canonical, alias), dir=dir,
                                    is_permanent=is_permanent, level=level, prepend=prepend)

    def _enable_hook(self, name, hook, dir) -> None:
        for point, canonical, alias in list(self._matching_points(name)):
            point.add_hook(self._wrap_for_alias(hook, canonical, alias), dir=dir, level=self.context_level)
