"""The one table: consistent with itself, with the family page, and with the models built from it."""

from html.parser import HTMLParser

import pytest
import torch

from hooked_models.vocabulary import LAYOUTS, STANDARD_VALUES, SYNONYMS, VALUES, tl_module_path

# The family page's values, by host (shared/seeds/000_*.txt).
FAMILY_PAGE = {
    "model": {"logits", "token_embeddings", "final_norm_output", "lm_head_output", "next_token_probs", "input_ids",
              "attention_mask", "input_size"},
    "layer": {"layer_input", "attention_norm_output", "layer_mid", "mlp_norm_output", "mlp_input", "layer_output"},
    "attention": {"attention_queries", "attention_keys", "attention_values", "attention_scores", "attention_premix",
                  "attention_output", "attention_probabilities", "attention_head_outputs"},
    "mlp": {"mlp_activation", "mlp_neurons", "mlp_output"},
}


def test_the_family_page_values_are_the_standard_ones():
    by_host = {}
    for value in STANDARD_VALUES.values():
        by_host.setdefault(value.host, set()).add(value.name)
    assert by_host == FAMILY_PAGE


def test_layouts_as_the_family_page_prints_them():
    assert VALUES["attention_queries"].layout_text == "Queries [batch num_heads seq qk_head_dim]"
    assert VALUES["attention_keys"].layout_text == "Keys [batch num_kv_heads seq qk_head_dim]"
    assert VALUES["attention_values"].layout_text == "Values [batch num_kv_heads seq head_dim]"
    assert VALUES["attention_scores"].layout_text == "Pattern [batch num_heads query key]"
    assert VALUES["attention_premix"].layout_text == "HeadOutputs [batch seq num_heads head_dim]"
    assert VALUES["next_token_probs"].layout_text == "NextTokenProbs [batch vocab_size]"
    assert VALUES["input_size"].layout_text == "scalar"
    assert all(v.layout in LAYOUTS for v in VALUES.values())


def test_position_axes_come_from_layouts():
    assert VALUES["layer_input"].seq_axis == -2
    assert VALUES["attention_queries"].seq_axis == -2
    assert VALUES["attention_head_outputs"].seq_axis == -3
    assert VALUES["attention_scores"].seq_axis == -2  # the query axis
    assert VALUES["input_ids"].seq_axis == -1
    assert VALUES["next_token_probs"].seq_axis is None


def test_tl_layout_round_trips_without_copies():
    value = VALUES["attention_queries"]
    x = torch.randn(2, 3, 5, 4)
    tl = value.to_tl(x)
    assert tl.shape == (2, 5, 3, 4) and tl.data_ptr() == x.data_ptr()
    assert torch.equal(value.from_tl(tl), x)


def test_tl_module_paths():
    assert tl_module_path("layers.3.self_attn") == "blocks.3.attn"
    assert tl_module_path("layers.3.post_attention_layernorm") == "blocks.3.ln2"
    assert tl_module_path("norm") == "ln_final"
    assert tl_module_path("layers.3.mlp.up_proj") is None


def test_aliases_are_unique_and_resolve(tiny_arcee):
    assert len(set(tiny_arcee.aliases)) == len(tiny_arcee.aliases)
    expected = {
        "hook_embed": "token_embeddings",
        "blocks.1.hook_resid_pre": "layers.1.layer_input",
        "blocks.1.hook_resid_mid": "layers.1.layer_mid",
        "blocks.1.hook_resid_post": "layers.1.layer_output",
        "blocks.1.hook_attn_out": "layers.1.self_attn.attention_output",
        "blocks.1.hook_mlp_out": "layers.1.mlp.mlp_output",
        "blocks.1.attn.hook_q": "layers.1.self_attn.attention_queries_unrotated",
        "blocks.1.attn.hook_rot_k": "layers.1.self_attn.attention_keys",
        "blocks.1.attn.hook_pattern": "layers.1.self_attn.attention_probabilities",
        "blocks.1.attn.hook_z": "layers.1.self_attn.attention_head_outputs",
        "blocks.1.mlp.hook_pre": "layers.1.mlp.mlp_pre_activation",
        "blocks.1.mlp.hook_post": "layers.1.mlp.mlp_neurons",
        "blocks.1.ln2.hook_scale": "layers.1.post_attention_layernorm.norm_scale",
        "ln_final.hook_normalized": "norm.norm_normalized",
    }
    for alias, canonical in expected.items():
        assert tiny_arcee.resolve_hook_name(alias)[0] == canonical


# ------------------------------------------------------------------------------------------ support()
class _Table(HTMLParser):
    """The rows of an HTML table: each a list of its cells' text, header cells included."""

    def __init__(self):
        super().__init__()
        self.rows, self._cell = [], None

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = ""

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.rows[-1].append(self._cell)
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data


@pytest.mark.parametrize("family", ["arcee", "alpha_er"])
def test_support_prints_rows_a_terminal_can_read(family):
    """Each value: its name and layout on one line, its meaning, where it is read and its TransformerLens
    name wrapped below, every line within 110 characters (the embedded models' longest names)."""
    from hooked_models import HookedAlphaEr, HookedArcee

    support = (HookedArcee if family == "arcee" else HookedAlphaEr).from_pretrained("embedded").support()
    text = str(support)
    assert max(len(line) for line in text.splitlines()) <= 110
    flat = " ".join(text.split())
    for row in support:
        assert f"{row.name} {row.layout} {row.meaning}; read at {row.read_at}." in flat
        if row.tl_name:
            assert f"read at {row.read_at}. TransformerLens: {row.tl_name}." in flat


def test_support_shows_its_table_at_a_prompt_and_in_jupyter(tiny_arcee):
    """What a prompt echoes (repr) is what print shows; Jupyter gets the same rows as HTML and Markdown."""
    support = tiny_arcee.support()
    assert repr(support) == str(support) and "SupportRow(" not in repr(support)
    for row in support:
        assert f"  {row.name} " in repr(support) and row.layout in repr(support)
    parser = _Table()
    parser.feed(support._repr_html_())
    header, *body = parser.rows
    assert header == ["name", "layout", "meaning", "read at", "TransformerLens"]
    modules = [r[0] for r in body if len(r) == 1]
    assert modules == list(support.by_host())
    cells = [r for r in body if len(r) == 5]
    assert [(c[0], c[1], c[4]) for c in cells] == [(r.name, r.layout, r.tl_name or "") for r in support]
    lines = support._repr_markdown_().splitlines()
    assert len(lines) == 2 + len(support)
    for line, row in zip(lines[2:], support):
        assert line.split(" | ")[1:3] == [row.name, row.layout]
    try:  # what Jupyter asks for, where IPython is installed
        from IPython.core.formatters import format_display_data
    except ImportError:
        return
    shown, _ = format_display_data(support)
    assert shown["text/plain"] == str(support) and shown["text/html"] == support._repr_html_()


# --------------------------------------------------------------------------------------------- synonyms
def test_every_synonym_means_a_value_of_the_vocabulary_or_a_family():
    from hooked_models.components.attention import SOFT_CAP_VALUES
    from hooked_models.components.mlp import EXPERT_VALUES
    from hooked_models.families.alpha_er import ALPHA_ER_VALUES

    known = set(VALUES) | set(SOFT_CAP_VALUES) | set(EXPERT_VALUES) | set(ALPHA_ER_VALUES)
    assert {name for names in SYNONYMS.values() for name in names} <= known
    for word in ("pattern", "attention_pattern", "attn_scores", "resid_pre", "resid_mid", "resid_post", "mlp_out",
                 "attn_out", "attentions_output", "mlps_output", "layers_output", "q", "k", "v", "z"):
        assert word in SYNONYMS, word
