"""Shared data for the explorer's tests: the embedded models, a harvest of one of them, a small random SAE on
the harvested value, and attribution-graph files written by hand in circuit-tracer's schema."""

import json
import socket
import threading
import time

import pytest
import torch
import torch.nn as nn

from hooked_models import HookedAlphaEr, HookedArcee

PROMPT = "When Mary and John went to the store together, John gave a drink to"
CORRUPTED = "When Mary and John went to the store together, Mary gave a drink to"


def serve_in_thread(app):
    """`app` on a free port of 127.0.0.1 (loopback only), in a thread: (url, server, thread)."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server, thread


class ReluSAE(nn.Module):
    """A plain ReLU SAE (SAELens's standard architecture) with random, non-trivial weights."""

    def __init__(self, d_in: int, d_sae: int, hook_name: str, seed: int = 0, layer: int | None = None):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.W_enc = nn.Parameter(torch.randn(d_in, d_sae, generator=g) / d_in**0.5)
        self.b_enc = nn.Parameter(torch.randn(d_sae, generator=g) * 0.5 - 0.2)
        self.W_dec = nn.Parameter(torch.randn(d_sae, d_in, generator=g) / d_sae**0.5)
        self.b_dec = nn.Parameter(torch.randn(d_in, generator=g) * 0.1)
        self.hook_name, self.layer = hook_name, layer

    def encode(self, x):
        return torch.relu((x - self.b_dec) @ self.W_enc + self.b_enc)

    def decode(self, acts):
        return acts @ self.W_dec + self.b_dec


def graph_file(tokens: list[str], num_layers: int = 2) -> dict:
    """An attribution graph in circuit-tracer's graph-file schema, built by hand: an embedding node per
    position, two transcoder features per layer at the last positions, an error node, two logits; links
    from each layer to the next, one through attention with its per-head loadings."""
    last = len(tokens) - 1
    nodes = [{"node_id": f"E_{i}_{i}", "feature": i, "layer": "E", "ctx_idx": i, "feature_type": "embedding",
              "jsNodeId": f"E_{i}-{i}", "influence": 0.9} for i in range(len(tokens))]
    for layer in range(num_layers):
        for feature, pos, influence in ((3, last, 0.1 + layer * 0.2), (7, last - 4, 0.5 + layer * 0.3)):
            nodes.append({"node_id": f"{layer}_{feature}_{pos}", "feature": feature, "layer": str(layer),
                          "ctx_idx": pos, "feature_type": "cross layer transcoder", "jsNodeId": f"{layer}_{feature}-0",
                          "influence": influence, "activation": 1.5 + feature})
    nodes.append({"node_id": f"0_-1_{last}", "feature": -1, "layer": "0", "ctx_idx": last,
                  "feature_type": "mlp reconstruction error", "jsNodeId": f"0_-1-{last}", "influence": 0.4})
    for vocab, prob in ((39, 0.9), (20, 0.05)):
        nodes.append({"node_id": f"{num_layers + 1}_{vocab}_{last}", "feature": vocab, "layer": str(num_layers + 1),
                      "ctx_idx": last, "feature_type": "logit", "token_prob": prob, "is_target_logit": vocab == 39,
                      "jsNodeId": f"L_{vocab}-{last}", "clerp": f"Output {vocab} (p={prob})"})
    links = [
        {"source": f"E_{last - 4}_{last - 4}", "target": f"0_7_{last - 4}", "weight": 2.0},
        {"source": f"E_{last}_{last}", "target": f"0_3_{last}", "weight": 1.25},
        {"source": f"0_7_{last - 4}", "target": f"1_3_{last}", "weight": 0.75,
         "heads": {"layers.1.self_attn.head.2": 0.5, "layers.1.self_attn.head.0": 0.25}},
        {"source": f"0_3_{last}", "target": f"1_3_{last}", "weight": -0.5},
        {"source": f"0_-1_{last}", "target": f"1_7_{last - 4}", "weight": 0.3},
        {"source": f"1_3_{last}", "target": f"{num_layers + 1}_39_{last}", "weight": 3.0},
        {"source": f"1_7_{last - 4}", "target": f"{num_layers + 1}_20_{last}", "weight": -1.0},
    ]
    return {"metadata": {"slug": "ioi-by-hand", "scan": "embedded-arcee", "transcoder_list": [],
                         "prompt_tokens": tokens, "prompt": "".join(tokens), "node_threshold": 0.8},
            "qParams": {"pinnedIds": [f"0_7_{last - 4}"], "supernodes": [], "linkType": "both", "clickedId": "",
                        "sg_pos": ""},
            "nodes": nodes, "links": links}


@pytest.fixture(scope="session")
def arcee():
    return HookedArcee.from_pretrained("embedded").eval()


@pytest.fixture(scope="session")
def alpha_er():
    return HookedAlphaEr.from_pretrained("embedded").eval()


@pytest.fixture(scope="session")
def sae(arcee):
    return ReluSAE(arcee.cfg.hidden_size, 32, "blocks.1.hook_resid_post", layer=1)


@pytest.fixture(scope="session")
def transcoders(arcee):
    """Per-layer ReLU transcoders of random, non-trivial weights for the embedded Arcee."""
    from hooked_models.transcoders import Transcoder, TranscoderSet

    g = torch.Generator().manual_seed(0)
    layers = [Transcoder(arcee.cfg.hidden_size, 8, layer=layer) for layer in range(arcee.cfg.num_layers)]
    with torch.no_grad():
        for tc in layers:
            for p in tc.parameters():
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return TranscoderSet(layers, model=arcee)


@pytest.fixture(scope="session")
def real_graph(arcee, transcoders):
    """An attribution graph of PROMPT through the transcoders, with per-head loadings."""
    from hooked_models.attribution import attribute

    return attribute(arcee, PROMPT, transcoders, batch_size=256)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory, arcee, real_graph):
    """A directory the server may read: a harvest (`acts`) of the residual stream after layer 1 and of each
    MLP's input (the transcoders'), a graph file built by hand, one `attribute` wrote, a graph list, two bad ones;
    beside it, outside it, a secret file and a symlink inside pointing at it."""
    import datasets

    from hooked_models import corpus
    from hooked_models.embedded.task import make_ioi_prompts

    root = tmp_path_factory.mktemp("explorer")
    data = root / "data"
    data.mkdir()
    datasets.Dataset.from_dict({"text": make_ioi_prompts(64, 0).clean_text}).save_to_disk(str(root / "text"))
    corpus.harvest(arcee, str(root / "text"), ["layers.1.layer_output", "layers.0.mlp_input", "layers.1.mlp_input"],
                   str(data / "acts"), context_size=16, progress=False)
    (data / "graph.json").write_text(json.dumps(graph_file(arcee.to_str_tokens(PROMPT))))
    real_graph.to_json(data / "real_graph.json")
    # circuit-tracer's list of the directory's graphs (as features.write_beside_graph writes it): not a graph
    (data / "graph-metadata.json").write_text(json.dumps({"graphs": [{"slug": "real_graph"}]}))
    (data / "broken.json").write_text('{"metadata": {"slug": ')
    (data / "not_a_graph.json").write_text(json.dumps({"metadata": {"slug": "x"}, "nodes": [], "links": []}))
    (root / "secret.txt").write_text("outside the data directory")
    (data / "link").symlink_to(root / "secret.txt")
    return data
