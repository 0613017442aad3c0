"""The attribution graph of one prompt: its nodes, their direct-effect edges, pruning and scores
(circuit-tracer's `graph.py`: `Graph`, `prune_graph`, `compute_graph_scores`).

Node order (circuit-tracer's): features (by layer, position, index), errors (layer-major), embeddings
(one per position: the stream entering layer 0, so alpha-er's position embedding is part of it),
logits. Per-head loadings: for each attention layer L, the part of an edge through head h of L (the
backward pass let through that head alone of L) and the part that skips L's attention (none of L's heads
let through); for each L, the heads' parts plus the skip are the edge.
"""

import os
from dataclasses import dataclass, field, replace

import torch
from jaxtyping import Float, Int
from torch import Tensor

from hooked_models.attribution import export
from hooked_models.attribution.qk import QKTable

# ------------------------------------------------------------------------------------------- graph
@dataclass
class AttributionGraph:
    """Nodes and direct-effect edges of one prompt (see the module docstring for the order).

    `active_features [feature 3]`: (layer, position, feature index) of each feature node, with its
    `activation_values`. `adjacency_matrix [node node]`: row = target, column = source. The output
    nodes ("logits"): `logit_tokens` (a negative id for a target that is not one token),
    `logit_probabilities` (their weights as outputs), `logit_str_tokens` (their names) and
    `logit_positions` (None: all at the last position).

    Per-head loadings, for the edges `loading_edges [edge 2]` (target, source) only:
    `loading_heads [edge layer head]` and `loading_skips [edge layer]`, for each attention layer the
    edge split over its heads plus the part that skips it (`edge_loadings(target, source)`; dense
    `head_loadings [node node layer head]` for small graphs). `qk_tables`: the QK attributions computed,
    by (layer, head, query_pos, key_pos) (`qk(...)`). After `prune`, `node_mask`, `edge_mask` and
    `cumulative_influence` say what was kept.
    """

    tokens: Int[Tensor, " seq"]
    active_features: Int[Tensor, "feature 3"]
    activation_values: Float[Tensor, " feature"]
    logit_tokens: Int[Tensor, " logit"]
    logit_probabilities: Float[Tensor, " logit"]
    adjacency_matrix: Float[Tensor, "node node"]
    n_layers: int
    prompt: str = ""
    str_tokens: list[str] = field(default_factory=list)
    model_name: str = ""
    transcoder_names: list[str] = field(default_factory=list)
    logit_str_tokens: list[str] = field(default_factory=list)
    logit_positions: Int[Tensor, " logit"] | None = None
    loading_edges: Int[Tensor, "edge 2"] | None = None
    loading_heads: Float[Tensor, "edge layer head"] | None = None
    loading_skips: Float[Tensor, "edge layer"] | None = None
    qk_tables: dict[tuple[int, int, int, int], QKTable] | None = None
    node_mask: Tensor | None = None
    edge_mask: Tensor | None = None
    cumulative_influence: Tensor | None = None
    node_threshold: float | None = None

    # ------------------------------------------------------------------------------ node layout
    n_pos = property(lambda self: int(self.tokens.shape[0]))
    n_features = property(lambda self: int(self.active_features.shape[0]))
    n_errors = property(lambda self: self.n_layers * self.n_pos)
    n_logits = property(lambda self: int(self.logit_tokens.shape[0]))
    n_nodes = property(lambda self: int(self.adjacency_matrix.shape[0]))
    error_start = property(lambda self: self.n_features)
    embedding_start = property(lambda self: self.n_features + self.n_errors)
    logit_start = property(lambda self: self.embedding_start + self.n_pos)

    def node_kind(self, i: int) -> str:
        """"feature", "error", "embedding" or "logit"."""
        for kind, end in (("feature", self.error_start), ("error", self.embedding_start),
                          ("embedding", self.logit_start), ("logit", self.n_nodes)):
            if i < end:
                return kind
        raise IndexError(f"node {i} of a graph of {self.n_nodes} nodes")

    def node_position(self, i: int) -> tuple[int | None, int]:
        """(layer, position) of node i: layer None for embeddings, n_layers for logits."""
        kind = self.node_kind(i)
        if kind == "feature":
            layer, pos, _ = self.active_features[i].tolist()
            return layer, pos
        if kind == "error":
            return divmod(i - self.error_start, self.n_pos)
        if kind == "embedding":
            return None, i - self.embedding_start
        k = i - self.logit_start
        return self.n_layers, self.n_pos - 1 if self.logit_positions is None else int(self.logit_positions[k])

    def node_name(self, i: int) -> str:
        """A name over the vocabulary: `layers.1.mlp.feature.37@4`, `layers.1.mlp.error@4`,
        `embedding@4`, `logits.523@7` (token 523 at the last position)."""
        kind, layer, pos, index = export.node_fields(self, i)
        if kind == "logit" and index < 0:
            return f"target.{self.logit_text(i - self.logit_start)}@{pos}"
        return {"feature": f"layers.{layer}.mlp.feature.{index}@{pos}", "error": f"layers.{layer}.mlp.error@{pos}",
                "embedding": f"embedding@{pos}", "logit": f"logits.{index}@{pos}"}[kind]

    @property
    def nodes(self) -> list[str]:
        return [self.node_name(i) for i in range(self.n_nodes)]

    def logit_weights(self) -> Tensor:
        """Each node's weight as an output: the logits' probabilities, zero elsewhere."""
        weights = torch.zeros(self.n_nodes, dtype=self.adjacency_matrix.dtype)
        weights[self.logit_start:] = self.logit_probabilities.to(weights.dtype)
        return weights

    # ------------------------------------------------------------------------------ attention
    def edge_loadings(self, target: int, source: int) -> tuple[Tensor, Tensor] | None:
        """Edge (target, source)'s split, ([layer head] heads' parts, [layer] skips), or None where its
        loadings were not computed."""
        if self.loading_edges is None:
            return None
        at = ((self.loading_edges[:, 0] == target) & (self.loading_edges[:, 1] == source)).nonzero().flatten()
        return None if not at.numel() else (self.loading_heads[int(at[0])], self.loading_skips[int(at[0])])

    @property
    def head_loadings(self) -> Float[Tensor, "node node layer head"] | None:
        """The loadings dense (zero where not computed): for small graphs; large ones read `loading_heads`."""
        return self._dense(self.loading_heads)

    @property
    def attention_skips(self) -> Float[Tensor, "node node layer"] | None:
        return self._dense(self.loading_skips)

    def _dense(self, values: Tensor | None) -> Tensor | None:
        if values is None:
            return None
        dense = torch.zeros(self.n_nodes, self.n_nodes, *values.shape[1:], dtype=values.dtype)
        dense[self.loading_edges[:, 0], self.loading_edges[:, 1]] = values
        return dense

    def qk(self, layer: int, head: int, query_pos: int, key_pos: int, top: int = 20) -> QKTable:
        """The QK attribution of head `head` of layer `layer` at (query_pos, key_pos): the score split
        into (query-side, key-side) component pairs (`.top(top)` ranks them; printing shows `top`)."""
        if self.qk_tables is None:
            raise ValueError("this graph was built without its decomposition: no QK attribution; pass "
                             "head_loadings='pruned' (or 'all') and qk=... to attribute")
        if not self.qk_tables:
            raise ValueError("this graph has no QK attribution: qk=0, or nothing kept passes through attention")
        n_heads = 1 + max(h for _, h, _, _ in self.qk_tables)  # at least as many as some table names
        if self.loading_heads is not None:
            n_heads = self.loading_heads.shape[-1]
        for name, value, limit in (("layer", layer, self.n_layers), ("head", head, n_heads),
                                   ("query_pos", query_pos, self.n_pos), ("key_pos", key_pos, self.n_pos)):
            if not 0 <= value < limit:
                raise ValueError(f"{name}={value} outside [0, {limit})")
        if key_pos > query_pos:  # a query attends only to itself and earlier keys: the entry is masked
            raise ValueError(f"key_pos={key_pos} comes after query_pos={query_pos}: attention is causal, so a query "
                             f"reads no later key; that entry is masked, with no score to attribute")
        key = (layer, head, query_pos, key_pos)
        if key not in self.qk_tables:
            raise ValueError(f"no QK attribution computed for layer {layer}, head {head}, query {query_pos}, key "
                             f"{key_pos}; computed: {sorted(self.qk_tables)[:8]}... (ask for it with attribute's qk=)")
        return replace(self.qk_tables[key], shown=top)

    # -------------------------------------------------------------------------- prune and score
    def prune(self, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> "AttributionGraph":
        """The graph with `node_mask`/`edge_mask` set, circuit-tracer's `prune_graph`: keep the nodes
        that carry `node_threshold` of the total influence on the logits (embeddings and logits always),
        then the edges that carry `edge_threshold` of the kept nodes' edge influence, then drop, until
        nothing changes, features without incoming edges and features and errors without outgoing ones.
        Influence: abs(adjacency), each row normalized to sum 1, propagated from the logits' probabilities
        through every path.

        Where it differs from circuit-tracer's `prune_graph`: an edge of weight zero is never kept
        (circuit-tracer keeps every edge whose score reaches the threshold, so at `edge_threshold=1.0`,
        where the threshold score is 0, it keeps the zero-weight ones too, and the nodes they keep);
        below 1.0 the two keep the same nodes and edges (tests/test_circuit_tracer_compare.py)."""
        for name, value in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}={value} must be between 0 and 1")
        weights = self.logit_weights()
        # Two [node node] buffers in all (the pruning was the largest part of a small graph's memory
        # and, in fresh pages, of its time): |adjacency| and the normalized rows. What follows the node
        # pruning reads the kept nodes' rows only ([kept node]: a pruned graph keeps few), with the bits
        # of the whole matrix's arithmetic: each row's sum is its own (at its full length, the dropped
        # columns zero), the influence series runs over the whole normalized matrix, and every positive
        # edge score lies in those rows.
        magnitude = self.adjacency_matrix.abs()
        normalized = magnitude / _row_sums(magnitude)
        node_influence = influence_series(normalized, weights)
        node_mask = node_influence >= top_threshold(node_influence, node_threshold)
        node_mask[self.embedding_start:] = True
        kept = node_mask.nonzero().flatten()
        # |the kept nodes' edges|, normalized: normalized_abs of the kept edges. Where most nodes are
        # kept, every row, in place, and the spare buffer is the first normalization's; else the kept
        # rows, copied, and the spare buffer is |adjacency|'s. A dropped node's row is left as it is:
        # the series reaches a node only through kept rows (it starts at the logits, always kept, and
        # the kept rows' dropped columns are zero), so that row is multiplied by exact zeros and its
        # scores are zero (its influence and weight are), changing no sum's bits.
        if 2 * len(kept) > len(node_mask):
            kept, rows, spare = torch.arange(len(node_mask)), magnitude, normalized
        else:
            rows, spare = magnitude[kept], magnitude
        rows[:, ~node_mask] = 0
        rows /= _row_sums(rows)
        if rows is magnitude:
            normalized = rows
        else:
            normalized[kept] = rows
        rows.mul_((influence_series(normalized, weights) + weights)[kept, None])  # the edge scores
        threshold = top_threshold(rows, edge_threshold, scratch=spare.view(-1), n_scores=spare.numel())
        # A positive threshold keeps no edge of weight zero (its score is zero); a threshold of zero
        # keeps every score, so the kept nodes' edges of nonzero weight.
        if threshold > 0:
            edges = rows >= threshold
        else:
            edges = (self.adjacency_matrix[kept] != 0) & node_mask & node_mask[kept, None]
        del normalized, magnitude, rows, spare
        # Features and errors need a way out, features a way in: drop, until none is, those without.
        needs_in = kept < self.n_features
        while True:
            survives = node_mask.clone()
            survives[:self.embedding_start] &= edges[:, :self.embedding_start].any(0)
            survives[kept[needs_in]] &= edges[needs_in].any(1)
            dropped = node_mask & ~survives
            if not bool(dropped.any()):
                break
            edges[dropped[kept]] = False
            edges[:, dropped] = False
            node_mask = survives
        edge_mask = torch.zeros_like(self.adjacency_matrix, dtype=torch.bool)
        edge_mask[kept] = edges
        order = node_influence.argsort(descending=True)
        cumulative = torch.zeros_like(node_influence)
        cumulative[order] = node_influence[order].cumsum(0) / node_influence.sum().clamp(min=1e-30)
        return replace(self, node_mask=node_mask, edge_mask=edge_mask, cumulative_influence=cumulative,
                       node_threshold=node_threshold)

    def scores(self) -> tuple[float, float]:
        """(replacement score, completeness score), circuit-tracer's `compute_graph_scores`, on the
        unpruned adjacency: the share of the embeddings' in the embeddings' plus errors' influence on the
        logits; and the influence-weighted share of the nodes' inputs that does not come from errors."""
        weights = self.logit_weights()
        normalized = normalized_abs(self.adjacency_matrix)
        influence = influence_series(normalized, weights)
        errors = slice(self.error_start, self.embedding_start)
        token_influence = influence[self.embedding_start:self.logit_start].sum()
        error_influence = influence[errors].sum()
        replacement = token_influence / (token_influence + error_influence).clamp(min=1e-30)
        non_error = 1 - normalized[:, errors].sum(-1)
        output = influence + weights
        completeness = (non_error * output).sum() / output.sum()
        return float(replacement), float(completeness)

    def to_json(self, path: "str | os.PathLike", slug: str | None = None, node_threshold: float = 0.8,
                edge_threshold: float = 0.98, features=None, labels=None):
        """Write the pruned graph (pruned here with the thresholds unless `prune` was called) in
        circuit-tracer's graph-file schema (`frontend/graph_models.py`), which its local viewer and
        Neuronpedia open. Node ids are circuit-tracer's; the file also carries, under `hooked_models`,
        what `from_json` needs to rebuild this graph with every node and edge. Returns the path.

        features: a `features.statistics` result of the graph's transcoders: its nodes' feature files are
        written beside the graph where circuit-tracer's viewer reads them, each node labelled (`clerp`:
        the heuristic label, or the user's from `labels`, a JSON or CSV of layer, feature, label)."""
        pruned = self if self.node_mask is not None else self.prune(node_threshold, edge_threshold)
        return export.write_json(pruned, path, slug, features, labels)

    @classmethod
    def from_json(cls, path: "str | os.PathLike") -> "AttributionGraph":
        """The graph `to_json` wrote, unpruned, every node and edge as it was (float32 exactly)."""
        return cls(**export.read_state(path))

    def plot(self, path: "str | os.PathLike | None" = None, ax=None, title: str | None = None,
             node_threshold: float = 0.8, edge_threshold: float = 0.98):
        """Draw the pruned graph: layers up (embeddings at the bottom, logits at the top), positions
        across (a layer and position's nodes side by side, then stacked: none overlap), edge width by
        |weight| (red positive, blue negative: RdBu, explained in the legend). Saved to `path` if given;
        returns the matplotlib Figure."""
        pruned = self if self.node_mask is not None else self.prune(node_threshold, edge_threshold)
        return export.plot(pruned, path, ax, title)

    def str_tokens_or_ids(self) -> list[str]:
        """The prompt's tokens as strings (their ids where the model had no tokenizer)."""
        return list(self.str_tokens) if self.str_tokens else [str(t) for t in self.tokens.tolist()]

    def logit_text(self, k: int) -> str:
        """Logit k's token as a string (its id where the model had no tokenizer)."""
        return self.logit_str_tokens[k] if self.logit_str_tokens else str(int(self.logit_tokens[k]))

    def __str__(self) -> str:
        pruned = "" if self.node_mask is None else f", pruned to {int(self.node_mask.sum())} nodes"
        return (f"AttributionGraph: {self.n_features} features, {self.n_errors} errors, {self.n_pos} embeddings, "
                f"{self.n_logits} logits; {int((self.adjacency_matrix != 0).sum())} edges{pruned}")


def normalized_abs(matrix: Tensor) -> Tensor:
    """abs(matrix), each row scaled to sum 1 (rows of zeros stay zero)."""
    matrix = matrix.abs()
    return matrix / _row_sums(matrix)


def _row_sums(magnitude: Tensor) -> Tensor:
    return magnitude.sum(1, keepdim=True).clamp(min=1e-10)


def influence_series(normalized: Tensor, weights: Tensor) -> Tensor:
    """weights · (A + A² + A³ + ...): the graph is acyclic (targets read only earlier layers), so
    the series ends after at most as many terms as the graph is deep."""
    total = current = weights @ normalized
    for _ in range(normalized.shape[0]):
        if not bool(current.any()):
            break
        current = current @ normalized
        total = total + current
    return total


def top_threshold(scores: Tensor, fraction: float, scratch: Tensor | None = None,
                  n_scores: int | None = None) -> Tensor:
    """The smallest score among the highest ones that together make `fraction` of the total (scores >= 0):
    circuit-tracer's `find_threshold`, bit for bit, with only the nonzero scores sorted. Its descending
    order puts the zeros last, where they change neither the running sum (a sequential scan) before them
    nor, written out as zeros, the total; a pruned graph's edge scores are mostly zeros.
    `n_scores`: the number of scores, of which `scores` holds every positive one, the rest zeros (default:
    `scores.numel()`); `scratch`: a buffer of [n_scores] in the scores' dtype whose contents may go, for
    the total's sorted copy."""
    n = scores.numel() if n_scores is None else n_scores
    if n < scores.numel():
        raise ValueError(f"n_scores={n_scores} is fewer than the {scores.numel()} scores given")
    positive = scores[scores > 0].sort(descending=True).values
    if not len(positive):
        return scores.new_zeros(())
    if scratch is None:
        ordered = scores.new_zeros(n)
    else:
        if scratch.shape != (n,) or scratch.dtype != scores.dtype:
            raise ValueError(f"scratch is {scratch.dtype} {tuple(scratch.shape)}; the scores are {scores.dtype} "
                             f"({n},)")
        ordered = scratch
        ordered[len(positive):] = 0
    ordered[:len(positive)] = positive
    cumulative = positive.cumsum(0) / ordered.sum().clamp(min=1e-30)  # the total over every score, as theirs
    index = int(torch.searchsorted(cumulative, fraction))
    # Past the positive scores the running sum stays at its last value: `fraction` not reached there
    # is reached nowhere, and their index (the last) reads a zero, if there is one.
    return positive[index] if index < len(positive) else ordered[-1]
