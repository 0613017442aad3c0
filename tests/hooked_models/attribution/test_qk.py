"""QK attributions (hooked_models/attribution/qk.py, read from the decomposition): the (query component,
key component) pairs sum to the model's own pre-softmax score for every head and pattern entry; one pair
equals the dot product of the two components' rotated, normed projections computed from transformers'
weights and rotary; alpha-er's soft cap is reported beside the raw score; bad requests are refused."""

import inspect
import json

import pytest
import torch

from hooked_models import HookedArcee
from hooked_models.attribution import AttributionGraph, attribute
from hooked_models.explorer.graph_file import GraphFile


def score_name(model, layer: int) -> str:
    raw = f"layers.{layer}.self_attn.score_mod.attention_raw_scores"
    return raw if raw in model.hook_dict else f"layers.{layer}.self_attn.attention_scores"


@pytest.mark.parametrize("family", ["arcee", "alpha_er"])
def test_the_pairs_sum_to_every_score(family, tl_model_factory, make_untied):
    model = tl_model_factory(family)
    tcs = make_untied(model)
    seq = 8
    tokens = torch.randint(0, model.cfg.vocab_size, (seq,), generator=torch.Generator().manual_seed(5))
    entries = [(l, h, q, k) for l in range(model.cfg.num_layers) for h in range(model.cfg.n_heads)
               for q in range(seq) for k in range(q + 1)]
    graph = attribute(model, tokens, tcs, batch_size=32, head_loadings="all", qk=entries)
    names = [score_name(model, l) for l in range(model.cfg.num_layers)]
    capped = [f"layers.{l}.self_attn.attention_scores" for l in range(model.cfg.num_layers)]
    with torch.no_grad():  # the model's own scores, attention explicit (as with its patterns hooked)
        _, cache = model.run_with_cache(tokens[None], names_filter=lambda n: n in names or n in capped
                                        or n.endswith("attention_probabilities"))
    cap = getattr(model.layers[0].self_attn.score_mod, "cap", 0.0)
    assert (cap > 0) == (family == "alpha_er")
    for l, h, q, k in entries:
        table = graph.qk(l, h, q, k)
        pairs = table.pairs()
        truth = float(cache[names[l]][0, h, q, k])
        assert abs(table.score - truth) <= 1e-5 * float(pairs.abs().sum()) + 1e-7, (l, h, q, k, table.score, truth)
        # Every node kept: the other nodes carry nothing, exactly (their row is their own, a row of no writes,
        # not the total less every kept part, which would hold the parts' rounding).
        assert not pairs[-1].any() and not pairs[:, -1].any()
        assert table.capped == pytest.approx(float(cache[capped[l]][0, h, q, k]), rel=1e-5, abs=1e-6)
        # The model's own score is the raw one, before the cap (alpha-er's capped differs by more than this).
        assert abs(table.model_score - truth) <= 1e-6 * abs(truth) + 1e-7, (l, h, q, k, table.model_score, truth)
        if cap:
            assert abs(table.capped) < abs(table.model_score) or table.model_score == 0  # the cap shrinks the raw score
    strong = graph.qk(*max(entries, key=lambda e: graph.qk(*e).pairs().abs().max()))
    assert strong.top(3)[0]["value"] == pytest.approx(float(strong.pairs().flatten()[strong.pairs().abs().argmax()]))


def test_one_pair_is_the_dot_product_of_the_rotated_normed_projections(tiny_factories, make_untied):
    """Head 3 (GQA: key/value head 0) of layer 1: a layer-0 feature at the query position and the layer-0
    error at the key position reach layer 1's stream directly (written after layer 0's attention), so
    their pair is scale * rot_q(W_Q[3] (write_f * g / s_q)) . rot_k(W_K[0] (error * g / s_k)), from
    transformers' weights, its rotary (YaRN) and the frozen norm scales."""
    from transformers.models.arcee.modeling_arcee import apply_rotary_pos_emb

    make_hf_arcee, _ = tiny_factories
    hf = make_hf_arcee(0).eval()
    model = HookedArcee.from_hf(hf)
    tcs = make_untied(model)
    seq, head, q, k = 8, 3, 6, 2
    tokens = torch.randint(0, model.cfg.vocab_size, (seq,), generator=torch.Generator().manual_seed(1))
    graph = attribute(model, tokens, tcs, head_loadings="all", qk=[(1, head, q, k)])
    table = graph.qk(1, head, q, k)

    inputs, outputs = tcs.input_hook(0), tcs.output_hook(0)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens[None], names_filter=[inputs, outputs, "layers.1.input_layernorm.norm_scale"])
        x, mlp_out = cache[inputs][0], cache[outputs][0]
        acts = tcs[0].encode(x)
        feature = int(acts[q].argmax())
        write = acts[q, feature] * tcs[0].W_dec[feature]
        error = (mlp_out - (acts @ tcs[0].W_dec + tcs[0].b_dec + x @ tcs[0].W_skip.T))[k]
        attn, norm = hf.model.layers[1].self_attn, hf.model.layers[1].input_layernorm
        scale_q, scale_k = cache["layers.1.input_layernorm.norm_scale"][0, [q, k], 0]
        d = attn.head_dim
        query = attn.q_proj.weight.view(-1, d, hf.config.hidden_size)[head] @ (write * norm.weight / scale_q)
        key = attn.k_proj.weight.view(-1, d, hf.config.hidden_size)[head // 5] @ (error * norm.weight / scale_k)
        Q, K = torch.zeros(1, 1, seq, d), torch.zeros(1, 1, seq, d)
        Q[0, 0, q], K[0, 0, k] = query, key
        cos, sin = hf.model.rotary_emb(Q, torch.arange(seq)[None])
        Q, K = apply_rotary_pos_emb(Q, K, cos, sin)
        expected = float(Q[0, 0, q] @ K[0, 0, k]) * d**-0.5
    query_name, key_name = f"layers.0.mlp.feature.{feature}@{q}", f"layers.0.mlp.error@{k}"
    i, j = table.names.index(query_name), table.names.index(key_name)
    assert abs(expected) > 1e-3
    assert float(table.pairs()[i, j]) == pytest.approx(expected, rel=1e-5, abs=1e-7)
    # Not its mirror: the same components on the other sides make another number.
    assert float(table.pairs()[j, i]) != pytest.approx(expected, rel=1e-3)
    # top() names the pair by its sides: the feature as the query, the error as the key.
    (row,) = [r for r in table.top(len(table.names) ** 2) if (r["query"], r["key"]) == (query_name, key_name)]
    assert row["value"] == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_the_entries_chosen_are_those_of_largest_flow(tl_model_factory, make_untied, replacement, node_values):
    """qk=n picks the n pattern entries of largest flow: for entry (L, h, q, k), the sum over the targets
    of |what they move when head h's output at q gains pattern[h, q, k] x the value at k|, in the
    replacement model of conftest.py (linear, so the move is the gradient's product). Query head h reads
    key/value head h // groups (GQA: 4 query heads over 2), which a mapping h % groups gets wrong for
    heads 1 and 2; each table's flow is the oracle's."""
    model = tl_model_factory("arcee")
    tcs = make_untied(model)
    seq, n = 8, 6
    tokens = torch.randint(0, model.cfg.vocab_size, (seq,), generator=torch.Generator().manual_seed(4))
    graph = attribute(model, tokens, tcs, batch_size=16, head_loadings="all", qk=n)
    oracle = replacement(model, tcs, tokens)
    rows = (graph.adjacency_matrix != 0).any(1)  # the targets: every node with an edge into it
    heads, kv_heads = model.cfg.n_heads, model.cfg.n_key_value_heads
    assert heads // kv_heads == 2
    base = node_values(graph, oracle.run())[rows]
    flow = torch.zeros(model.cfg.num_layers, heads, seq, seq)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens[None], names_filter=lambda n: n.endswith("attention_values")
                                        or n.endswith("attention_probabilities"))
    for L in range(model.cfg.num_layers):
        pattern = cache[f"layers.{L}.self_attn.attention_probabilities"][0]  # [head query key]
        values = cache[f"layers.{L}.self_attn.attention_values"][0]  # [kv_head key head_dim]
        for h in range(heads):
            for q in range(seq):
                for k in range(q + 1):
                    def nudge(z, hook, h=h, q=q, k=k):
                        z = z.clone()
                        z[0, q, h] += pattern[h, q, k] * values[h // (heads // kv_heads), k]
                        return z
                    moved = node_values(graph, oracle.run(hooks=[(f"layers.{L}.self_attn.attention_head_outputs",
                                                                  nudge)]))[rows] - base
                    flow[L, h, q, k] = moved.abs().sum()
    chosen = list(graph.qk_tables)
    assert len(chosen) == n
    for entry in chosen:
        assert graph.qk_tables[entry].flow == pytest.approx(float(flow[entry]), rel=1e-4), entry
    others = torch.ones_like(flow, dtype=torch.bool)
    for entry in chosen:
        others[entry] = False
    assert min(float(flow[e]) for e in chosen) >= float(flow[others].max()) * (1 - 1e-4)


def test_the_graph_file_carries_the_tables_the_viewer_ignores(tl_model_factory, make_untied, tmp_path):
    model = tl_model_factory("arcee")
    tcs = make_untied(model)
    tokens = torch.randint(0, model.cfg.vocab_size, (8,), generator=torch.Generator().manual_seed(2))
    graph = attribute(model, tokens, tcs, qk=4)
    assert 0 < len(graph.qk_tables) <= 4
    path = graph.prune(0.8, 0.98).to_json(tmp_path / "g.json")
    data = json.loads(path.read_text())
    GraphFile(**data)  # circuit-tracer's schema (pydantic, extra keys ignored)
    ids = {n["node_id"] for n in data["nodes"]} | {"bias", "other nodes"}
    assert len(data["qk_attributions"]) == len(graph.qk_tables)
    for entry in data["qk_attributions"]:
        table = graph.qk(entry["layer"], entry["head"], entry["query_pos"], entry["key_pos"])
        assert entry["score"] == pytest.approx(table.score)
        assert all(p["query"] in ids or p["query"].startswith("layers.") or p["query"].startswith("embedding")
                   for p in entry["pairs"])
    back = AttributionGraph.from_json(path)
    for key, table in graph.qk_tables.items():
        assert torch.equal(back.qk_tables[key].pairs(), table.pairs())
    assert torch.equal(back.loading_heads, graph.loading_heads)


@pytest.mark.parametrize("ask, message", [
    (lambda g: g.qk(0, 99, 1, 0), "head=99"),
    (lambda g: g.qk(0, 0, 50, 0), "query_pos=50"),
    (lambda g: g.qk(7, 0, 1, 0), "layer=7"),
    # a key after its query: refused as causal (masked), not as "not computed"; the boundary is one past it
    (lambda g: g.qk(0, 0, 1, 2), "key_pos=2 comes after query_pos=1: attention is causal"),
    (lambda g: g.qk(0, 0, 3, 7), "key_pos=7 comes after query_pos=3: attention is causal"),
])
def test_a_qk_request_outside_the_model_is_refused(tl_model_factory, make_untied, ask, message):
    model = tl_model_factory("arcee")
    tcs = make_untied(model)
    tokens = torch.randint(0, model.cfg.vocab_size, (8,), generator=torch.Generator().manual_seed(2))
    graph = attribute(model, tokens, tcs, qk=2)
    with pytest.raises(ValueError, match=message):
        ask(graph)


@pytest.mark.parametrize("kwargs, message", [
    (dict(qk=[(0, 9, 1, 0)]), "head=9"),
    (dict(qk=[(0, 0, 1, 3)]), "key_pos=3 comes after query_pos=1: attention is causal"),
    (dict(qk=[(0, 0, 1, 2)]), "key_pos=2 comes after query_pos=1"),  # the boundary: one past the query
    (dict(qk=[(0, 0, 8, 0)]), "query_pos=8"),
])
def test_qk_entries_outside_the_model_are_refused(tl_model_factory, make_untied, kwargs, message):
    model = tl_model_factory("arcee")
    tcs = make_untied(model)
    tokens = torch.randint(0, model.cfg.vocab_size, (8,), generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match=message):
        attribute(model, tokens, tcs, **kwargs)


@pytest.mark.parametrize("qk", [-1, True, 2.5, "4"])
def test_a_qk_that_is_neither_a_count_nor_entries_is_refused(tl_model_factory, make_untied, qk):
    """-1 is not "all but the weakest", True is not 1, 2.5 is not a count: each a one-line error naming it.
    Called unwrapped: the suite's runtime type checker would refuse 2.5 and "4" first, and a user
    without it meets the library's own check."""
    model = tl_model_factory("arcee")
    tcs = make_untied(model)
    tokens = torch.randint(0, model.cfg.vocab_size, (8,), generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError) as refused:
        inspect.unwrap(attribute)(model, tokens, tcs, qk=qk)
    assert str(refused.value) == (f"qk={qk!r} must be a number of entries (an integer >= 0) or a list of "
                                  "(layer, head, query_pos, key_pos)")


def test_qk_of_a_graph_without_its_decomposition_is_refused(tl_model_factory, make_untied):
    model = tl_model_factory("alpha_er")
    tcs = make_untied(model)
    tokens = torch.randint(0, model.cfg.vocab_size, (8,), generator=torch.Generator().manual_seed(2))
    graph = attribute(model, tokens, tcs, head_loadings=False)
    with pytest.raises(ValueError, match="without its decomposition"):
        graph.qk(0, 0, 1, 0)
