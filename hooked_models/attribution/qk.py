"""QK attributions, the second reader of the forward decomposition: why a head attended where it did.

For head h of layer L, query position q and key position k, the pre-softmax score is
scale · query(q) · key(k), and with the norm scales frozen the query and the key are each a sum over the
components writing to the stream (their contributions through the frozen norm, the projection and
rotary: the decomposition's `attention_queries` and `attention_keys`), plus a bias. So the score is
exactly the sum over (query-side component, key-side component) pairs of scale · q_i · k_j
(Kamath et al. 2025, "Tracing attention computation through feature interactions"; lm-saes'
`attribution_qk.py`). Components: the kept graph's nodes, each with its full contribution (through
every earlier attention layer: earlier heads are decomposed into the nodes they carry), the bias, and
"other nodes" (every node not kept, lumped: one decomposition row carrying all their writes). alpha-er caps
the score (cap · tanh(score / cap)): the pairs decompose the raw score and the capped one is reported
beside it.
"""

import math
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

BIAS, OTHERS = "bias", "other nodes"


@dataclass
class QKTable:
    """The score of one pattern entry split into pairs: `queries [component head_dim]` and `keys
    [component head_dim]` are the components' parts of the query and key (rotated, normed, projected),
    `names` theirs; `pairs()[i, j]` = scale · queries[i] · keys[j]; they sum to `score`, the raw
    pre-softmax score; `capped` is what the softmax saw (the same where there is no cap)."""

    layer: int
    head: int
    query_pos: int
    key_pos: int
    names: list[str]
    queries: Float[Tensor, "component head_dim"]
    keys: Float[Tensor, "component head_dim"]
    scale: float
    cap: float = 0.0
    model_score: float = float("nan")
    flow: float = 0.0
    shown: int = 20

    def pairs(self) -> Float[Tensor, "component component"]:
        return (self.queries.double() @ self.keys.double().T * self.scale).to(self.queries.dtype)

    @property
    def score(self) -> float:
        """The raw score, as the pairs sum (equal to the model's `model_score` within rounding)."""
        return float(self.pairs().double().sum())

    @property
    def capped(self) -> float:
        """The score the softmax saw: the cap applied to the model's own raw score (where recorded; the
        pairs' sum carries each part's rounding, which the cap's slope can magnify next to a small score)."""
        raw = self.model_score if math.isfinite(self.model_score) else self.score
        return self.cap * math.tanh(raw / self.cap) if self.cap else raw

    def top(self, k: int = 20) -> list[dict]:
        """The k pairs of largest |value| (nonzero ones): {"query", "key", "value"}, strongest first."""
        pairs = self.pairs()
        order = pairs.abs().flatten().argsort(descending=True)[:k]
        order = order[pairs.flatten()[order] != 0]
        n = pairs.shape[1]
        return [{"query": self.names[int(i) // n], "key": self.names[int(i) % n], "value": float(pairs.flatten()[i])}
                for i in order]

    def __str__(self) -> str:
        cap = f", capped {self.capped:.4g} (cap {self.cap:g})" if self.cap else ""
        lines = [f"layers.{self.layer}.self_attn head {self.head}, query {self.query_pos} -> key {self.key_pos}: "
                 f"score {self.score:.4g}{cap}"]
        lines += [f"  {row['value']:+.4g}  {row['query']}  x  {row['key']}" for row in self.top(self.shown)]
        return "\n".join(lines)


class QKReader:
    """Collects each entry's query and key parts from the decomposition's chunks. Entries: (layer,
    head, query_pos, key_pos); `groups`: query heads per key/value head."""

    def __init__(self, entries: list[tuple[int, int, int, int]], n_components: int, groups: int, head_dim: int,
                 dtype=torch.float32):
        self.entries, self.groups = entries, groups
        # Two more rows per entry: the bias, then the other nodes.
        self.queries = torch.zeros(len(entries), n_components + 2, head_dim, dtype=dtype)
        self.keys = torch.zeros_like(self.queries)

    @staticmethod
    def names_read(layer: int) -> tuple[str, str]:
        return f"layers.{layer}.self_attn.attention_queries", f"layers.{layer}.self_attn.attention_keys"

    def reads(self) -> list[str]:
        return sorted({name for layer, *_ in self.entries for name in self.names_read(layer)})

    def _at(self, values: dict[str, Tensor], e: int) -> tuple[Tensor, Tensor]:
        layer, head, q, k = self.entries[e]
        queries, keys = self.names_read(layer)
        return values[queries][..., head, q, :], values[keys][..., head // self.groups, k, :]

    def read(self, start: int, values: dict, bias: dict, others: dict | None) -> None:
        """One chunk of the decomposition; the first carries the bias and the other nodes' row."""
        n = next(iter(values.values())).shape[0]
        for e in range(len(self.entries)):
            q, k = self._at(values, e)
            self.queries[e, start:start + n], self.keys[e, start:start + n] = q, k
            if start == 0:
                self.queries[e, -2], self.keys[e, -2] = self._at(bias, e)
                self.queries[e, -1], self.keys[e, -1] = self._at(others, e)

    def tables(self, names: list[str], scales: list[float], caps: list[float], model_scores: list[float],
               flows: list[float]) -> list[QKTable]:
        """One table per entry: the components', the bias' and the other nodes' parts."""
        tables = []
        for e, (layer, head, q, k) in enumerate(self.entries):
            tables.append(QKTable(layer, head, q, k, [*names, BIAS, OTHERS], self.queries[e].clone(),
                                  self.keys[e].clone(), scales[layer], caps[layer], model_scores[e], flows[e]))
        return tables
