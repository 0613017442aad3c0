"""HookPoints that know which standard value they carry, and the printout that shows them."""

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from transformer_lens.hook_points import HookPoint

from hooked_models.vocabulary import VALUES, Value


class HookWriteError(ValueError):
    """A hook returned something that cannot replace the value it was given."""


class UnknownHookError(KeyError, ValueError):
    """A hook name the model does not have. A KeyError, as TransformerLens raises for a missing name,
    and a ValueError, as every other bad argument here; the message suggests the nearest names."""

    def __init__(self, message: str = "", hint: Callable[[], str] | None = None):
        super().__init__(message)
        self._hint = hint  # the nearest names, computed only when the message is read: a caller that
        # catches the error (`name in cache` on every run_with_cache) pays nothing for them

    def __str__(self) -> str:
        if self._hint is not None:
            self.args, self._hint = (self.args[0] + self._hint(),), None
        return str(self.args[0]) if self.args else ""  # KeyError's str() would quote the whole message

    def __reduce__(self):  # pickled (Ray) with its message written out, the hint's closure left behind
        return type(self), (str(self),)


def check_hook_write(out: Any, given: torch.Tensor, name: str, value: Value) -> None:
    """Raise HookWriteError unless `out` can replace `given`, the value `name` carries."""
    if value.read_only:
        raise HookWriteError(
            f"hook on {name} returned a tensor, but {value.name} is read-only "
            f"({value.meaning}); return None from a hook that only reads it"
        )
    if not isinstance(out, torch.Tensor):
        raise HookWriteError(f"hook on {name} returned {type(out).__name__}, expected a tensor or None")
    if out.shape != given.shape or out.dtype != given.dtype:
        raise HookWriteError(
            f"hook on {name} returned shape {tuple(out.shape)} {out.dtype}, but the value it "
            f"replaces is {tuple(given.shape)} {given.dtype}"
        )


class ValueHook(HookPoint):
    """A HookPoint for one standard value.

    Every forward hook added here is checked when it returns: a write to a read-only value, or a
    replacement whose shape or dtype differs from the value's, raises an error that names the hook
    and both shapes (rather than failing later, deep inside a matmul).

    `splice` (hooked_models/saes.py) is what the value is replaced with, an SAE, or None: the
    HookPoint's forward runs it, so its hooks see, and the model reads on, the SAE's output.
    `readers` are called with the value the model reads on, after every hook (a spliced transcoder
    reads its input there: the MLP's input, as edited).
    """

    splice = None
    readers = ()

    def __init__(self, value: Value | str):
        super().__init__()
        self.value = VALUES[value] if isinstance(value, str) else value
        self.pos_dim = self.value.seq_axis

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.splice is None else self.splice(x)

    def __call__(self, *args, **kwargs):
        out = super().__call__(*args, **kwargs)
        for reader in self.readers:
            reader(out)
        return out

    def add_hook(self, hook, dir="fwd", is_permanent=False, level=None, prepend=False, alias_names=None):
        if dir == "fwd":
            hook = _CheckedHook(hook, self)
        return super().add_hook(hook, dir, is_permanent, level, prepend, alias_names)

    def has_hooks(self, dir="both", including_permanent=True, level=None) -> bool:
        # Fast path for the forward's "is anyone looking?" checks; a spliced SAE is a reader and a writer.
        if dir == "both" and including_permanent and level is None:
            return bool(self.fwd_hooks or self.bwd_hooks or self.splice is not None or self.readers)
        return super().has_hooks(dir, including_permanent, level)

    def __repr__(self) -> str:
        spliced = "" if self.splice is None else f"; spliced: {type(self.splice.sae).__name__}"
        return f"-> {self.value.layout_text}: {self.value.meaning}{spliced}"


class _CheckedHook:
    """Wraps a user's hook so that what it returns is checked against what it was given."""

    def __init__(self, fn, point: ValueHook):
        self.fn, self.point = fn, point

    def __repr__(self) -> str:
        return repr(self.fn)

    def __call__(self, tensor: torch.Tensor, *, hook) -> Any:
        out = self.fn(tensor, hook=hook)
        if out is None:
            return None
        check_hook_write(out, tensor, repr(getattr(hook, "name", None) or self.point.name), self.point.value)
        return out


# TransformerLens's hook names: second names the model resolves, never attributes of a module.
_TL_HOOK_NAMES = frozenset(value.tl for value in VALUES.values() if value.tl)


class HookedModule(nn.Module):
    """A module whose printout lists its standard values under its children, as the family page does:

        (attention_queries) -> Queries [batch num_heads seq qk_head_dim]: The queries entering attention
    """

    def __setattr__(self, name: str, value: Any) -> None:
        # HookedSAETransformer.add_sae sets its wrapper at the hook's path; at a TransformerLens name
        # that would register a module nothing calls, and the SAE would silently do nothing.
        if isinstance(value, nn.Module) and name in _TL_HOOK_NAMES:
            raise AttributeError(
                f"{name!r} is a TransformerLens name, which the model resolves to a standard HookPoint "
                f"(model.hook_dict); a module set here would never be called. Splice SAEs with model.add_sae, "
                f"replace values through hooks")
        super().__setattr__(name, value)

    def __repr__(self) -> str:
        lines = []
        extra = self.extra_repr()
        if extra:
            lines.extend(extra.split("\n"))
        modules = [(n, m) for n, m in self._modules.items() if not isinstance(m, ValueHook)]
        hooks = [(n, m) for n, m in self._modules.items() if isinstance(m, ValueHook)]
        lines.extend(f"({n}): {m!r}" for n, m in modules)
        lines.extend(f"({n}) {m!r}" for n, m in hooks)
        if not lines:
            return f"{type(self).__name__}()"
        body = "\n".join("  " + line for line in "\n".join(lines).split("\n"))
        return f"{type(self).__name__}(\n{body}\n)"
