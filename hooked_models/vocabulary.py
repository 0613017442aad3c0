"""The standard vocabulary: every value a hooked model exposes, defined once.

Each `Value` names one activation: the module that hosts it (model, layer, attention, mlp, or a
component such as a norm), its layout and dimensions, a one-line meaning, and its TransformerLens
name where one exists. HookPoints, `print(model)`, `support()`, the cache's alias lookup, `pos_slice`
and the shape tests all read this table; nothing else spells a value's name or layout.

The standard names and layouts are those of the nnterp family page for Arcee
(`shared/seeds/000_*.txt`). Values a component or family adds (norm scale, pre-rotary queries,
alpha-er's bottlenecks) are declared in the same form: components here, families in their own file.
"""

import difflib
import html
import re
import textwrap
from dataclasses import dataclass, field

import einops
import torch

# Layout name -> its dimensions, in the order the tensor holds them.
LAYOUTS: dict[str, tuple[str, ...]] = {
    "Residual": ("batch", "seq", "hidden_size"),
    "Logits": ("batch", "seq", "vocab_size"),
    "NextTokenProbs": ("batch", "vocab_size"),
    "Tokens": ("batch", "seq"),
    "Size": ("2",),
    "Queries": ("batch", "num_heads", "seq", "qk_head_dim"),
    "Keys": ("batch", "num_kv_heads", "seq", "qk_head_dim"),
    "Values": ("batch", "num_kv_heads", "seq", "head_dim"),
    "Pattern": ("batch", "num_heads", "query", "key"),
    "HeadOutputs": ("batch", "seq", "num_heads", "head_dim"),
    "HeadResults": ("batch", "seq", "num_heads", "hidden_size"),
    "PerHeadResidual": ("batch", "seq", "num_heads", "hidden_size"),
    "PerKVHeadResidual": ("batch", "seq", "num_kv_heads", "hidden_size"),
    "Neurons": ("batch", "seq", "intermediate_size"),
    "Scale": ("batch", "seq", "1"),
    "Bottleneck": ("batch", "seq", "rank"),
    "ExpertIndex": ("batch", "seq"),
}

# Dimensions that index positions: `pos_slice` and the cache's position helpers slice the first one.
POSITION_DIMS = ("seq", "query")

# Standard module path -> TransformerLens module path. TransformerLens's names are second names for
# the same HookPoints; these patterns translate a host's path.
TL_MODULE_PATHS: list[tuple[str, str]] = [
    (r"^layers\.(\d+)\.self_attn$", r"blocks.\1.attn"),
    (r"^layers\.(\d+)\.mlp$", r"blocks.\1.mlp"),
    (r"^layers\.(\d+)\.input_layernorm$", r"blocks.\1.ln1"),
    (r"^layers\.(\d+)\.post_attention_layernorm$", r"blocks.\1.ln2"),
    (r"^layers\.(\d+)$", r"blocks.\1"),
    (r"^norm$", "ln_final"),
    (r"^$", ""),
]


def tl_module_path(path: str) -> str | None:
    """The TransformerLens path of a standard module path, or None where TransformerLens has none."""
    for pattern, replacement in TL_MODULE_PATHS:
        if re.match(pattern, path):
            return re.sub(pattern, replacement, path)
    return None


@dataclass(frozen=True)
class Value:
    """One standard value: what it is, where it lives, how it is laid out, and its second names.

    `tl` is the TransformerLens hook name, relative to the TransformerLens path of the host (or of the
    host's parent when `tl_on_parent`, as for `attention_output` -> `blocks.{i}.hook_attn_out`).
    `tl_layout` is an einops pattern from the standard layout to TransformerLens's where they differ.
    `lazy` values are computed only while a hook reads or writes them (they cost nothing otherwise).
    `on_request` names the TransformerLens switch (`use_attn_result`, `use_split_qkv_input`, ...) under
    which a cache-everything `run_with_cache` (names_filter=None) includes the value; otherwise it is
    cached only when named or matched by a filter, as TransformerLens does for `hook_result`: per-head
    results are num_heads residual streams per layer (15 GB on AFM-4.5B at 2048 tokens).
    `tl_also_on_parent`: the TransformerLens name is valid on the host's parent too (TransformerLens
    3.x hangs `hook_q_input` on the block, 4.x on the attention: both resolve).
    """

    name: str
    host: str
    layout: str
    meaning: str
    read_at: str
    tl: str | None = None
    tl_on_parent: bool = False
    tl_layout: str | None = None
    read_only: bool = False
    lazy: bool = False
    on_request: str | None = None
    tl_also_on_parent: bool = False

    @property
    def dims(self) -> tuple[str, ...]:
        return LAYOUTS[self.layout]

    @property
    def layout_text(self) -> str:
        """`Residual [batch seq hidden_size]`, as the family page prints it."""
        if self.layout == "Size":
            return "scalar"
        return f"{self.layout} [{' '.join(self.dims)}]"

    @property
    def seq_axis(self) -> int | None:
        """The position axis, as a negative index (works with or without a batch dimension)."""
        for axis, dim in enumerate(self.dims):
            if dim in POSITION_DIMS:
                return axis - len(self.dims)
        return None

    def to_tl(self, tensor: torch.Tensor) -> torch.Tensor:
        """The standard layout -> TransformerLens's (a view, no copy)."""
        return tensor if self.tl_layout is None else einops.rearrange(tensor, self.tl_layout)

    def from_tl(self, tensor: torch.Tensor) -> torch.Tensor:
        """TransformerLens's layout -> the standard one: what a write through an alias becomes."""
        if self.tl_layout is None:
            return tensor
        source, target = self.tl_layout.split("->")
        return einops.rearrange(tensor, f"{target} -> {source}")

    def shape(self, sizes: dict[str, int]) -> tuple[int, ...]:
        """The concrete shape, given the size of every dimension (numbers stand for themselves)."""
        return tuple(int(d) if d.isdigit() else sizes[d] for d in self.dims)


_HEADS_TO_TL = "batch head seq d -> batch seq head d"


def declare_values(host: str, rows: list[tuple]) -> dict[str, Value]:
    """Values from rows of (name, layout, meaning, read_at[, options]): the form every table uses."""
    table = {}
    for name, layout, meaning, read_at, *options in rows:
        table[name] = Value(name, host, layout, meaning, read_at, **(options[0] if options else {}))
    return table


# The family page's values, by host.
MODEL_VALUES = declare_values("model", [
    ("input_ids", "Tokens", "The token ids the model was called with", "the model's own input"),
    ("attention_mask", "Tokens", "The attention mask the model was called with; zeros are padding",
     "the model's own input"),
    ("input_size", "Size", "[batch, seq] of the current call; read-only", "the model's own input",
     dict(read_only=True)),
    ("token_embeddings", "Residual",
     "The embedding module's output; layers[0].input is what enters the first block",
     "the child module embed_tokens's output", dict(tl="hook_embed")),
    ("final_norm_output", "Residual", "The residual stream after the final norm, what lm_head reads",
     "the child module norm's output"),
    ("lm_head_output", "Logits",
     "The head's logits before anything the model does past lm_head (a softcap, a scale)",
     "the child module lm_head's output"),
    ("logits", "Logits",
     "The logits the model returns, after anything it does past lm_head (a softcap, a scale)",
     "the model's own output"),
    ("next_token_probs", "NextTokenProbs",
     "The next-token distribution at the last position; derived, read-only", "the model's own output",
     dict(read_only=True, lazy=True)),
])

LAYER_VALUES = declare_values("layer", [
    ("layer_input", "Residual", "The residual stream entering the block", "the module's own input",
     dict(tl="hook_resid_pre")),
    ("attention_norm_output", "Residual", "The normed stream entering the attention",
     "the child module input_layernorm's output"),
    ("layer_mid", "Residual", "The residual stream after the attention add",
     "the child module post_attention_layernorm's input", dict(tl="hook_resid_mid")),
    ("mlp_norm_output", "Residual", "The normed stream entering the MLP",
     "the child module post_attention_layernorm's output"),
    ("mlp_input", "Residual", "What the MLP is called with", "the child module mlp's input"),
    ("layer_output", "Residual",
     "The residual stream leaving the block, a tensor even when the block returns a tuple",
     "the module's own output", dict(tl="hook_resid_post")),
])

ATTENTION_VALUES = declare_values("attention", [
    ("attention_queries", "Queries", "The queries entering attention",
     "inside the forward, after rotary", dict(tl="hook_rot_q", tl_layout=_HEADS_TO_TL)),
    ("attention_keys", "Keys", "The keys entering attention",
     "inside the forward, after rotary, before the GQA repeat",
     dict(tl="hook_rot_k", tl_layout=_HEADS_TO_TL)),
    ("attention_values", "Values", "The values entering attention",
     "inside the forward, before the GQA repeat", dict(tl="hook_v", tl_layout=_HEADS_TO_TL)),
    ("attention_scores", "Pattern", "The attention scores entering the softmax, masked",
     "inside the forward: the softmax's input", dict(tl="hook_attn_scores")),
    ("attention_premix", "HeadOutputs",
     "Every head's output side by side, as the output projection takes it",
     "the child module o_proj's input"),
    ("attention_output", "Residual", "What the attention adds to the residual stream",
     "the module's own output", dict(tl="hook_attn_out", tl_on_parent=True)),
    ("attention_probabilities", "Pattern", "The attention pattern the values are mixed with",
     "inside the forward: the softmax's output", dict(tl="hook_pattern")),
    ("attention_head_outputs", "HeadOutputs", "The per-head outputs before the output projection",
     "inside the forward: the pattern times the values", dict(tl="hook_z")),
])

MLP_VALUES = declare_values("mlp", [
    ("mlp_activation", "Neurons", "The activation function's output", "the child module act_fn's output"),
    ("mlp_neurons", "Neurons",
     "What the down projection receives: act(gate)·up on a gated MLP, the activation itself otherwise",
     "the child module down_proj's input", dict(tl="hook_post")),
    ("mlp_output", "Residual", "What the MLP adds to the residual stream", "the module's own output",
     dict(tl="hook_mlp_out", tl_on_parent=True)),
])

# Values the shared components add beyond the family page, in the same form.
COMPONENT_VALUES = {
    **declare_values("attention", [
        ("attention_queries_unrotated", "Queries", "The queries as projected, before rotary",
         "the child module q_proj's output, split into heads",
         dict(tl="hook_q", tl_layout=_HEADS_TO_TL)),
        ("attention_keys_unrotated", "Keys", "The keys as projected, before rotary",
         "the child module k_proj's output, split into heads",
         dict(tl="hook_k", tl_layout=_HEADS_TO_TL)),
        ("attention_head_results", "HeadResults",
         "Each head's contribution to the residual stream; they sum to attention_output. "
         "Computed only while hooked", "each head's slice of o_proj",
         dict(tl="hook_result", lazy=True, on_request="use_attn_result")),
        # Split inputs (TransformerLens's use_split_qkv_input / use_attn_in): copies of the stream
        # entering the block, before input_layernorm, one per head. Each copy goes through the norm
        # and its own head's projection, so a write to it reaches that head alone; unwritten, the
        # output is the unsplit one bit for bit (SelfAttention.split_inputs says how).
        ("attention_query_inputs", "PerHeadResidual",
         "Each query head's own copy of the residual stream entering the block; head h's queries read "
         "copy h through input_layernorm. Computed only while hooked",
         "layer_input copied per head, before input_layernorm",
         dict(tl="hook_q_input", tl_also_on_parent=True, lazy=True, on_request="use_split_qkv_input")),
        ("attention_key_inputs", "PerKVHeadResidual",
         "Each key/value head's own copy of the residual stream entering the block; key/value head j's "
         "keys read copy j through input_layernorm. Computed only while hooked",
         "layer_input copied per key/value head, before input_layernorm",
         dict(tl="hook_k_input", tl_also_on_parent=True, lazy=True, on_request="use_split_qkv_input")),
        ("attention_value_inputs", "PerKVHeadResidual",
         "Each key/value head's own copy of the residual stream entering the block; key/value head j's "
         "values read copy j through input_layernorm. Computed only while hooked",
         "layer_input copied per key/value head, before input_layernorm",
         dict(tl="hook_v_input", tl_also_on_parent=True, lazy=True, on_request="use_split_qkv_input")),
        ("attention_inputs", "PerHeadResidual",
         "One copy of the residual stream entering the block per query head, read by its queries, keys "
         "and values (under GQA key/value head j reads copy j*g, its group's first query head); "
         "the query/key/value copies are taken from these. Computed only while hooked",
         "layer_input copied per head, before input_layernorm",
         dict(tl="hook_attn_in", tl_also_on_parent=True, lazy=True, on_request="use_attn_in")),
    ]),
    **declare_values("layer", [
        ("mlp_residual_input", "Residual",
         "The residual stream the MLP branch reads before post_attention_layernorm: a copy of layer_mid "
         "that only the MLP sees (TransformerLens's hook_mlp_in; mlp_input is after the norm). "
         "Computed only while hooked",
         "a copy of layer_mid, before post_attention_layernorm",
         dict(tl="hook_mlp_in", lazy=True, on_request="use_hook_mlp_in")),
    ]),
    **declare_values("mlp", [
        ("mlp_pre_activation", "Neurons", "The MLP's pre-activation, what the activation function reads",
         "the child module up_proj's output", dict(tl="hook_pre")),
    ]),
    **declare_values("norm", [
        ("norm_scale", "Scale", "The norm's divisor: sqrt(mean square + eps), or the standard deviation",
         "inside the norm", dict(tl="hook_scale")),
        ("norm_normalized", "Residual", "The normalized stream before the norm's weight (and bias)",
         "inside the norm", dict(tl="hook_normalized")),
    ]),
}

STANDARD_VALUES: dict[str, Value] = {**MODEL_VALUES, **LAYER_VALUES, **ATTENTION_VALUES, **MLP_VALUES}
VALUES: dict[str, Value] = {**STANDARD_VALUES, **COMPONENT_VALUES}

# Everyday words for the values, TransformerLens's shorthands (`get_act_name`: pattern, attn, resid_pre, z,
# q, ...), nnterp's accessors (layers_output, attentions_output, mlps_output, ...) and common spellings ->
# the values they mean, in order of preference (a model suggests the first it has: `q` is TransformerLens's
# pre-rotary hook_q where there is rotary). Unknown-name errors read it: "layers.0.self_attn.pattern"
# suggests layer 0's attention_probabilities. A name's last part is looked up, less any "hook_".
SYNONYMS: dict[str, tuple[str, ...]] = {}
for _names, _words in [
    (("attention_probabilities",), "pattern attn attn_pattern attention_pattern attn_weights attention_weights "
                                   "attn_probs attention_probs attn_probabilities probs probabilities attentions"),
    (("attention_scores",), "attn_scores scores attention_logits attn_logits pre_softmax"),
    (("attention_raw_scores",), "raw_scores uncapped_scores"),
    (("attention_queries_unrotated", "attention_queries"), "q"),
    (("attention_keys_unrotated", "attention_keys"), "k"),
    (("attention_queries",), "rot_q queries query"),
    (("attention_keys",), "rot_k keys key"),
    (("attention_values",), "v values value"),
    (("attention_head_outputs",), "z heads head_outputs attn_heads"),
    (("attention_head_results",), "result results head_results head_result"),
    (("attention_output",), "attn_out attn_output attention_out attentions_output attn_outputs"),
    (("attention_norm_output",), "attentions_input attn_in attention_input ln1"),
    (("mlp_norm_output",), "ln2"),
    (("layer_input",), "resid_pre layers_input layer_in residual_pre hidden_states resid residual"),
    (("layer_mid",), "resid_mid residual_mid"),
    (("layer_output",), "resid_post layers_output layer_out residual_post"),
    (("mlp_input",), "mlps_input mlp_in"),
    (("mlp_output",), "mlp_out mlps_output mlp mlp_outputs"),
    (("mlp_pre_activation",), "pre mlp_pre pre_activation preact pre_act"),
    (("mlp_activation",), "act activation act_fn"),
    (("mlp_neurons",), "post mlp_post neurons mlp_hidden hidden"),
    (("mlp_expert_index",), "expert experts expert_index routing"),
    (("token_embeddings",), "embed embeddings tok_embed wte embed_tokens"),
    (("position_embeddings",), "pos_embed pos_embeddings wpe embed_positions"),
    (("norm_scale",), "scale"),
    (("norm_normalized",), "normalized"),
    (("final_norm_output",), "ln_final final_norm ln_f"),
    (("lm_head_output", "logits"), "unembed lm_head"),
    (("input_ids",), "tokens ids"),
    (("attention_mask",), "mask"),
]:
    for _word in _words.split():
        SYNONYMS[_word] = _names


@dataclass
class SupportRow:
    host: str
    module: str
    name: str
    layout: str
    meaning: str
    read_at: str
    tl_name: str | None


@dataclass
class Support:
    """What `model.support()` returns: the model's values by host, shown as a table wherever it is shown
    (`print`, a prompt's echo, a Jupyter cell's output)."""

    rows: list[SupportRow] = field(default_factory=list)

    def by_host(self) -> dict[str, list[SupportRow]]:
        hosts: dict[str, list[SupportRow]] = {}
        for row in self.rows:
            hosts.setdefault(row.module, []).append(row)
        return hosts

    def names(self) -> list[str]:
        return [row.name for row in self.rows]

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    WIDTH = 100  # the printed table's lines: a value's name and layout, then its meaning wrapped below

    def __str__(self) -> str:
        lines = []
        for module, rows in self.by_host().items():
            lines.append(f"{module}")
            width = max(len(r.name) for r in rows)
            for r in rows:
                lines.append(f"  {r.name:<{width}}  {r.layout}")
                alias = f" TransformerLens:\0{r.tl_name}." if r.tl_name else ""  # \0: kept on one line
                lines += [line.replace("\0", " ") for line in textwrap.wrap(
                    f"{r.meaning}; read at {r.read_at}.{alias}", self.WIDTH, initial_indent=" " * 6,
                    subsequent_indent=" " * 6, break_on_hyphens=False)]
        return "\n".join(lines)

    __repr__ = __str__  # what a prompt echoes: the table, not the dataclass's fields

    _COLUMNS = ("name", "layout", "meaning", "read at", "TransformerLens")

    def _cells(self, row: SupportRow) -> tuple[str, ...]:
        return row.name, row.layout, row.meaning, row.read_at, row.tl_name or ""

    def _repr_html_(self) -> str:
        """Jupyter's rendering: one table, a header row per host module."""
        head = "".join(f"<th>{c}</th>" for c in self._COLUMNS)
        body = []
        for module, rows in self.by_host().items():
            span = len(self._COLUMNS)
            body.append(f'<tr><th colspan="{span}" style="text-align:left">{html.escape(module)}</th></tr>')
            for row in rows:
                cells = (f"<code>{html.escape(c)}</code>" if i in (0, 4) and c else html.escape(c)
                         for i, c in enumerate(self._cells(row)))
                body.append("<tr>" + "".join(f'<td style="text-align:left">{c}</td>' for c in cells) + "</tr>")
        return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"

    def _repr_markdown_(self) -> str:
        """The same table in Markdown (for frontends that render Markdown rather than HTML)."""
        lines = ["| module | " + " | ".join(self._COLUMNS) + " |", "|---" * (len(self._COLUMNS) + 1) + "|"]
        for row in self.rows:
            cells = (row.module, *self._cells(row))
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        return "\n".join(lines)


def nearest_values(word: str, names) -> list[str]:
    """The value names among `names` that `word` most likely means: its synonym's (SYNONYMS: `pattern`,
    `resid_pre`), else up to three close spellings (`layer_inptu` -> `layer_input`)."""
    names = list(names)
    key = word.rpartition(".")[2].removeprefix("hook_").lower()
    meant = [name for name in SYNONYMS.get(key, ()) if name in names]
    return meant[:1] or difflib.get_close_matches(key, names, n=3, cutoff=0.75)
