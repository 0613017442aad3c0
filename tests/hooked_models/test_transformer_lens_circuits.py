"""TransformerLens 4.x's circuit tools, unchanged, on both families, against this package's hook-based ones.

`transformer_lens.patching.get_act_patch_direct_path(_all_sources)`, and
`transformer_lens.tools.analysis.attribution_patching`'s `attribution_patch` (node and edge granularity)
and `faithfulness` find the split inputs (`hook_q_input`, `hook_k_input`, `hook_v_input`, `hook_mlp_in`) and
per-head results through the model's TransformerLens names and switches. Their numbers must equal
`hooked_models.patching` and `hooked_models.circuits` (themselves checked against oracles from the
modules, tests/hooked_models/test_circuits.py): TransformerLens edges are per position, ours carry every
position, so TransformerLens's per-position scores are summed. TransformerLens denoises (its base run is the
corrupted one), ours noise from the clean run: its (clean, corrupt) are our (corrupted, clean).
TransformerLens refuses grouped-query attention at edge granularity and for key/value direct paths, so
those run on alpha-er (multi-head) and an Arcee with as many key/value heads as query heads.
"""


import pytest
import torch
import transformer_lens.patching as tl_patching

from hooked_models import HookedArcee, circuits, patching

attribution = pytest.importorskip(
    "transformer_lens.tools.analysis.attribution_patching",
    reason="transformer_lens.tools.analysis.attribution_patching is TransformerLens 4.x only")



def _has_edges() -> bool:
    try:
        attribution.EdgeAttributionConfig(granularity="edge")
    except NotImplementedError:
        return False
    return hasattr(attribution, "faithfulness")


needs_edges = pytest.mark.skipif(not _has_edges(), reason="this TransformerLens's attribution_patching has node "
                                 "granularity only (edge granularity and faithfulness came in 4.x)")


def metric(logits):
    return (logits[:, -1, 3] - logits[:, -1, 5]).mean()


def prompts(model, batch=2, seq=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(6, model.cfg.vocab_size, (batch, seq), generator=g)
    corrupted = clean.clone()
    corrupted[:, [2, 5]] = torch.randint(6, model.cfg.vocab_size, (batch, 2), generator=g)
    return clean, corrupted


@pytest.fixture(params=["alpha_er", "arcee_mha"])
def mha_model(request, tl_model_factory, hf_arcee_factory):
    """Multi-head attention on both families (TransformerLens's edge tools refuse grouped-query)."""
    if request.param == "alpha_er":
        return tl_model_factory("alpha_er")
    return HookedArcee.from_hf(hf_arcee_factory(0, vocab_size=31, hidden_size=16, intermediate_size=24,
                                                num_hidden_layers=2, num_attention_heads=4,
                                                num_key_value_heads=4, head_dim=4))


# ------------------------------------------------------------------------------------ direct path
def direct_path_sweep(model, clean, corrupted, component):
    """Our edge_patch, edge by edge, laid out as TransformerLens's all-sources sweep [L H L H] (with
    its roles: the corrupted run is the base, the clean run's head outputs the source)."""
    layers, heads = model.cfg.n_layers, model.cfg.n_heads
    groups = heads // model.cfg.n_key_value_heads
    pairs, sets = [], []
    for sl in range(layers):
        for sh in range(heads):
            for dl in range(sl + 1, layers):
                for dh in range(heads):
                    reader = (f"layers.{dl}.self_attn.head.{dh}.q" if component == "q"
                              else f"layers.{dl}.self_attn.kv_head.{dh // groups}.{component}")
                    pairs.append((sl, sh, dl, dh))
                    sets.append([(f"layers.{sl}.self_attn.head.{sh}", reader)])
    values = circuits.edge_patch(model, corrupted, clean, metric, sets)
    out = torch.zeros(layers, heads, layers, heads)
    for (sl, sh, dl, dh), v in zip(pairs, values):
        out[sl, sh, dl, dh] = v
    return out


@pytest.mark.skipif(not hasattr(tl_patching, "get_act_patch_direct_path"),
                    reason="transformer_lens.patching.get_act_patch_direct_path is TransformerLens 4.x only")
@pytest.mark.parametrize("component", ["q", "k", "v"])
def test_direct_path_patching_is_edge_patching(tl_model_factory, hf_arcee_factory, component):
    """Arcee only: TransformerLens takes a head's write to be z @ W_O, which alpha-er's factored o_proj
    (a LayerNorm across the heads' bottleneck) does not have (its W_O is a FactoredMatrix and the tool
    raises); circuits.path_patch covers alpha-er. Keys and values on the multi-head Arcee (TransformerLens
    refuses them under GQA), queries on both."""
    models = [HookedArcee.from_hf(hf_arcee_factory(0, vocab_size=31, hidden_size=16, intermediate_size=24,
                                                   num_hidden_layers=2, num_attention_heads=4,
                                                   num_key_value_heads=4, head_dim=4))]
    if component == "q":
        models.append(tl_model_factory("arcee"))  # GQA
    for model in models:
        clean, corrupted = prompts(model)
        with torch.no_grad():
            _, clean_cache = model.run_with_cache(clean)
            _, corrupted_cache = model.run_with_cache(corrupted)
            got = tl_patching.get_act_patch_direct_path_all_sources(model, corrupted, clean_cache, corrupted_cache,
                                                                     metric, component=component, verbose=False)
        expected = direct_path_sweep(model, clean, corrupted, component)
        # TransformerLens leaves 0.0 where the destination is not after the source.
        layer = torch.arange(model.cfg.n_layers)
        later = (layer[:, None, None, None] < layer[None, None, :, None]).expand_as(expected)
        torch.testing.assert_close(got[later], expected[later], rtol=1e-4, atol=1e-4)
        with torch.no_grad():
            assert (got[later] - float(metric(model(corrupted)))).abs().max() > 1e-3
        assert not model.cfg.use_split_qkv_input  # the sweep restored the switch


# ------------------------------------------------------------------------------------ attribution
def test_node_attribution_is_attribution_patching(tl_model):
    """Node granularity on both families (grouped-query Arcee included): (clean - corrupt) · grad on the
    corrupt run, per position and head, which is hooked_models.patching.attribution_patch (denoising)."""
    model = tl_model
    clean, corrupted = prompts(model)
    result = attribution.attribution_patch(model, clean, corrupted, metric)
    sweeps = {"attn_head_out": ("attention_head_outputs", ("layer", "seq", "num_heads")),
              "mlp_out": ("mlp_output", ("layer", "seq")), "embed": ("token_embeddings", ("seq",))}
    checked = 0
    for kind, (value, over) in sweeps.items():
        ours_ = patching.attribution_patch(model, clean, corrupted, metric, value, over).effect()
        for node, score in result.node_scores.items():
            if node.kind != kind:
                continue
            index = {"attn_head_out": (node.layer, node.position, node.head), "mlp_out": (node.layer, node.position),
                     "embed": (node.position,)}[kind]
            assert score == pytest.approx(float(ours_[index]), rel=1e-4, abs=1e-5), node
            checked += 1
    assert checked == len(result.node_scores)
    assert max(abs(s) for s in result.node_scores.values()) > 1e-2


@needs_edges
def test_edge_attribution_is_eap(mha_model):
    model = mha_model
    clean, corrupted = prompts(model)
    result = attribution.attribution_patch(model, clean, corrupted, metric,
                                           attribution.EdgeAttributionConfig(granularity="edge"))
    theirs = circuits.Graph.from_transformer_lens(model, result.edge_scores, clean.shape[1])
    graph = circuits.edge_attribution(model, corrupted, clean, metric, method="eap")
    assert theirs.edges == graph.edges  # every edge of ours, and no other, once summed over positions
    torch.testing.assert_close(theirs.scores, graph.scores, rtol=1e-4, atol=1e-5)
    assert graph.scores.abs().max() > 1e-2
    assert not (model.cfg.use_split_qkv_input or model.cfg.use_hook_mlp_in or model.cfg.use_attn_result)


@needs_edges
def test_transformer_lens_refuses_grouped_query_edges_that_circuits_scores(tl_model_factory):
    model = tl_model_factory("arcee")  # 4 query heads over 2 key/value heads
    clean, corrupted = prompts(model)
    with pytest.raises(ValueError, match="GQA"):
        attribution.attribution_patch(model, clean, corrupted, metric,
                                      attribution.EdgeAttributionConfig(granularity="edge"))
    graph = circuits.edge_attribution(model, clean, corrupted, metric, method="eap")
    assert any(reader.endswith("kv_head.1.k") for _, reader in graph.edges)


@needs_edges
def test_faithfulness_is_graph_faithfulness(mha_model):
    model = mha_model
    clean, corrupted = prompts(model, batch=1)
    seq = clean.shape[1]
    circuit = circuits.edge_attribution(model, clean, corrupted, metric, method="eap").top(12)
    # The same circuit in TransformerLens's per-position edges (its edge sweep lists every one): every
    # position of each kept edge.
    every = attribution.attribution_patch(model, clean, corrupted, metric,
                                          attribution.EdgeAttributionConfig(granularity="edge")).edge_scores
    kept = set(circuit.edges)
    name = lambda node: circuits.transformer_lens_node(model, node, seq)  # noqa: E731
    theirs = [(w, r) for w, r in every if (name(w), name(r)) in kept]
    result = attribution.faithfulness(model, clean, corrupted, metric, theirs)
    assert result.recovered == pytest.approx(circuit.faithfulness(model, clean, corrupted, metric), rel=1e-4, abs=1e-4)
    assert 0.05 < abs(result.recovered) and abs(result.recovered - 1) > 0.05  # neither end: the check can fail
