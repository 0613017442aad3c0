"""The model's graph: writer and reader nodes over the standard vocabulary, the hooks holding them, its edges,
and the runs that read the nodes' values."""

import difflib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from hooked_models.patching.inputs import _runs

Edge = tuple[str, str]


# ------------------------------------------------------------------------------------------- layout
@dataclass
class _Hook:
    """A hook point that holds some nodes' values: one slot per head along its head axis (one slot for a
    [batch seq hidden_size] value), the node each slot stands for, and when in the forward it fires.

    `nodes[slot]` is a node index, or a list of node indices by expert when the node depends on the
    position (`router(seq)` gives each position's expert).
    """

    name: str
    nodes: list
    step: int
    router: object = None
    head_axis: bool = True

    def nodes_at(self, seq: int, device=None) -> Tensor:
        """[slots seq]: the node each slot stands for at each position."""
        if self.router is None:
            return torch.tensor(self.nodes, device=device)[:, None].expand(len(self.nodes), seq)
        experts = self.router(seq).to(device)
        return torch.tensor(self.nodes, device=device)[:, experts]


class _Layout:
    """The graph of a model: writer and reader nodes in forward order, the hooks holding them, its edges."""

    def __init__(self, model):
        cfg = model.cfg
        heads, kv_heads = cfg.n_heads, getattr(cfg, "n_key_value_heads", None) or cfg.n_heads
        self.writers: list[str] = []
        self.readers: list[str] = []
        self.writer_hooks: list[_Hook] = []
        self.reader_hooks: list[_Hook] = []
        self.step: dict[str, int] = {}  # node -> when it writes or reads
        self.expert: dict[str, int | None] = {}
        self.sizes = dict(num_layers=cfg.n_layers, num_heads=heads, num_kv_heads=kv_heads, experts=0)
        missing = [n for n in ("layers.0.self_attn.attention_query_inputs", "layers.0.mlp_residual_input",
                               "layers.0.self_attn.attention_head_results") if n not in model.standard_hook_dict]
        if missing:
            raise ValueError(f"{type(model).__name__} has no {', '.join(missing)}: circuits need per-head results "
                             "and split inputs (hooked_models.components' attention and PreNormBlock)")

        def add(kind: str, hook: str, names: list, step: int, router=None, head_axis=True) -> None:
            nodes, table = (self.writers, self.writer_hooks) if kind == "writer" else (self.readers, self.reader_hooks)
            indices = []
            for name in names:
                group = name if isinstance(name, list) else [name]
                for n in group:
                    self.step[n] = step
                    self.expert[n] = int(n.rpartition(".")[2]) if ".expert." in n else None
                    nodes.append(n)
                ids = list(range(len(nodes) - len(group), len(nodes)))
                indices.append(ids if isinstance(name, list) else ids[0])
            table.append(_Hook(hook, indices, step, router, head_axis))

        add("writer", "layers.0.layer_input", ["input"], 0, head_axis=False)
        for i in range(cfg.n_layers):
            attn, step = f"layers.{i}.self_attn", 1 + 4 * i
            add("reader", f"{attn}.attention_query_inputs", [f"{attn}.head.{h}.q" for h in range(heads)], step)
            for part, value in (("k", "attention_key_inputs"), ("v", "attention_value_inputs")):
                add("reader", f"{attn}.{value}", [f"{attn}.kv_head.{j}.{part}" for j in range(kv_heads)], step)
            add("writer", f"{attn}.attention_head_results", [f"{attn}.head.{h}" for h in range(heads)], step + 1)
            mlp = model.get_submodule(f"layers.{i}.mlp")
            router = getattr(mlp, "expert_index", None)
            if callable(router):  # positional experts: the node depends on the position
                self.sizes["experts"] = mlp.experts
                names = [[f"layers.{i}.mlp.expert.{g}" for g in range(mlp.experts)]]
            else:
                router, names = None, [f"layers.{i}.mlp"]
            add("reader", f"layers.{i}.mlp_residual_input", names, step + 2, router, head_axis=False)
            add("writer", f"layers.{i}.mlp.mlp_output", names, step + 3, router, head_axis=False)
        add("reader", f"layers.{cfg.n_layers - 1}.layer_output", ["logits"], 1 + 4 * cfg.n_layers, head_axis=False)
        self.writer_index = {n: i for i, n in enumerate(self.writers)}
        self.reader_index = {n: i for i, n in enumerate(self.readers)}
        self.edges: list[Edge] = [(w, r) for r in self.readers for w in self.writers if self.connects(w, r)]
        self.edge_index = {e: i for i, e in enumerate(self.edges)}

    def connects(self, writer: str, reader: str) -> bool:
        """Whether the writer's output reaches the reader's input through the residual stream."""
        ew, er = self.expert[writer], self.expert[reader]
        return self.step[writer] < self.step[reader] and (ew is None or er is None or ew == er)

    def check(self, edge, model_name: str) -> Edge:
        """The edge as a (writer, reader) tuple, or a ValueError that says what is wrong with it."""
        if not (isinstance(edge, (tuple, list)) and len(edge) == 2 and all(isinstance(n, str) for n in edge)):
            raise ValueError(f"an edge is a (writer, reader) pair of node names, not {edge!r}")
        writer, reader = edge
        for name, known, role in ((writer, self.writer_index, "writer"), (reader, self.reader_index, "reader")):
            if name not in known:
                close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
                hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
                raise ValueError(f"{name!r} is not a {role} of {model_name}'s graph{hint}")
        if (writer, reader) not in self.edge_index:
            why = ("reads at other positions" if self.step[writer] < self.step[reader] else "reads before it writes")
            raise ValueError(f"({writer!r}, {reader!r}) is not an edge of {model_name}'s graph: the reader {why}")
        return writer, reader


def transformer_lens_node(model, node, seq: int) -> str:
    """The node name here of a TransformerLens `attribution_patching.Node` (kind, layer, head, position):
    an MLP node of a positional-expert MLP is the expert that owns its position (`seq` long prompts)."""
    if node.kind in ("embed", "logits"):
        return "input" if node.kind == "embed" else "logits"
    attn = f"layers.{node.layer}.self_attn"
    if node.kind == "attn_head_out":
        return f"{attn}.head.{node.head}"
    if node.kind == "q_input":
        return f"{attn}.head.{node.head}.q"
    if node.kind in ("k_input", "v_input"):
        return f"{attn}.kv_head.{node.head}.{node.kind[0]}"
    mlp = model.get_submodule(f"layers.{node.layer}.mlp")
    if callable(getattr(mlp, "expert_index", None)):
        return f"layers.{node.layer}.mlp.expert.{int(mlp.expert_index(seq)[node.position])}"
    return f"layers.{node.layer}.mlp"



def _check_runs(model, clean, corrupted) -> tuple[Tensor, Tensor]:
    clean, corrupted = _runs(model, clean, corrupted, "noising")  # (base, source): clean is the base run
    if model.training:
        raise ValueError("the model is in training mode; call model.eval() (dropout would make runs disagree)")
    return clean, corrupted


def _writer_outputs(model, tokens: Tensor, layout: _Layout, extra: Sequence[str] = ()) -> tuple[Tensor, dict]:
    """(logits, {hook: value}) of a no-grad run: every writer hook's value, and `extra` values."""
    names = [h.name for h in layout.writer_hooks] + list(extra)
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens, names_filter=names, return_cache_object=False)
    return logits, cache


def _stream_bytes(model, tokens: Tensor) -> int:
    """The bytes of one [batch seq hidden_size] value for these prompts."""
    itemsize = torch.finfo(next(model.parameters()).dtype).bits // 8
    return tokens.numel() * model.cfg.d_model * itemsize


def _slots(value: Tensor, hook: _Hook) -> Tensor:
    """A hook's value with a slot axis: [..., slots, hidden_size]."""
    return value if hook.head_axis else value.unsqueeze(-2)
