"""Attribution graphs: which transcoder features, embeddings and errors drive which, down to the logits.

    graph = attribute(model, prompt, transcoders)        # every active feature, error, embedding, top logits
    graph.adjacency_matrix[target, source]              # direct effects in the linearised replacement model
    graph.head_loadings[target, source, layer, head]    # the part of an edge that passes each attention head
    pruned = graph.prune(node_threshold=0.8, edge_threshold=0.98)
    pruned.scores()                                     # (replacement score, completeness score)
    pruned.to_json("graph.json"); pruned.plot("graph.png"); AttributionGraph.from_json("graph.json")
    feature_intervention(model, prompt, transcoders, [(layer, pos, feature, value)]) -> logits

The method is circuit-tracer's (Ameisen et al. 2025, "Circuit Tracing"; github.com/safety-research/
circuit-tracer, `attribution.py`, `graph.py`). Every MLP is replaced by its transcoder plus an error term
(what the transcoder misses at that layer and position), and the prompt's attention patterns and norm
scales are frozen at their values: what remains from the embeddings, the features' decoder writes and the
errors to the encoders' inputs and the logits is linear. The weight of an edge is the direct effect of
its source on its target's pre-activation in that linear model: the target's input direction (an
encoder column; a logit minus the mean logit) backpropagated to where the source writes, dotted with what
it writes (activation x decoder row; the error; the embedding). Each batched backward pass computes the
rows of `batch_size` targets at once, on as many copies of the prompt, so a graph costs one forward and
(targets / batch_size) backward passes, never one pass per edge.

Everything goes through the model's hooks, so both families are handled alike: every `norm_scale` (RMS
and LayerNorm, alpha-er's bottleneck norms and its lm_head's) is frozen by returning its `detach()`
(hooked_models/components/norms.py honours that), every `attention_probabilities` likewise, which also
linearises alpha-er's soft cap (it only shapes the pattern) and its factored projections (linear once
their bottleneck norm is frozen). The MLP outputs are constants of the prompt but for a transcoder's skip
connection, which is linear and stays on the path.

Node order (circuit-tracer's): features (by layer, position, index), errors (layer-major), embeddings
(one per position: the stream entering layer 0, so alpha-er's position embedding is part of it),
logits. Per-head loadings: for each attention layer L, the part of an edge through head h of L (the
backward pass let through that head alone of L) and the part that skips L's attention (none of L's heads
let through); for each L, the heads' parts plus the skip are the edge.
"""

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm import tqdm

from hooked_models.transcoders import CrossLayerTranscoder

# The feature_type strings circuit-tracer's viewer knows (frontend/graph_models.py).
FEATURE_TYPES = ("cross layer transcoder", "mlp reconstruction error", "embedding", "logit")


# ------------------------------------------------------------------------------------------- graph
@dataclass
class AttributionGraph:
    """Nodes and direct-effect edges of one prompt (see the module docstring for the order).

    `active_features [feature 3]`: (layer, position, feature index) of each feature node, with its
    `activation_values`. `adjacency_matrix [node node]`: row = target, column = source. `head_loadings
    [node node layer head]` and `attention_skips [node node layer]`: for each attention layer, the edge
    split over its heads plus the part that skips it (None when not computed). After `prune`,
    `node_mask`, `edge_mask` and `cumulative_influence` say what was kept.
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
    head_loadings: Float[Tensor, "node node layer head"] | None = None
    attention_skips: Float[Tensor, "node node layer"] | None = None
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
        return self.n_layers, self.n_pos - 1

    def node_name(self, i: int) -> str:
        """A name over the vocabulary: `layers.1.mlp.feature.37@4`, `layers.1.mlp.error@4`,
        `embedding@4`, `logits.523@7` (token 523 at the last position)."""
        kind = self.node_kind(i)
        layer, pos = self.node_position(i)
        if kind == "feature":
            return f"layers.{layer}.mlp.feature.{int(self.active_features[i, 2])}@{pos}"
        if kind == "error":
            return f"layers.{layer}.mlp.error@{pos}"
        if kind == "embedding":
            return f"embedding@{pos}"
        return f"logits.{int(self.logit_tokens[i - self.logit_start])}@{pos}"

    @property
    def nodes(self) -> list[str]:
        return [self.node_name(i) for i in range(self.n_nodes)]

    def logit_weights(self) -> Tensor:
        """Each node's weight as an output: the logits' probabilities, zero elsewhere."""
        weights = torch.zeros(self.n_nodes, dtype=self.adjacency_matrix.dtype)
        weights[self.logit_start:] = self.logit_probabilities.to(weights.dtype)
        return weights

    # -------------------------------------------------------------------------- prune and score
    def prune(self, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> "AttributionGraph":
        """The graph with `node_mask`/`edge_mask` set, circuit-tracer's `prune_graph`: keep the nodes
        that carry `node_threshold` of the total influence on the logits (embeddings and logits always),
        then the edges that carry `edge_threshold` of the kept nodes' edge influence, then drop, until
        nothing changes, features without incoming edges and features and errors without outgoing ones.
        Influence: abs(adjacency), each row normalized to sum 1, propagated from the logits' probabilities
        through every path."""
        for name, value in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}={value} must be between 0 and 1")
        weights = self.logit_weights()
        node_influence = _influence(_normalized(self.adjacency_matrix), weights)
        node_mask = node_influence >= _threshold(node_influence, node_threshold)
        node_mask[self.embedding_start:] = True
        kept = self.adjacency_matrix.clone()
        kept[~node_mask] = 0
        kept[:, ~node_mask] = 0
        normalized = _normalized(kept)
        edge_scores = normalized * (_influence(normalized, weights) + weights)[:, None]
        edge_mask = edge_scores >= _threshold(edge_scores.flatten(), edge_threshold)
        edge_mask &= kept != 0
        while True:
            before = node_mask.clone()
            edge_mask[~node_mask] = False
            edge_mask[:, ~node_mask] = False
            # Features and errors need a way out; features a way in.
            node_mask[:self.embedding_start] &= edge_mask[:, :self.embedding_start].any(0)
            node_mask[:self.n_features] &= edge_mask[:self.n_features].any(1)
            if torch.equal(node_mask, before):
                break
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
        normalized = _normalized(self.adjacency_matrix)
        influence = _influence(normalized, weights)
        errors = slice(self.error_start, self.embedding_start)
        token_influence = influence[self.embedding_start:self.logit_start].sum()
        error_influence = influence[errors].sum()
        replacement = token_influence / (token_influence + error_influence).clamp(min=1e-30)
        non_error = 1 - normalized[:, errors].sum(-1)
        output = influence + weights
        completeness = (non_error * output).sum() / output.sum()
        return float(replacement), float(completeness)

    # -------------------------------------------------------------------------------- export
    def to_json(self, path: "str | os.PathLike", slug: str | None = None, node_threshold: float = 0.8,
                edge_threshold: float = 0.98, features=None, labels=None) -> Path:
        """Write the pruned graph (pruned here with the thresholds unless `prune` was called) in
        circuit-tracer's graph-file schema (`frontend/graph_models.py`), which its local viewer and
        Neuronpedia open. Node ids are circuit-tracer's; the file also carries, under `hooked_models`,
        what `from_json` needs to rebuild this graph with every node and edge.

        features: a `features.statistics` result of the graph's transcoders: its nodes' feature files are
        written beside the graph where circuit-tracer's viewer reads them, each node labelled (`clerp`:
        the heuristic label, or the user's from `labels`, a JSON or CSV of layer, feature, label)."""
        pruned = self if self.node_mask is not None else self.prune(node_threshold, edge_threshold)
        path = Path(path)
        slug = slug or path.stem
        nodes = {i: pruned._json_node(i) for i in pruned.node_mask.nonzero().flatten().tolist()}
        targets, sources = pruned.edge_mask.nonzero(as_tuple=True)
        links = [{"source": nodes[s]["node_id"], "target": nodes[t]["node_id"],
                  "weight": float(pruned.adjacency_matrix[t, s])}
                 for t, s in zip(targets.tolist(), sources.tolist()) if s in nodes and t in nodes]
        linked = {link["source"] for link in links} | {link["target"] for link in links}
        data = {
            "metadata": {"slug": slug, "scan": self.model_name or "hooked_models",
                         "transcoder_list": list(self.transcoder_names), "prompt_tokens": pruned._str_tokens(),
                         "prompt": self.prompt, "node_threshold": pruned.node_threshold, "schema_version": 1},
            "qParams": {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""},
            "nodes": [n for n in nodes.values() if n["node_id"] in linked or n["feature_type"] in ("embedding", "logit")],
            "links": links,
            "hooked_models": self._state(),
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        if features is not None:
            from hooked_models.features.circuit_tracer_files import write_beside_graph

            data = write_beside_graph(data, path, features, labels)
        path.write_text(json.dumps(data, indent=1))
        return path

    def _str_tokens(self) -> list[str]:
        return list(self.str_tokens) if self.str_tokens else [str(t) for t in self.tokens.tolist()]

    def _json_node(self, i: int) -> dict:
        kind = self.node_kind(i)
        layer, pos = self.node_position(i)
        influence = None if self.cumulative_influence is None else float(self.cumulative_influence[i])
        node = {"ctx_idx": pos, "token_prob": 0.0, "is_target_logit": False, "run_idx": 0, "reverse_ctx_idx": 0,
                "clerp": "", "influence": influence, "activation": None}
        if kind == "feature":
            feature = int(self.active_features[i, 2])
            # The viewer's feature id: Cantor's pairing of (layer, index), one integer per feature.
            paired = (layer + feature) * (layer + feature + 1) // 2 + feature
            node.update(node_id=f"{layer}_{feature}_{pos}", feature=paired, layer=str(layer),
                        feature_type=FEATURE_TYPES[0], jsNodeId=f"{layer}_{feature}-0",
                        activation=float(self.activation_values[i]))
        elif kind == "error":
            # Index -1, never a feature's, so that no error id aliases a feature's.
            node.update(node_id=f"{layer}_-1_{pos}", feature=-1, layer=str(layer), feature_type=FEATURE_TYPES[1],
                        jsNodeId=f"{layer}_-1-{pos}")
        elif kind == "embedding":
            token = int(self.tokens[pos])
            node.update(node_id=f"E_{token}_{pos}", feature=pos, layer="E", feature_type=FEATURE_TYPES[2],
                        jsNodeId=f"E_{token}-{pos}")
        else:
            k = i - self.logit_start
            token, prob = int(self.logit_tokens[k]), float(self.logit_probabilities[k])
            layer = str(self.n_layers + 1)
            node.update(node_id=f"{layer}_{token}_{pos}", feature=token, layer=layer, feature_type=FEATURE_TYPES[3],
                        jsNodeId=f"L_{token}-{pos}", token_prob=prob, is_target_logit=k == 0,
                        clerp=f'Output "{self._logit_text(k)}" (p={prob:.3f})')
        return node

    def _state(self) -> dict:
        """Everything but the masks, as lists (floats written exactly: JSON keeps a float32's value)."""
        state = {"tokens": self.tokens.tolist(), "active_features": self.active_features.tolist(),
                 "activation_values": self.activation_values.tolist(), "logit_tokens": self.logit_tokens.tolist(),
                 "logit_probabilities": self.logit_probabilities.tolist(),
                 "adjacency_matrix": self.adjacency_matrix.tolist(), "n_layers": self.n_layers,
                 "prompt": self.prompt, "str_tokens": list(self.str_tokens), "model_name": self.model_name,
                 "transcoder_names": list(self.transcoder_names), "logit_str_tokens": list(self.logit_str_tokens)}
        for name in ("head_loadings", "attention_skips"):
            value = getattr(self, name)
            state[name] = None if value is None else {"shape": list(value.shape), "values": value.flatten().tolist()}
        return state

    @classmethod
    def from_json(cls, path: "str | os.PathLike") -> "AttributionGraph":
        """The graph `to_json` wrote, unpruned, every node and edge as it was (float32 exactly)."""
        data = json.loads(Path(path).read_text())
        if "hooked_models" not in data:
            raise ValueError(f"{path} is a graph file without the hooked_models section `to_json` writes; "
                             "only graphs written here can be rebuilt")
        state = data["hooked_models"]
        tensors = dict(tokens=torch.tensor(state["tokens"], dtype=torch.long),
                       active_features=torch.tensor(state["active_features"], dtype=torch.long).reshape(-1, 3),
                       activation_values=torch.tensor(state["activation_values"], dtype=torch.float32),
                       logit_tokens=torch.tensor(state["logit_tokens"], dtype=torch.long),
                       logit_probabilities=torch.tensor(state["logit_probabilities"], dtype=torch.float32))
        n = len(state["adjacency_matrix"])
        adjacency = torch.tensor(state["adjacency_matrix"], dtype=torch.float32).reshape(n, n)
        extra = {}
        for name in ("head_loadings", "attention_skips"):
            value = state.get(name)
            extra[name] = None if value is None else torch.tensor(value["values"], dtype=torch.float32).reshape(value["shape"])
        return cls(**tensors, adjacency_matrix=adjacency, n_layers=state["n_layers"], prompt=state["prompt"],
                   str_tokens=state["str_tokens"], model_name=state["model_name"],
                   transcoder_names=state["transcoder_names"], logit_str_tokens=state["logit_str_tokens"], **extra)

    def plot(self, path: "str | os.PathLike | None" = None, ax=None, title: str | None = None,
             node_threshold: float = 0.8, edge_threshold: float = 0.98):
        """Draw the pruned graph: layers up (embeddings at the bottom, logits at the top), positions
        across, edge width by |weight| (blue positive, red negative). Saved to `path` if given; returns
        the matplotlib Figure."""
        import matplotlib.pyplot as plt

        pruned = self if self.node_mask is not None else self.prune(node_threshold, edge_threshold)
        kept = pruned.node_mask.nonzero().flatten().tolist()
        if ax is None:
            fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * self.n_pos + 1.5), 0.9 * (self.n_layers + 2) + 1.5))
        else:
            fig = ax.figure
        # Nodes sharing a (row, position) cell are spread across it.
        cells: dict[tuple, list[int]] = {}
        for i in kept:
            layer, pos = pruned.node_position(i)
            cells.setdefault((-1 if layer is None else layer, pos), []).append(i)
        xy = {}
        for (row, pos), members in cells.items():
            for k, i in enumerate(members):
                xy[i] = (pos + (k + 1) / (len(members) + 1) - 0.5, row + 1)
        targets, sources = pruned.edge_mask.nonzero(as_tuple=True)
        weights = pruned.adjacency_matrix[targets, sources]
        biggest = float(weights.abs().max()) if weights.numel() else 1.0
        for t, s, w in zip(targets.tolist(), sources.tolist(), weights.tolist()):
            if s in xy and t in xy:
                ax.plot(*zip(xy[s], xy[t]), color="tab:blue" if w > 0 else "tab:red",
                        linewidth=0.3 + 4 * abs(w) / biggest, alpha=0.6, zorder=1)
        colours = {"feature": "tab:orange", "error": "tab:gray", "embedding": "tab:green", "logit": "tab:purple"}
        for kind, colour in colours.items():
            points = [xy[i] for i in kept if pruned.node_kind(i) == kind]
            if points:
                ax.scatter(*zip(*points), s=60, color=colour, edgecolor="black", zorder=2, label=kind)
        crowded = {i for members in cells.values() if len(members) > 4 for i in members}
        for i in kept:  # feature indices where they fit, and the logits' tokens
            if pruned.node_kind(i) == "logit" or (pruned.node_kind(i) == "feature" and i not in crowded):
                label = (str(int(self.active_features[i, 2])) if pruned.node_kind(i) == "feature"
                         else self._logit_label(i - self.logit_start))
                ax.annotate(label, xy[i], textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
        ax.set_xticks(range(self.n_pos), self._str_tokens(), rotation=45, ha="right")
        ax.set_yticks(range(self.n_layers + 2), ["emb", *[f"L{l}" for l in range(self.n_layers)], "logits"])
        ax.set_xlim(-0.7, self.n_pos - 0.3)
        ax.set_ylim(-0.5, self.n_layers + 1.6)
        ax.legend(loc="upper left", fontsize=7, ncol=4)
        ax.set_title(title or f"attribution graph: {len(kept)} nodes, {int(pruned.edge_mask.sum())} edges")
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=120)
        return fig

    def _logit_text(self, k: int) -> str:
        return self.logit_str_tokens[k] if self.logit_str_tokens else str(int(self.logit_tokens[k]))

    def _logit_label(self, k: int) -> str:
        return f"{self._logit_text(k)!r} ({float(self.logit_probabilities[k]):.2f})"

    def __str__(self) -> str:
        pruned = "" if self.node_mask is None else f", pruned to {int(self.node_mask.sum())} nodes"
        return (f"AttributionGraph: {self.n_features} features, {self.n_errors} errors, {self.n_pos} embeddings, "
                f"{self.n_logits} logits; {int((self.adjacency_matrix != 0).sum())} edges{pruned}")


def _normalized(matrix: Tensor) -> Tensor:
    """abs(matrix), each row scaled to sum 1 (rows of zeros stay zero)."""
    matrix = matrix.abs()
    return matrix / matrix.sum(1, keepdim=True).clamp(min=1e-10)


def _influence(normalized: Tensor, weights: Tensor) -> Tensor:
    """weights · (A + A² + A³ + ...): the graph is acyclic (targets read only earlier layers), so
    the series ends after at most as many terms as the graph is deep."""
    total = current = weights @ normalized
    for _ in range(normalized.shape[0]):
        if not bool(current.any()):
            break
        current = current @ normalized
        total = total + current
    return total


def _threshold(scores: Tensor, fraction: float) -> Tensor:
    """The smallest score among the highest ones that together make `fraction` of the total."""
    ordered = scores.sort(descending=True).values
    cumulative = ordered.cumsum(0) / ordered.sum().clamp(min=1e-30)
    return ordered[min(int(torch.searchsorted(cumulative, fraction)), len(ordered) - 1)]


# ----------------------------------------------------------------------------------- the replica
class _GradientGate(torch.autograd.Function):
    """The identity forward; backward, the gradient times `holder.gate` (None: all of it). Lets one
    forward serve backward passes that let different attention heads through."""

    @staticmethod
    def forward(ctx, x: Tensor, holder: "_Gates") -> Tensor:
        ctx.holder = holder
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        gate = ctx.holder.gate
        return (grad if gate is None else grad * gate), None


class _Gates:
    gate: Tensor | None = None


def _frozen(name: str) -> bool:
    """The values frozen at the prompt's: every norm's scale and every attention pattern."""
    return name.endswith(".norm_scale") or name.endswith(".attention_probabilities")


def _freezing_hooks() -> list:
    """Every norm scale and attention pattern frozen at its value: returned detached, which the
    components honour (the forward keeps its bits, the gradient treats them as constants)."""
    return [(_frozen, lambda t, hook: t.detach())]


def _transcoder_names(transcoders) -> list[str]:
    return [transcoders.input_hook(l) for l in range(transcoders.n_layers)]


def _written_layers(transcoders, layer: int) -> range:
    """The layers whose MLP output layer `layer`'s features write: itself, or (a cross-layer
    transcoder, whose `decoder(source, target)` takes any later target) it and every later one."""
    if isinstance(transcoders, CrossLayerTranscoder):
        return range(layer, transcoders.n_layers)
    return range(layer, layer + 1)


def _skip_gradient(transcoders, layer: int, x: Tensor) -> Tensor:
    """An exact zero whose gradient is that of layer `layer`'s skip connection of its input x: added
    to the MLP's clean output, it keeps the output's bits and the skip's linear path."""
    zero = [torch.zeros(*x.shape[:-1], transcoders.d_transcoder, dtype=x.dtype, device=x.device)] * (layer + 1)
    return transcoders.decode_to(layer, zero, x) - transcoders.decode_to(layer, zero, x.detach()).detach()


class _Prompt:
    """The prompt's clean run seen through the transcoders: their inputs, features, and errors. With
    `frozen`, run with the freezing hooks (which keep every value but send attention down its explicit
    path, as in the frozen runs that follow), so that the values here are theirs bit for bit."""

    def __init__(self, model, tokens: Tensor, transcoders, frozen: bool = True):
        self.model, self.tokens, self.transcoders = model, tokens, transcoders
        n = transcoders.n_layers
        self.inputs = [transcoders.input_hook(l) for l in range(n)]
        self.outputs = [transcoders.output_hook(l) for l in range(n)]
        with torch.no_grad(), model.hooks(fwd_hooks=_freezing_hooks() if frozen else []):
            self.logits, cache = model.run_with_cache(tokens, names_filter=[*self.inputs, *self.outputs, "layers.0.layer_input"])
            dtype = transcoders.encoder(0).dtype
            self.x = [cache[name][0].to(dtype) for name in self.inputs]
            self.mlp_out = [cache[name][0] for name in self.outputs]
            self.acts = [transcoders.encode(l, x) for l, x in enumerate(self.x)]
            skip_in = [x if transcoders.has_skip else None for x in self.x]
            self.recons = [transcoders.decode_to(l, self.acts, skip_in[l]) for l in range(n)]
            self.errors = torch.stack([o.to(dtype) - r for o, r in zip(self.mlp_out, self.recons)])
            self.embedding = cache["layers.0.layer_input"][0].to(dtype)
        active = torch.stack(self.acts).nonzero()  # (layer, position, feature), in that order
        self.active = active
        self.activations = torch.stack(self.acts)[tuple(active.T)]

    def salient_logits(self, desired_logit_prob: float, max_n_logits: int) -> tuple[Tensor, Tensor]:
        """The most probable next tokens until their probabilities reach `desired_logit_prob`, at most
        `max_n_logits` (circuit-tracer's `compute_salient_logits`)."""
        probs = torch.softmax(self.logits[0, -1].float(), -1)
        top = probs.sort(descending=True)
        k = int(torch.searchsorted(top.values.cumsum(0), desired_logit_prob)) + 1
        k = min(k, max_n_logits, probs.shape[0])
        return top.indices[:k], top.values[:k]


class _Replica:
    """`batch` copies of the prompt run with everything frozen, kept for backward passes.

    Leaves where the sources write (the stream entering layer 0, each MLP output) and the values the
    targets read (each transcoder's input, the logits). The MLP outputs are their clean values, held as
    leaves, plus the transcoders' skip connections (linear, so on the path)."""

    def __init__(self, prompt: _Prompt, batch: int, head_gates: bool):
        model, tcs = prompt.model, prompt.transcoders
        self.prompt, self.reads, self.out_leaves, self.gates = prompt, {}, {}, {}
        self.embedding_leaf = None

        def embedding(t, hook):
            self.embedding_leaf = t.detach().requires_grad_()
            return self.embedding_leaf

        def read(t, hook, layer):
            self.reads[layer] = t

        def write(t, hook, layer):
            leaf = t.detach().requires_grad_()
            self.out_leaves[layer] = leaf
            if not tcs.has_skip:
                return leaf
            skip = _skip_gradient(tcs, layer, self.reads[layer].to(tcs.encoder(0).dtype))
            return leaf + skip.to(t.dtype)

        def gate(t, hook, layer):
            self.gates[layer] = _Gates()
            return _GradientGate.apply(t, self.gates[layer])

        hooks = [*_freezing_hooks(), ("layers.0.layer_input", embedding)]
        for l in range(tcs.n_layers):
            hooks += [(prompt.inputs[l], lambda t, hook, l=l: read(t, hook, l)),
                      (prompt.outputs[l], lambda t, hook, l=l: write(t, hook, l))]
            if head_gates:
                hooks.append((f"layers.{l}.self_attn.attention_head_outputs", lambda t, hook, l=l: gate(t, hook, l)))
        # No parameter gradients, the model's or the transcoders': the graph is built for the leaves alone.
        params = [p for module in (model, tcs) for p in module.parameters() if p.requires_grad]
        try:
            for p in params:
                p.requires_grad_(False)
            with torch.enable_grad():
                self.logits = model.run_with_hooks(prompt.tokens.expand(batch, -1), fwd_hooks=hooks)
        finally:
            for p in params:
                p.requires_grad_(True)

    def columns(self, grad_inputs: dict, grad_logits: Tensor | None) -> Tensor:
        """Rows of the adjacency for the targets whose input directions are given: `grad_inputs[l]`
        [batch seq d_in] at transcoder l's input, `grad_logits` [batch seq vocab] at the logits.
        Columns: features, errors, embeddings (logits, which write nothing, are left out)."""
        outputs = [self.reads[l] for l in grad_inputs] + ([self.logits] if grad_logits is not None else [])
        grads_out = [g.to(o.dtype) for g, o in zip([*grad_inputs.values(), grad_logits], outputs)]
        leaves = [self.embedding_leaf, *[self.out_leaves[l] for l in range(len(self.out_leaves))]]
        grads = torch.autograd.grad(outputs, leaves, grads_out, retain_graph=True, allow_unused=True)
        grads = [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves)]
        # The rows are numbers: under no_grad, so that no graph (through a transcoder's weights that
        # require grad) keeps this pass's gradients alive past it.
        with torch.no_grad():
            return self._rows_of(grads)

    def _rows_of(self, grads: Sequence[Tensor]) -> Float[Tensor, "batch source"]:
        """The rows from the gradients at the leaves: each source's write dotted with its leaf's gradient."""
        prompt, tcs = self.prompt, self.prompt.transcoders
        dtype = prompt.errors.dtype
        g_embedding, g_out = grads[0].to(dtype), [g.to(dtype) for g in grads[1:]]
        embeddings = (g_embedding * prompt.embedding).sum(-1)
        errors = torch.einsum("lbsd,lsd->bls", torch.stack(g_out), prompt.errors).flatten(1)
        features = torch.zeros(g_embedding.shape[0], prompt.active.shape[0], dtype=dtype, device=g_embedding.device)
        for layer in range(tcs.n_layers):
            rows = (prompt.active[:, 0] == layer).nonzero().flatten()
            if not rows.numel():
                continue
            pos, ids = prompt.active[rows, 1], prompt.active[rows, 2]
            # One matrix product per position (nonzero() ordered the rows by position): gathering the
            # gradient at each feature's position would copy [batch feature hidden_size], 10x slower.
            positions, counts = pos.unique_consecutive(return_counts=True)
            direct = 0
            for t in _written_layers(tcs, layer):
                decoders = tcs.decoder(layer, t)[ids].to(dtype).split(counts.tolist())
                direct = direct + torch.cat([g_out[t][:, p] @ d.T for p, d in zip(positions.tolist(), decoders)], 1)
            features[:, rows] = direct * prompt.activations[rows]
        return torch.cat([features, errors, embeddings], 1)


@dataclass
class _Target:
    """A node whose row is computed: where it reads (a transcoder layer, or None: the logits), at
    which position, along which direction."""

    layer: int | None
    pos: int
    direction: Tensor


def _directions(replica: _Replica, targets: Sequence[_Target]) -> tuple[dict, Tensor | None]:
    """The targets' input directions as gradients: [batch seq d_in] at each transcoder input read,
    [batch seq vocab] at the logits (target b in copy b of the prompt)."""
    tcs = replica.prompt.transcoders
    batch, seq = replica.logits.shape[:2]
    device = replica.logits.device
    grad_inputs, grad_logits = {}, None
    for b, target in enumerate(targets):
        if target.layer is None:
            if grad_logits is None:
                grad_logits = torch.zeros(replica.logits.shape, dtype=target.direction.dtype, device=device)
            grad_logits[b, target.pos] = target.direction.to(device)
        else:
            if target.layer not in grad_inputs:
                grad_inputs[target.layer] = torch.zeros(batch, seq, tcs.d_in, dtype=target.direction.dtype, device=device)
            grad_inputs[target.layer][b, target.pos] = target.direction.to(device)
    return grad_inputs, grad_logits


def _rows(replica: _Replica, targets: Sequence[_Target]) -> Float[Tensor, "target source"]:
    return replica.columns(*_directions(replica, targets))[:len(targets)]


def _head_parts(replica: _Replica, targets: Sequence[_Target], n_heads: int, columns: Tensor, rows: Tensor,
                loadings: Tensor, skips: Tensor) -> None:
    """Write the targets' per-head loadings and skips over the source `columns` into `loadings[rows]`
    and `skips[rows]`: per attention layer, one backward pass per head (that head alone let through)
    and one with none let through (the part that skips the layer). Nothing wider than one pass's rows
    [target source] is held besides the graph's own tensors."""
    grad_inputs, grad_logits = _directions(replica, targets)
    device, n, k = replica.logits.device, len(targets), len(columns)
    for layer, holder in replica.gates.items():
        try:
            for head in range(n_heads, -1, -1):  # head n_heads first: none let through, the skip
                holder.gate = torch.zeros(n_heads, 1, device=device)
                if head < n_heads:
                    holder.gate[head] = 1
                part = replica.columns(grad_inputs, grad_logits)[:n, columns].cpu()
                if head == n_heads:
                    skips[rows, :k, layer] = part.to(skips.dtype)
                else:
                    # A pass letting head h through also carries what skips the layer: counted once, apart.
                    loadings[rows, :k, layer, head] = (part - skips[rows, :k, layer].to(part.dtype)).to(loadings.dtype)
        finally:
            holder.gate = None


def _check_arguments(model, tokens: Tensor, transcoders, max_feature_nodes, desired_logit_prob, max_n_logits,
                     batch_size) -> None:
    if transcoders.d_in != model.cfg.hidden_size or transcoders.d_out != model.cfg.hidden_size:
        raise ValueError(f"the transcoders read {transcoders.d_in}-wide inputs and write {transcoders.d_out}-wide "
                         f"outputs; this model's MLPs read and write hidden_size={model.cfg.hidden_size}")
    transcoders.check_model(model)
    if tokens.shape[1] > model.max_positions:
        raise ValueError(f"the prompt is {tokens.shape[1]} tokens; this model computes at most "
                         f"{model.max_positions} positions")
    if max_feature_nodes is not None and (isinstance(max_feature_nodes, bool) or not isinstance(max_feature_nodes, int)
                                          or max_feature_nodes < 1):
        raise ValueError(f"max_feature_nodes={max_feature_nodes!r} must be a positive integer (None: every active "
                         "feature)")
    if not 0.0 < desired_logit_prob <= 1.0:
        raise ValueError(f"desired_logit_prob={desired_logit_prob} must be in (0, 1]")
    for name, value in (("max_n_logits", max_n_logits), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")


def _tokens(model, prompt) -> Tensor:
    """[1 seq] token ids of a string (tokenized whole: a prompt too long is refused, not truncated)
    or of ids given as a list or tensor."""
    if isinstance(prompt, str):
        return model.to_tokens(prompt, truncate=False)
    tokens = torch.as_tensor(prompt)
    if tokens.ndim == 2 and tokens.shape[0] == 1:
        tokens = tokens[0]
    if tokens.ndim != 1 or tokens.is_floating_point() or not tokens.numel():
        raise ValueError(f"prompt must be text or one sequence of token ids, got shape {tuple(tokens.shape)}")
    return tokens.long()[None].to(model.cfg.device)


def attribute(model, prompt, transcoders, *, max_feature_nodes: int | None = None, desired_logit_prob: float = 0.95,
              max_n_logits: int = 10, batch_size: int = 32, progress: bool = False,
              head_loadings: bool = True) -> AttributionGraph:
    """The attribution graph of `prompt` (text or token ids) through `transcoders` (a TranscoderSet or
    CrossLayerTranscoder trained for `model`): see the module docstring.

    `max_feature_nodes`: compute the rows of at most this many features, chosen as circuit-tracer
    chooses them (by their influence on the logits, estimated from the rows computed so far, in
    batches); the others are not nodes. `batch_size`: targets per backward pass (and copies of the
    prompt held for them). `head_loadings`: also split every edge over each attention layer's heads
    (one more backward pass per head and layer, plus one per layer, for the graph's rows only).

    Memory above the model and transcoders: `batch_size` copies of one frozen forward, one backward
    pass's gradients at the leaves, the computed rows (targets x sources: with `max_feature_nodes`,
    only the rows computed) and the graph (nodes², with head loadings nodes² x layers x (heads + 1)).
    No parameter gradients; nothing outlives a backward pass but its rows.
    """
    tokens = _tokens(model, prompt)
    _check_arguments(model, tokens, transcoders, max_feature_nodes, desired_logit_prob, max_n_logits, batch_size)
    state = _Prompt(model, tokens, transcoders)
    logit_tokens, logit_probs = state.salient_logits(desired_logit_prob, max_n_logits)
    n_active = state.active.shape[0]
    n_layers, seq = transcoders.n_layers, tokens.shape[1]
    n_sources = n_active + n_layers * seq + seq
    dtype = state.errors.dtype

    replica = _Replica(state, batch_size, head_loadings)
    n_heads = model.cfg.n_heads
    vocab = state.logits.shape[-1]

    def logit_target(token: int) -> _Target:
        direction = -torch.full((vocab,), 1.0 / vocab, dtype=dtype)  # the logit minus the mean logit
        direction[token] += 1
        return _Target(None, seq - 1, direction)

    def feature_target(i: int) -> _Target:
        layer, pos, feature = state.active[i].tolist()
        return _Target(layer, pos, transcoders.encoder(layer)[:, feature].detach().to(dtype))

    bar = tqdm(desc="attribution", unit="target", disable=not progress)
    computed: dict = {}  # target key -> its row over every source

    def target(key) -> _Target:
        return logit_target(int(key[1])) if key[0] == "logit" else feature_target(key[1])

    def compute(keys: list) -> None:
        for start in range(0, len(keys), batch_size):
            chunk = keys[start:start + batch_size]
            rows = _rows(replica, [target(k) for k in chunk]).cpu()  # the graph is assembled on the CPU
            for j, key in enumerate(chunk):
                computed[key] = rows[j].clone()  # its own storage: the batch's rows go with the batch
            bar.update(len(chunk))

    logit_keys = [("logit", int(t)) for t in logit_tokens]
    if max_feature_nodes is None or max_feature_nodes >= n_active:
        bar.reset(total=len(logit_keys) + n_active)
        compute(logit_keys)
        compute([("feature", i) for i in range(n_active)])
        selected = torch.arange(n_active)
    else:
        bar.reset(total=len(logit_keys) + max_feature_nodes)
        compute(logit_keys)
        selected = _select_features(computed, logit_keys, logit_probs, n_active, max_feature_nodes, batch_size, compute)

    # Assemble over the selected features: columns of the others dropped, each row released as placed.
    keep_columns = torch.cat([selected, torch.arange(n_active, n_sources)])
    n_nodes = len(selected) + n_layers * seq + seq + len(logit_keys)
    adjacency = torch.zeros(n_nodes, n_nodes, dtype=dtype)
    placed = [*zip(range(len(selected)), [("feature", int(i)) for i in selected]),
              *zip(range(n_nodes - len(logit_keys), n_nodes), logit_keys)]
    for r, key in placed:
        adjacency[r, :len(keep_columns)] = computed.pop(key)[keep_columns]
    loadings = skips = None
    if head_loadings:  # the graph's rows only, its columns only, written in place batch by batch
        loadings = torch.zeros(n_nodes, n_nodes, n_layers, n_heads, dtype=dtype)
        skips = torch.zeros(n_nodes, n_nodes, n_layers, dtype=dtype)
        for start in range(0, len(placed), batch_size):
            chunk = placed[start:start + batch_size]
            _head_parts(replica, [target(key) for _, key in chunk], n_heads, keep_columns,
                        torch.tensor([r for r, _ in chunk]), loadings, skips)
    bar.close()
    try:
        str_tokens, logit_str_tokens = model.to_str_tokens(tokens[0]), model.to_str_tokens(logit_tokens)
    except ValueError:  # no tokenizer: the ids stand for themselves
        str_tokens, logit_str_tokens = [str(t) for t in tokens[0].tolist()], []
    return AttributionGraph(
        tokens=tokens[0].cpu(), active_features=state.active[selected].cpu(),
        activation_values=state.activations[selected].detach().cpu(), logit_tokens=logit_tokens.cpu(),
        logit_probabilities=logit_probs.cpu(), adjacency_matrix=adjacency.detach().cpu(), n_layers=n_layers,
        prompt=prompt if isinstance(prompt, str) else "", str_tokens=str_tokens,
        model_name=str(getattr(model.cfg, "model_name", "")), transcoder_names=_transcoder_names(transcoders),
        logit_str_tokens=logit_str_tokens,
        head_loadings=None if loadings is None else loadings.detach().cpu(),
        attention_skips=None if skips is None else skips.detach().cpu())


def _select_features(computed: dict, logit_keys: list, logit_probs: Tensor, n_active: int, budget: int,
                     batch_size: int, compute) -> Tensor:
    """circuit-tracer's feature selection: rank the features not yet computed by their influence on the
    logits through the rows computed so far, compute the top batch, repeat until `budget` are. Only the
    computed rows are held ([computed source], never a dense [source source] matrix)."""
    done: list[int] = []
    while len(done) < budget:
        rows = torch.stack([computed[key] for key in [*logit_keys, *[("feature", i) for i in done]]]).float()
        own_column = torch.tensor([-1] * len(logit_keys) + done, dtype=torch.long)
        weights = torch.cat([logit_probs.float().cpu(), torch.zeros(len(done))])
        influence = _influence_of_rows(_normalized(rows), own_column, weights)[:n_active]
        influence[done] = -1
        take = influence.argsort(descending=True)[:min(batch_size, budget - len(done))].tolist()
        compute([("feature", i) for i in take])
        done.extend(take)
    return torch.tensor(sorted(done), dtype=torch.long)


def _influence_of_rows(normalized: Float[Tensor, "row source"], own_column: Int[Tensor, " row"],
                       weights: Float[Tensor, " row"]) -> Float[Tensor, " source"]:
    """`_influence` of a graph of which only these rows are nonzero: row r is node `own_column[r]` as a
    source (-1: a logit, no source), `weights` the rows' output weights. The same series, each step
    carried from the sources back to the rows that are those sources."""
    total = current = weights @ normalized
    is_source = own_column >= 0
    for _ in range(normalized.shape[0]):
        at_rows = torch.zeros_like(weights)
        at_rows[is_source] = current[own_column[is_source]]
        if not bool(at_rows.any()):
            break
        current = at_rows @ normalized
        total = total + current
    return total


# ----------------------------------------------------------------------------------- intervention
def feature_intervention(model, prompt, transcoders, interventions: Sequence[tuple[int, int, int, float]], *,
                         freeze_attention: bool = True) -> Float[Tensor, "seq vocab"]:
    """The logits of the replacement model (transcoders with their error terms fixed at the prompt's
    values) with each (layer, position, feature, value) set: that feature's activation is `value`, and
    every later feature responds, computed by its transcoder from its live input. With
    `freeze_attention`, attention patterns and norm scales keep their prompt values (the model in which
    the graph's edges are direct effects, apart from the features' nonlinearity); without, they move.
    With no intervention the logits are the model's bit for bit (with `freeze_attention`, as the model
    computes them with attention explicit, which any hook on the pattern makes it)."""
    tokens = _tokens(model, prompt)
    _check_arguments(model, tokens, transcoders, None, 0.5, 1, 1)
    state = _Prompt(model, tokens, transcoders, frozen=freeze_attention)
    seq, n_layers = tokens.shape[1], transcoders.n_layers
    by_layer: dict[int, list] = {}
    for item in interventions:
        layer, pos, feature, value = item
        if not (0 <= layer < n_layers and 0 <= pos < seq and 0 <= feature < transcoders.d_transcoder):
            raise ValueError(f"intervention {item}: layer must be in [0, {n_layers}), position in [0, {seq}), "
                             f"feature in [0, {transcoders.d_transcoder})")
        by_layer.setdefault(layer, []).append((pos, feature, value))
    hooks = []
    if freeze_attention:
        with torch.no_grad():
            _, frozen = model.run_with_cache(tokens, names_filter=_frozen)
        hooks.append((_frozen, lambda t, hook: frozen[hook.name].to(t.dtype)))
    live: dict[int, Tensor] = {}
    acts: list[Tensor] = [None] * n_layers

    def read(t, hook, layer):
        live[layer] = t[0].to(state.x[0].dtype)
        a = transcoders.encode(layer, live[layer]).clone()
        for pos, feature, value in by_layer.get(layer, []):
            a[pos, feature] = value
        acts[layer] = a

    def write(t, hook, layer):
        recons = transcoders.decode_to(layer, acts[:layer + 1] + [torch.zeros_like(acts[layer])] * (n_layers - layer - 1),
                                       live[layer] if transcoders.has_skip else None)
        # The clean output minus what the reconstruction moved: exactly the clean output when nothing did.
        out = state.mlp_out[layer].to(recons.dtype) - (state.recons[layer] - recons)
        return out.to(t.dtype)[None]

    for l in range(n_layers):
        hooks += [(state.inputs[l], lambda t, hook, l=l: read(t, hook, l)),
                  (state.outputs[l], lambda t, hook, l=l: write(t, hook, l))]
    with torch.no_grad():
        return model.run_with_hooks(tokens, fwd_hooks=hooks)[0]
