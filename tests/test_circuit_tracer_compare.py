"""The side by side with circuit-tracer (benchmarks/circuit_tracer_compare.py): its comparison, and, where
the side environment .ci/ct-env exists (`bash .ci/ct-env.sh`; circuit-tracer never shares this one), the
same graph from both on the embedded Arcee."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import circuit_tracer_compare as ct  # noqa: E402
from hooked_models.attribution import attribute  # noqa: E402
from hooked_models.families import load_model  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return load_model("embedded", family="arcee")


def as_circuit_tracer(graph) -> dict:
    """Our graph as circuit-tracer lays it out: no position-0 features, its position-0 errors zero."""
    keep = torch.cat([(graph.active_features[:, 1] != 0).nonzero().flatten(),
                      torch.arange(graph.error_start, graph.n_nodes)])
    adjacency = graph.adjacency_matrix[keep][:, keep].clone()
    n = int((graph.active_features[:, 1] != 0).sum())
    adjacency[:, n + torch.arange(0, graph.n_errors, graph.n_pos)] = 0
    features = graph.active_features[graph.active_features[:, 1] != 0]
    return {"adjacency_matrix": adjacency, "active_features": features, "selected_features": torch.arange(n),
            "activation_values": graph.activation_values[graph.active_features[:, 1] != 0],
            "logit_tokens": graph.logit_tokens, "logit_probabilities": graph.logit_probabilities}


def test_compare_reconciles_position_0_and_finds_a_changed_edge_or_node(model):
    transcoders = ct.jumprelu_transcoders(model, 64, seed=1)
    graph = attribute(model, model.to_tokens(ct.PROMPT), transcoders, desired_logit_prob=0.99999,
                      head_loadings=False, keep_position_zero=True)
    assert graph.n_logits == 10 and (graph.active_features[:, 1] == 0).any()
    theirs = as_circuit_tracer(graph)
    same = ct.compare(graph, theirs)
    assert same["node_sets_equal"] and same["max_abs_diff"] == 0 and same["their_position_0_error_columns_zero"]
    assert same["our_position_0_features_left_out"] == int((graph.active_features[:, 1] == 0).sum())

    moved = dict(theirs, adjacency_matrix=theirs["adjacency_matrix"].clone())
    moved["adjacency_matrix"][-1, 0] += 0.5
    assert ct.compare(graph, moved)["max_abs_diff"] == pytest.approx(0.5, rel=1e-6)
    # An edge at a position-0 node that circuit-tracer lacks is left out; one that it has is not.
    ours_moved = replace(graph, adjacency_matrix=graph.adjacency_matrix.clone())
    ours_moved.adjacency_matrix[-1, graph.embedding_start] += 0.25
    assert ct.compare(ours_moved, theirs)["max_abs_diff"] == pytest.approx(0.25, rel=1e-6)

    fewer = dict(theirs, active_features=theirs["active_features"][1:], selected_features=torch.arange(
        theirs["active_features"].shape[0] - 1))
    assert not ct.compare(graph, fewer)["node_sets_equal"]
    other_logits = dict(theirs, logit_tokens=theirs["logit_tokens"].flip(0))
    assert not ct.compare(graph, other_logits)["node_sets_equal"]


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """Both sides' workers (benchmarks/circuit_tracer_driver.py), where the side environment exists."""
    if not ct.SIDE_PYTHON.exists():
        pytest.skip(f"no side environment at {ct.SIDE_PYTHON} (bash .ci/ct-env.sh builds it: circuit-tracer 0.5.0, "
                    "transformers 4.57)")
    from benchmarks.circuit_tracer_driver import Session

    session = Session(tmp_path_factory.mktemp("circuit-tracer"))
    yield session
    session.close()


@pytest.mark.parametrize("seq, max_feature_nodes", [(16, None), (64, None), (32, 256), (64, 512)])
def test_same_graph_as_circuit_tracer_on_the_embedded_arcee(session, seq, max_feature_nodes):
    """Every feature, and a feature budget (circuit-tracer's selection, position 0 dropped by default on
    both sides): the same features, logits and edges. (circuit-tracer cannot attribute on alpha-er, the
    other embedded model: tests/test_circuit_tracer_alpha_er.py compares the forward it can run.)"""
    case = ct.Case("embedded", "embedded", 128, seq, max_feature_nodes=max_feature_nodes)
    figures = session.compared(case, batch_size=32, desired_logit_prob=0.99999)
    assert figures["node_sets_equal"], figures
    assert len(figures["logit_tokens"]) > 1  # (the same tokens: part of node_sets_equal)
    assert figures["features"] == max_feature_nodes if max_feature_nodes else figures["features"] > 100
    assert figures["their_position_0_error_columns_zero"]
    assert figures["max_abs_activation_diff"] == 0 and figures["max_abs_logit_probability_diff"] == 0
    # float32 rounding: 2e-7 of the largest edge on this model (benchmarks/results/circuit_tracer_compare.json)
    assert figures["max_abs_diff_relative"] < 1e-6, figures
