"""A key/value cache for incremental decoding: each new token costs one position, not the prefix.

Keys are stored after rotary and before the grouped-query repeat (the layout of `attention_keys`),
so a cached key is exactly what the attention would have recomputed, and the cache is
num_heads / num_kv_heads times smaller than the repeated keys.
"""

import torch
import torch.nn as nn
from jaxtyping import Float, Int
from torch import Tensor


class KeyValueCache:
    """Per attention module, the keys and values of the positions already run; and their mask.

    The family's forward calls `extend_mask` once per call (before the layers), then each attention
    module calls `extend` with its new keys and values and attends over what it returns. Buffers
    grow by doubling, so appending a position is amortized O(1) rather than a copy of the prefix.
    """

    def __init__(self):
        self._entries: dict[nn.Module, list] = {}  # module -> [keys buffer, values buffer, length]
        self._mask: Int[Tensor, "batch seq"] | None = None
        self.padded = False  # whether any cached position is padding

    @classmethod
    def prefilled(
        cls,
        attention_mask: Int[Tensor, "batch past"],
        keys_values: "dict[nn.Module, tuple[Tensor, Tensor]] | None" = None,
        room: int = 0,
    ) -> "KeyValueCache":
        """A cache holding positions a forward did not run here, as if it had: `attention_mask`
        covers them (ones where there is no padding), `keys_values` gives, per attention module,
        their keys and values in `attention_keys`/`attention_values`' layout (after rotary, before
        the grouped-query repeat) [batch num_kv_heads past dim]. `room` reserves buffer space for
        that many positions to come, so the next forward appends without a copy."""
        cache = cls()
        batch, past = attention_mask.shape
        cache.extend_mask(attention_mask, batch, past, attention_mask.device)
        for module, (k, v) in (keys_values or {}).items():
            if k.shape[0] != batch or k.shape[-2] != past or v.shape[:-1] != k.shape[:-1]:
                raise ValueError(f"keys {tuple(k.shape)} and values {tuple(v.shape)} do not cover the mask's "
                                 f"{batch} rows × {past} positions")
            keys, values = k.new_empty(cls._grown(k, past + room)), v.new_empty(cls._grown(v, past + room))
            keys[..., :past, :], values[..., :past, :] = k, v
            cache._entries[module] = [keys, values, past]
        return cache

    @property
    def length(self) -> int:
        """The number of positions cached (padding included)."""
        return 0 if self._mask is None else self._mask.shape[1]

    def extend_mask(
        self, attention_mask: Int[Tensor, "batch seq"] | None, batch: int, seq: int, device: torch.device
    ) -> Int[Tensor, "batch key"] | None:
        """Append the new positions' mask; the mask over every position so far, or None without padding."""
        new = torch.ones(batch, seq, dtype=torch.long, device=device) if attention_mask is None else attention_mask
        if self._mask is not None and self._mask.shape[0] != batch:
            raise ValueError(f"this cache holds a batch of {self._mask.shape[0]} rows, but the call has {batch}")
        # One host sync per call with a mask; none while no padding was ever given.
        self.padded = self.padded or (attention_mask is not None and not bool(attention_mask.bool().all()))
        self._mask = new.long() if self._mask is None else torch.cat([self._mask, new.long()], dim=1)
        return self._mask if self.padded else None

    def extend(
        self,
        module: nn.Module,
        k: Float[Tensor, "batch num_kv_heads seq qk_head_dim"],
        v: Float[Tensor, "batch num_kv_heads seq head_dim"],
    ) -> tuple[Float[Tensor, "batch num_kv_heads key qk_head_dim"], Float[Tensor, "batch num_kv_heads key head_dim"]]:
        """Store `module`'s new keys and values; return all of its keys and values so far."""
        entry = self._entries.get(module)
        new = k.shape[-2]
        if entry is None:
            entry = self._entries[module] = [k.new_empty(self._grown(k, new)), v.new_empty(self._grown(v, new)), 0]
        keys, values, used = entry
        if used + new > keys.shape[-2]:
            keys = torch.cat([keys[..., :used, :], k.new_empty(self._grown(k, used + new))], dim=-2)
            values = torch.cat([values[..., :used, :], v.new_empty(self._grown(v, used + new))], dim=-2)
        keys[..., used: used + new, :] = k
        values[..., used: used + new, :] = v
        entry[:] = [keys, values, used + new]
        if used + new != self.length:
            raise RuntimeError(f"the cache holds {used + new} keys but its mask covers {self.length} positions; "
                               "call extend_mask once per forward, before the layers")
        return keys[..., : used + new, :], values[..., : used + new, :]

    @staticmethod
    def _grown(t: Tensor, needed: int) -> tuple[int, ...]:
        shape = list(t.shape)
        shape[-2] = max(needed, 16)
        return tuple(shape)
