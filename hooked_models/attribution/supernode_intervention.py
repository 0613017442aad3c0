"""Interventions that test a subgraph: each part's members scaled, what every other part and the outputs
do, measured in the replacement model beside the graph's linear prediction (the step that turns a
supernode picture into a claim, as in Lindsey et al. 2025's inhibition and steering experiments).

    table = intervene_supernodes(model, prompt, transcoders, subgraph, scales=(-1, 0, 2))
    table.to_frame()          # mode, intervened, scale, outcome, clean, measured, predicted
    table.plot("interventions.png")
"""

import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from hooked_models.attribution import subgraph_plot
from hooked_models.attribution.intervention import Edit, replacement_runs
from hooked_models.attribution.replacement import Prompt, check_prompt, prompt_tokens
from hooked_models.progress import ProgressArg, tracker

# The two runs, by name: which is which.
MODES = {
    "frozen": "attention patterns and norm scales frozen at the prompt's: the replacement model whose direct "
              "effects the graph's edges are, where its prediction is exact while no feature turns on or off",
    "free": "attention patterns and norm scales recomputed: the replacement model run freely (errors fixed), "
            "whose effects the graph does not claim to predict",
}


@dataclass(frozen=True)
class Row:
    """One outcome of one intervention: part `intervened`'s members scaled by `scale` in run `mode`;
    `outcome` (another part: the sum of its members' activations and output values; or an output: a
    token's logit minus the mean logit, or a logit difference) was `clean` and moved by `measured`;
    the graph predicted `predicted` (the same for both modes: the graph is the frozen model's)."""

    mode: str
    intervened: str
    scale: float
    outcome: str
    clean: float
    measured: float
    predicted: float


@dataclass
class SupernodeInterventions:
    """`intervene_supernodes`'s table: its rows, and the modes run (`MODES` says which is which)."""

    rows: list[Row]
    modes: tuple[str, ...]

    def to_frame(self):
        """The rows as a pandas DataFrame."""
        import pandas as pd

        return pd.DataFrame([vars(r) for r in self.rows], columns=list(Row.__dataclass_fields__))

    def describe(self, mode: str) -> str:
        return f"{mode}: {MODES[mode].split(':')[0]}"

    def plot(self, path=None, mode: str | None = None):
        """The standard figure for one mode (the first run, unless named): a panel per intervened part and
        scale, each other part's and output's change measured beside the graph's prediction."""
        return subgraph_plot.plot_interventions(self, path, mode)

    def __str__(self) -> str:
        lines = [f"{'mode':7} {'intervened':24} {'scale':>6} {'outcome':28} {'clean':>10} {'measured':>10} "
                 f"{'predicted':>10}"]
        lines += [f"{r.mode:7} {r.intervened[:24]:24} {r.scale:6g} {r.outcome[:28]:28} {r.clean:10.4g} "
                  f"{r.measured:10.4g} {r.predicted:10.4g}" for r in self.rows]
        return "\n".join(lines)


def intervene_supernodes(model, prompt, transcoders, subgraph, scales=(-1.0, 0.0, 2.0), *,
                         parts: Sequence[str] | None = None, modes: Sequence[str] = ("frozen", "free"),
                         logit_diff: tuple | None = None, batch_size: int | None = None,
                         progress: ProgressArg = False) -> SupernodeInterventions:
    """For each part of `subgraph` (a `Subgraph` of the graph of `prompt` through `transcoders`) and each
    scale: its members' activations multiplied by the scale at their positions and held there (a feature
    set to scale x its activation in that run, as `feature_intervention` sets it; an error term or an
    embedding scaled; output nodes are not intervened on), every later feature responding, in the
    replacement model (`feature_intervention`'s: errors fixed). `modes`: "frozen" and/or "free" (`MODES`).

    Reported (`SupernodeInterventions`): the change of every other part (the sum of its members'
    activations, and of its output nodes' values) and of each output node that is a token (its logit minus
    the mean logit), and with `logit_diff=(a, b)` (tokens or strings) of logit a minus logit b at the last
    position; beside each, the graph's linear prediction (`subgraph.linear_response`; the difference's is
    a's minus b's where both are output nodes, else NaN). `parts`: the names intervened on (default:
    every part with a member that is not an output). Every (part, scale) case and a clean row run in
    one batched forward per mode (`batch_size`: at most that many cases per forward; `progress` advances
    per forward, and a `Cancelled` stops between them with no hook left on the model)."""
    graph = subgraph.graph
    scales = _checked_scales(scales)
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: the modes are {list(MODES)}")
    if not modes:
        raise ValueError("modes=() runs nothing: name 'frozen', 'free' or both")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size={batch_size!r} must be a positive integer (None: every case in one batch)")
    tokens = prompt_tokens(model, prompt)
    check_prompt(model, tokens, transcoders)
    if tokens.shape[1] != graph.n_pos or not torch.equal(tokens[0].cpu(), graph.tokens.cpu()):
        raise ValueError("the prompt is not the subgraph's graph's prompt: intervene on the prompt the graph was "
                         "attributed for")
    if transcoders.n_layers != graph.n_layers or (graph.n_features and
                                                  int(graph.active_features[:, 2].max()) >= transcoders.d_transcoder):
        raise ValueError(f"the transcoders ({transcoders.n_layers} layers of {transcoders.d_transcoder} features) are "
                         f"not the graph's ({graph.n_layers} layers, features up to "
                         f"{int(graph.active_features[:, 2].max()) if graph.n_features else 0})")
    chosen = _chosen_parts(subgraph, parts)
    outputs = _outputs(model, graph, logit_diff)
    cases = [(part, scale) for part in chosen for scale in scales]
    size = batch_size or len(cases)
    chunks = [cases[i:i + size] for i in range(0, len(cases), size)]
    rows: list[Row] = []
    predicted = {(p.name, s): _predicted(subgraph, p.name, s, outputs) for p, s in cases}
    with tracker(progress, total=len(chunks) * len(modes), desc="supernode interventions", unit="batch",
                 long=False) as track:
        for mode in modes:
            state = Prompt(model, tokens, transcoders, frozen=mode == "frozen")
            for chunk in chunks:
                edits = [Edit()] + [_edit(graph, part, scale) for part, scale in chunk]
                logits, acts = replacement_runs(state, edits, freeze_attention=mode == "frozen")
                values = _values(subgraph, outputs, logits, acts)  # [batch outcome]
                for b, (part, scale) in enumerate(chunk, start=1):
                    parts_predicted, outputs_predicted = predicted[(part.name, scale)]
                    expected = torch.cat([parts_predicted, outputs_predicted])
                    for k, name in enumerate([p.name for p in subgraph.parts] + [o[0] for o in outputs]):
                        if name != part.name:
                            rows.append(Row(mode, part.name, scale, name, float(values[0, k]),
                                            float(values[b, k] - values[0, k]), float(expected[k])))
                track.advance()
    return SupernodeInterventions(rows, tuple(modes))


def _checked_scales(scales) -> list[float]:
    if isinstance(scales, (str, bytes)) or not isinstance(scales, Iterable):
        raise ValueError(f"scales={scales!r} must be a list of numbers, e.g. (-1, 0, 2)")
    out = []
    for s in scales:
        if isinstance(s, bool) or not isinstance(s, numbers.Real) or s != s or s in (float("inf"), float("-inf")):
            raise ValueError(f"scale {s!r} is not a finite number; scales multiply activations, e.g. (-1, 0, 2)")
        out.append(float(s))
    if not out:
        raise ValueError("scales=() asks for no intervention; give at least one number")
    return out


def _chosen_parts(subgraph, names):
    graph = subgraph.graph
    can = [p for p in subgraph.parts if any(graph.node_kind(i) != "logit" for i in p.nodes)]
    if names is None:
        return can
    if isinstance(names, str):
        names = [names]
    chosen = []
    for name in names:
        part = subgraph.part(name)
        if part not in can:
            raise ValueError(f"part {name!r} holds only output nodes, which nothing reads: nothing to intervene on")
        chosen.append(part)
    return chosen


def _outputs(model, graph, logit_diff) -> list[tuple[str, tuple, int, tuple | None]]:
    """The outputs measured: (name, its token (a logit minus the mean logit) or pair of tokens (a
    difference), position, the output nodes whose predictions it is (or subtracts; None: no such))."""
    vocab = model.cfg.vocab_size
    out = []
    for k in range(graph.n_logits):
        token = int(graph.logit_tokens[k])
        if token >= 0:
            _, pos = graph.node_position(graph.logit_start + k)
            out.append((f"logit {graph.logit_text(k)!r}", (token,), pos, (k,)))
    if logit_diff is not None:
        if not (isinstance(logit_diff, tuple) and len(logit_diff) == 2):
            raise ValueError(f"logit_diff={logit_diff!r} must be a pair of tokens (ids or one-token strings)")
        ids = []
        for t in logit_diff:
            if isinstance(t, str):
                t = model.to_single_token(t)
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"logit_diff={logit_diff!r}: {t!r} is not a token id in [0, {vocab})")
            ids.append(t)
        tokens = graph.logit_tokens.tolist()
        pair = (tokens.index(ids[0]), tokens.index(ids[1])) if all(i in tokens for i in ids) else None
        names = [model.to_str_tokens([i])[0] if getattr(model, "tokenizer", None) else str(i) for i in ids]
        out.append((f"logit {names[0]!r} - {names[1]!r}", tuple(ids), graph.n_pos - 1, pair))
    return out


def _edit(graph, part, scale: float) -> Edit:
    """The edit that scales `part`'s members: features set to scale x their activation in the clean row
    of the same batch (the run's own clean values, bit for bit those of `state` on a model whose batched
    forward is its unbatched one), error terms and embeddings multiplied."""
    edit = Edit()
    for i in part.nodes:
        kind = graph.node_kind(i)
        layer, pos = graph.node_position(i)
        if kind == "feature":
            edit.scaled.append((layer, pos, int(graph.active_features[i, 2]), scale))
        elif kind == "error":
            edit.errors.append((layer, pos, scale))
        elif kind == "embedding":
            edit.embeddings.append((pos, scale))
    return edit


def _values(subgraph, outputs, logits: Tensor, acts: list[Tensor]) -> Tensor:
    """[batch outcome]: each part's value (its features' activations plus its token outputs' logit minus
    the mean logit), then each output's, in the runs' dtype."""
    graph = subgraph.graph
    demeaned = logits - logits.mean(-1, keepdim=True)
    columns = []
    for part in subgraph.parts:
        total = torch.zeros(logits.shape[0], dtype=acts[0].dtype, device=logits.device)
        for i in part.nodes:
            kind = graph.node_kind(i)
            if kind == "feature":
                layer, pos, feature = graph.active_features[i].tolist()
                total = total + acts[layer][:, pos, feature]
            elif kind == "logit" and int(graph.logit_tokens[i - graph.logit_start]) >= 0:
                _, pos = graph.node_position(i)
                total = total + demeaned[:, pos, int(graph.logit_tokens[i - graph.logit_start])].to(total.dtype)
        columns.append(total)
    # Elementwise, never a matrix-vector product: one row's value must not depend on its place in the batch.
    for _, tokens, pos, _ in outputs:
        value = demeaned[:, pos, tokens[0]] if len(tokens) == 1 else logits[:, pos, tokens[0]] - logits[:, pos, tokens[1]]
        columns.append(value.to(acts[0].dtype))
    return torch.stack(columns, 1)


def _predicted(subgraph, name: str, scale: float, outputs) -> tuple[Tensor, Tensor]:
    parts, logits = subgraph.predict(name, scale)
    values = []
    for _, _, _, nodes in outputs:
        if nodes is None:
            values.append(float("nan"))
        elif len(nodes) == 1:
            values.append(float(logits[nodes[0]]))
        else:
            values.append(float(logits[nodes[0]] - logits[nodes[1]]))
    return parts, torch.tensor(values, dtype=torch.float64)
