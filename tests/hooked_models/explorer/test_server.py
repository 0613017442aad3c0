"""The explorer's JSON API: its numbers are the library's on the embedded models (each compared with the
library function called directly), and bad input and paths outside the data directories are refused with
a message while the server keeps answering."""

import json
import time

import pytest
import torch

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from hooked_models import circuits, features, patching  # noqa: E402
from hooked_models.explorer import create_app  # noqa: E402
from hooked_models.explorer.server import finite_list  # noqa: E402

from .conftest import CORRUPTED, PROMPT, ReluSAE, graph_file  # noqa: E402

PAIR = {"clean": PROMPT, "corrupted": CORRUPTED, "answer": " Mary", "wrong": " John"}


@pytest.fixture(scope="module")
def client(arcee, data_dir, sae, transcoders):
    return TestClient(create_app(arcee, [data_dir], {"resid 1": sae, "tc": transcoders}))


@pytest.fixture(scope="module")
def alpha_client(alpha_er, data_dir):
    return TestClient(create_app(alpha_er, [data_dir]))


def wait(client, answer: dict) -> dict:
    """The finished job's status (polling as the page does)."""
    for _ in range(600):
        status = client.get(f"/api/jobs/{answer['job']}").json()
        if status["state"] in ("done", "error"):
            return status
        time.sleep(0.05)
    raise AssertionError(f"job {answer} did not finish")


def metric(model):
    return patching.logit_diff_metric([model.to_single_token(" Mary")], [model.to_single_token(" John")])


def test_model_description(client, arcee):
    described = client.get("/api/model").json()
    assert (described["num_layers"], described["num_heads"], described["num_kv_heads"]) == (2, 4, 2)
    assert "layer_input" in described["values"] and "attention_head_outputs" in described["values"]
    assert described["saes"] == [
        {"name": "resid 1", "hook": "blocks.1.hook_resid_post", "value": "layers.1.layer_output",
         "d_sae": 32, "d_out": 64, "layer": 1},
        {"name": "tc[0]", "hook": "layers.0.mlp_input", "value": "layers.0.mlp_input", "d_sae": 8, "d_out": 64, "layer": 0},   # a TranscoderSet:
        {"name": "tc[1]", "hook": "layers.1.mlp_input", "value": "layers.1.mlp_input", "d_sae": 8, "d_out": 64, "layer": 1}]   # each layer's


@pytest.mark.parametrize("family", ["arcee", "alpha_er"])
def test_prompt_equals_the_library(family, request, client, alpha_client):
    model = request.getfixturevalue(family)
    answer = (client if family == "arcee" else alpha_client).post("/api/prompt", json={"prompt": PROMPT}).json()
    tokens = model.to_tokens(PROMPT)
    logits, cache = model.run_with_cache(tokens)
    probs = logits[0].softmax(-1)
    top = probs.topk(5, dim=-1)
    assert answer["tokens"] == model.to_str_tokens(tokens[0])
    assert [[g["id"] for g in row] for row in answer["top"]] == top.indices.tolist()
    assert [[g["prob"] for g in row] for row in answer["top"]] == top.values.tolist()
    assert answer["answer"] == " Mary"
    lens = cache.logit_lens(positions=None, targets=[model.to_single_token(" Mary")], return_type="probs")
    assert answer["lens_labels"] == lens.labels
    assert answer["lens_probs"] == lens.values[:, 0, :, 0].tolist()
    assert answer["lens_ranks"] == lens.readout.target_ranks[:, 0, :, 0].tolist()


def test_alpha_er_reads_a_short_prompt_padded_after_its_text(alpha_client, alpha_er):
    """alpha-er computes at multiples of its experts only: "When Mary" (3 tokens) is padded to its window.
    The oracle: the text's positions read nothing after them (causal attention), so the model on the text
    followed by any filler gives their logits; the prompt view's tokens, top tokens and answer at those
    positions are those, whatever the filler (padding before the text would move them)."""
    answer = alpha_client.post("/api/prompt", json={"prompt": "When Mary"}).json()
    tokens = alpha_er.to_tokens("When Mary")  # BOS first
    real, window = tokens.shape[1], len(answer["tokens"])
    assert (real, window) == (3, 16) and answer["real"] == real
    for filler in (0, 5):
        with torch.no_grad():
            probs = alpha_er(torch.cat([tokens, torch.full((1, window - real), filler)], 1))[0, :real].softmax(-1)
        top = probs.topk(5, dim=-1)
        assert [[g["id"] for g in row] for row in answer["top"][:real]] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([[g["prob"] for g in row] for row in answer["top"][:real]]),
                                   top.values, rtol=1e-5, atol=1e-7)
        assert answer["answer_id"] == int(top.indices[real - 1, 0])
    assert answer["tokens"][:real] == alpha_er.to_str_tokens(tokens[0])


def test_attention_equals_the_cache(client, alpha_client, arcee, alpha_er):
    answer = client.post("/api/attention", json={"prompt": PROMPT}).json()
    _, cache = arcee.run_with_cache(PROMPT)
    for layer in range(2):
        assert answer["patterns"][layer] == cache[f"layers.{layer}.self_attn.attention_probabilities"][0].tolist()
    assert answer["kv_head"] == [0, 0, 1, 1]  # 4 query heads over 2 key/value heads
    assert answer["soft_cap"] is None and answer["experts"] is None and answer["raw_scores"] is None

    answer = alpha_client.post("/api/attention", json={"prompt": PROMPT}).json()
    _, cache = alpha_er.run_with_cache(PROMPT)
    assert answer["soft_cap"] == alpha_er.cfg.attn_soft_cap == 30.0
    for layer in range(2):
        attn = f"layers.{layer}.self_attn"
        assert answer["patterns"][layer] == cache[f"{attn}.attention_probabilities"][0].tolist()
        assert answer["raw_scores"][layer] == finite_list(cache[f"{attn}.score_mod.attention_raw_scores"][0])
        assert answer["scores"][layer] == finite_list(cache[f"{attn}.attention_scores"][0])
        assert answer["experts"][layer] == cache[f"layers.{layer}.mlp.mlp_expert_index"][0].tolist()
    # The causal mask's -inf travels as null; the rest is the cap of the raw scores, as the page says.
    masked = torch.tensor([[[v is None for v in row] for row in head] for head in answer["scores"][0]])
    assert torch.equal(masked, torch.ones(16, 16, dtype=torch.bool).triu(1).expand(4, 16, 16))
    raw, capped = torch.tensor(answer["raw_scores"][0]), cache["layers.0.self_attn.attention_scores"][0]
    torch.testing.assert_close(capped[~masked], 30 * torch.tanh(raw[~masked] / 30))


@pytest.mark.parametrize("value, over", [("layer_input", None), ("attention_head_outputs", ["layer", "head"])])
def test_patching_job_equals_activation_patch(client, arcee, value, over):
    status = wait(client, client.post("/api/patch", json={**PAIR, "value": value, "over": over}).json())
    assert status["state"] == "done", status["error"]
    result = patching.activation_patch(arcee, PROMPT, CORRUPTED, metric(arcee), value, over, progress=False,
                                       position_labels=arcee.to_str_tokens(PROMPT))
    assert status["result"]["values"] == result.values.tolist()
    assert status["result"]["normalized"] == result.normalized().tolist()
    # the job's progress was activation_patch's own, through progress=: every patch of the sweep counted
    assert (status["done"], status["total"], status["unit"]) == (result.values.numel(),) * 2 + ("patch",)
    assert status["result"]["axes"] == list(result.axes) and status["result"]["labels"] == result.labels
    assert status["result"]["clean_metric"] == result.clean_metric > 5  # the answer flips: a real gap
    assert status["result"]["corrupted_metric"] == result.corrupted_metric < -5


def test_circuit_job_and_edge_patch_equal_the_library(client, arcee):
    status = wait(client, client.post("/api/circuit", json={**PAIR, "method": "eap-ig", "steps": 3}).json())
    assert status["state"] == "done", status["error"]
    result = status["result"]
    graph = circuits.edge_attribution(arcee, PROMPT, CORRUPTED, metric(arcee), "eap-ig", 3)
    scored = {(w, r): float(s) for (w, r), s in zip(graph.edges, graph.scores)}
    assert {(e["writer"], e["reader"]): e["score"] for e in result["edges"]} == scored
    magnitudes = [abs(e["score"]) for e in result["edges"]]
    assert magnitudes == sorted(magnitudes, reverse=True) and len(magnitudes) == len(circuits.graph(arcee)) == 82
    assert result["faithfulness"] == graph.faithfulness_curve(arcee, PROMPT, CORRUPTED, metric(arcee),
                                                              result["ks"]).tolist()
    assert result["ks"][0] == 0 and result["ks"][-1] == 82

    edge = result["edges"][0]
    answer = client.post("/api/edge", json={**PAIR, "writer": edge["writer"], "reader": edge["reader"]}).json()
    clean, patched = circuits.edge_patch(arcee, PROMPT, CORRUPTED, metric(arcee),
                                         [[], [(edge["writer"], edge["reader"])]]).tolist()
    assert (answer["edge_patch"], answer["clean_metric"]) == (patched, clean)
    assert answer["effect"] == patched - clean != 0


def test_feature_dashboard_and_search_equal_the_library(client, arcee, data_dir, sae):
    status = wait(client, client.post("/api/features/dashboard",
                                      json={"harvest": "acts", "sae": "resid 1", "feature": 5}).json())
    assert status["state"] == "done", status["error"]
    board = features.dashboard(arcee, data_dir / "acts", sae, 5)
    expected = json.loads(json.dumps({**board.__dict__, "windows": [w.__dict__ for w in board.windows]}))
    assert {k: v for k, v in status["result"].items() if k != "sae"} == expected
    assert status["result"]["windows"] and status["progress"] == 1.0

    status = wait(client, client.post("/api/features/search",
                                      json={"harvest": str(data_dir / "acts"), "sae": "resid 1", "token": " Mary"}).json())
    assert status["result"]["features"] == features.search_by_token(arcee, data_dir / "acts", sae, " Mary")


def test_graph_file_opens_as_written(client, data_dir, arcee):
    answer = client.post("/api/graph", json={"path": "graph.json"})
    assert answer.status_code == 200
    written = graph_file(arcee.to_str_tokens(PROMPT))
    opened = answer.json()
    assert [n["node_id"] for n in opened["nodes"]] == [n["node_id"] for n in written["nodes"]]
    assert opened["links"] == written["links"]  # per-head loadings travel with their link
    assert opened["qParams"]["pinnedIds"] == written["qParams"]["pinnedIds"]


def test_a_graph_attribute_wrote_opens_with_its_head_loadings(client, data_dir, real_graph, transcoders, arcee):
    written = json.loads((data_dir / "real_graph.json").read_text())
    opened = client.post("/api/graph", json={"path": "real_graph.json"}).json()
    # the file's nodes, and what the server adds to name them: the served per-layer transcoders' kind, logits' text
    added = ("feature_kind", "logit_token")
    assert [{k: v for k, v in n.items() if k not in added} for n in opened["nodes"]] == written["nodes"]
    for node in opened["nodes"]:
        if node["feature_type"] == "cross layer transcoder":
            assert node["feature_kind"] == "per-layer transcoder"  # the file's string says otherwise
        if node["feature_type"] == "logit":
            assert node["logit_token"] == arcee.to_str_tokens([node["feature"]])[0]
    assert [{k: v for k, v in link.items() if k != "heads"} for link in opened["links"]] == written["links"]
    # Each link's per-head split: for each attention layer it crosses, the heads' parts plus the part that
    # skips that layer are the link's weight (what attribute() guarantees, so a link matched to the wrong
    # pair of nodes fails here).
    names = {n["node_id"]: n for n in written["nodes"]}
    through = [link for link in opened["links"] if "heads" in link]
    assert through, "no link of the graph passes through attention"
    for link in through:
        for layer in {int(k.split(".")[1]) for k in link["heads"]}:
            parts = [v for k, v in link["heads"].items() if k.startswith(f"layers.{layer}.")]
            assert sum(parts) == pytest.approx(link["weight"], rel=1e-5, abs=1e-6)
        source, target = names[link["source"]], names[link["target"]]
        assert source["feature_type"] != "logit" and target["feature_type"] != "embedding"
    # the transcoders' features have dashboards: the node's layer and index name a feature of tc[layer]
    feature = next(n for n in written["nodes"] if n["feature_type"] == "cross layer transcoder")
    layer, index = int(feature["layer"]), int(feature["node_id"].split("_")[1])
    status = wait(client, client.post("/api/features/dashboard",
                                      json={"harvest": "acts", "sae": f"tc[{layer}]", "feature": index}).json())
    board = features.dashboard(arcee, data_dir / "acts", transcoders[layer], index)
    assert status["result"]["max_activation"] == board.max_activation and status["result"]["name"] == \
        f"layers.{layer}.mlp_input"


# ---------------------------------------------------------------------------------------------- refusals
REFUSED = [
    ("/api/prompt", {"prompt": PROMPT, "answer": " Zebra"}, 400, "' Zebra' is not in the vocabulary"),
    ("/api/prompt", {"prompt": "   "}, 400, "the prompt is empty"),
    # every size a request sets has a bound, named with the value in the 422 (requests.Limits)
    ("/api/prompt", {"prompt": PROMPT, "top_k": 0}, 422, "top_k=0: Input should be greater than or equal to 1"),
    ("/api/prompt", {"prompt": PROMPT, "top_k": 51}, 422, "top_k=51: Input should be less than or equal to 50"),
    ("/api/prompt", {"prompt": "a " * 50_001}, 422, "prompt=100002 characters: String should have at most 100000"),
    ("/api/circuit", {**PAIR, "steps": 100_000_000}, 422, "steps=100000000: Input should be less than or equal to 1000"),
    ("/api/circuit", {**PAIR, "method": "magic"}, 422, "method='magic': Input should be 'eap-ig' or 'eap'"),
    # a misspelt field is refused, not dropped (else this ran EAP-IG with its default 5 steps)
    ("/api/circuit", {**PAIR, "step": 100_000_000, "methd": "eap"}, 422,
     "step=100000000: not a field of this request; methd='eap': not a field of this request"),
    ("/api/graph", {"path": "graph.json", "layout": "tree"}, 422, "layout='tree': not a field of this request"),
    ("/api/features/search", {"harvest": "acts", "sae": "resid 1", "token": " Mary", "k": 51}, 422,
     "k=51: Input should be less than or equal to 50"),
    ("/api/features/dashboard", {"harvest": "acts", "sae": "resid 1", "feature": -1}, 422,
     "feature=-1: Input should be greater than or equal to 0"),
    ("/api/graph", {}, 422, "path: Field required"),
    ("/api/patch", {**PAIR, "wrong": " Zebra"}, 400, "' Zebra' is not in the vocabulary"),
    ("/api/patch", {**PAIR, "answer": " Mary Jane"}, 400, "' Mary Jane' is 2 tokens, not one"),
    ("/api/patch", {**PAIR, "corrupted": "When Mary and John went to the store, Mary gave a drink to"}, 400,
     "the clean prompt is 16 tokens and the corrupted one 15"),
    ("/api/patch", {**PAIR, "value": "no_such_value"}, 400, "no_such_value"),
    ("/api/edge", {**PAIR, "writer": "layers.1.mlp", "reader": "layers.0.mlp"}, 400, "layers.1.mlp"),
    ("/api/graph", {"path": "broken.json"}, 400, "'broken.json' does not parse as JSON"),
    ("/api/graph", {"path": "not_a_graph.json"}, 400, "not an attribution graph in circuit-tracer's schema"),
    ("/api/graph", {"path": "missing.json"}, 400, "'missing.json' does not exist"),
    ("/api/graph", {"path": "../secret.txt"}, 403, "outside the data directories"),
    ("/api/graph", {"path": "acts/../../secret.txt"}, 403, "outside the data directories"),
    ("/api/graph", {"path": "/etc/passwd"}, 403, "outside the data directories"),
    ("/api/graph", {"path": "link"}, 403, "outside the data directories"),  # a symlink out
    ("/api/features/dashboard", {"harvest": "acts", "sae": "resid 1", "feature": 32}, 400,
     "feature=32 is outside [0, 31]: the SAE has 32 features"),
    ("/api/features/dashboard", {"harvest": "acts", "sae": "nope", "feature": 0}, 400, "no SAE or transcoder named"),
    ("/api/features/dashboard", {"harvest": "../", "sae": "resid 1", "feature": 0}, 403, "outside the data"),
    ("/api/features/search", {"harvest": "acts", "sae": "resid 1", "token": " Zebra"}, 400, "not in the vocabulary"),
]


@pytest.mark.parametrize("route, body, code, message", REFUSED, ids=[f"{r[0]}:{r[3][:30]}" for r in REFUSED])
def test_bad_input_is_refused_and_the_server_serves_on(client, route, body, code, message):
    answer = client.post(route, json=body)
    assert answer.status_code == code
    assert message in answer.json()["error"]
    assert client.get("/api/model").status_code == 200


def test_a_sweep_over_its_bound_is_refused_before_it_runs(arcee, data_dir):
    # The embedded model's largest sweep (2 layers x 16 positions x 256 neurons) is under the default bound:
    # with a bound of 4096 patches it is refused, and no job is queued.
    import dataclasses

    app = create_app(arcee, [data_dir])
    explorer = app.state.explorer
    explorer.limits = dataclasses.replace(explorer.limits, patches=4096)
    answer = TestClient(app).post("/api/patch", json={**PAIR, "value": "mlp_neurons", "over": ["layer", "seq", "neuron"]})
    assert answer.status_code == 400
    assert answer.json()["error"] == ("the sweep of mlp_neurons over ['layer', 'seq', 'neuron'] is 8192 patches, "
                                      "over the bound 4096: sweep fewer axes")
    assert explorer.queue.jobs == {}
    assert TestClient(app).post("/api/patch", json={**PAIR, "value": "mlp_neurons"}).status_code == 200  # 2 x 256


def test_a_sweep_of_exactly_its_bound_runs(arcee, data_dir):
    # The boundary itself: mlp_neurons over its default axes is 2 x 256 = 512 patches; a bound of 512
    # lets it run, a bound of 511 refuses it.
    import dataclasses

    app = create_app(arcee, [data_dir])
    explorer, client = app.state.explorer, TestClient(app)
    explorer.limits = dataclasses.replace(explorer.limits, patches=511)
    answer = client.post("/api/patch", json={**PAIR, "value": "mlp_neurons"})
    assert answer.status_code == 400
    assert "is 512 patches, over the bound 511" in answer.json()["error"]
    explorer.limits = dataclasses.replace(explorer.limits, patches=512)
    answer = client.post("/api/patch", json={**PAIR, "value": "mlp_neurons"})
    assert answer.status_code == 200
    assert wait(client, answer.json())["state"] == "done"


def test_a_sibling_whose_name_starts_with_the_data_directory_is_outside_it(client, data_dir):
    # data_evil/ beside data/: a string-prefix comparison of the paths would let it through
    evil = data_dir.parent / f"{data_dir.name}_evil"
    evil.mkdir(exist_ok=True)
    (evil / "graph.json").write_text((data_dir / "graph.json").read_text())
    for spelling in (str(evil / "graph.json"), f"../{evil.name}/graph.json"):
        answer = client.post("/api/graph", json={"path": spelling})
        assert answer.status_code == 403 and "outside the data directories" in answer.json()["error"], spelling
    assert client.get("/api/files", params={"path": str(evil)}).status_code == 403


def test_files_list_only_under_the_data_directories(client, data_dir):
    listed = client.get("/api/files", params={"path": str(data_dir)}).json()["entries"]
    kinds = {e["name"]: e["kind"] for e in listed}
    assert kinds["acts"] == "harvest" and kinds["graph.json"] == "json"
    # circuit-tracer's list of the directory's graphs is JSON but not a graph: the picker (kind "json") skips it
    assert kinds["graph-metadata.json"] == "graph list"
    for outside in ("..", str(data_dir.parent), "/"):
        answer = client.get("/api/files", params={"path": outside})
        assert answer.status_code == 403 and "outside the data directories" in answer.json()["error"]
    assert client.get("/api/jobs/nope").status_code == 404
    assert client.get("/static/../server.py").status_code == 404  # the static mount stays in its folder


def test_a_failing_job_reports_its_message(arcee, data_dir):
    # An SAE on a value the harvest does not hold: only the job's pass finds out.
    other = TestClient(create_app(arcee, [data_dir], {"resid 0": ReluSAE(64, 8, "blocks.0.hook_resid_pre")}))
    status = wait(other, other.post("/api/features/dashboard",
                                    json={"harvest": "acts", "sae": "resid 0", "feature": 0}).json())
    assert status["state"] == "error" and "the harvest has no column 'layers.0.layer_input'" in status["error"]
    assert other.get("/api/model").status_code == 200


def test_a_running_job_does_not_block_the_server(client):
    # A job running on the jobs' replica (here: waiting on an event) leaves every route answering, the
    # model views too, and its status says it runs; once released, it finishes.
    import threading

    release = threading.Event()
    explorer = client.app.state.explorer
    job = explorer.submit("wait", lambda model, job: release.wait(30) and "released")
    for _ in range(100):
        if client.get(f"/api/jobs/{job['job']}").json()["state"] == "running":
            break
        time.sleep(0.02)
    assert client.get(f"/api/jobs/{job['job']}").json()["state"] == "running"
    assert client.get("/api/model").status_code == 200 and client.get("/api/files").status_code == 200
    assert client.post("/api/graph", json={"path": "graph.json"}).status_code == 200
    assert client.post("/api/prompt", json={"prompt": PROMPT}).status_code == 200
    assert [j["id"] for j in client.get("/api/jobs").json()["jobs"]] == [job["job"]]
    release.set()
    assert wait(client, job)["result"] == "released"


@pytest.mark.parametrize("family", ["arcee", "alpha_er"])
def test_the_shipped_transcoders_open_in_the_features_view(family, request, data_dir):
    from hooked_models.explorer.server import load_sae

    model = request.getfixturevalue(family)
    shipped = load_sae("embedded", model)  # `--sae embedded`: transcoders.load_transcoders("embedded", model)
    described = TestClient(create_app(model, [data_dir], {"embedded": shipped})).get("/api/model").json()
    assert [(s["name"], s["hook"], s["layer"]) for s in described["saes"]] == [
        (f"embedded[{layer}]", f"layers.{layer}.mlp_input", layer) for layer in range(model.cfg.num_layers)]


def test_the_command_line_parses_explore():
    from hooked_models.__main__ import build_parser

    args = build_parser().parse_args(["explore", "--family", "alpha-er", "--data", "a", "b", "--port", "8123"])
    assert (args.command, args.model, args.family, args.data, args.port, args.host) == (
        "explore", "embedded", "alpha-er", ["a", "b"], 8123, "127.0.0.1")


def test_with_no_sae_the_graphs_transcoders_are_offered(tmp_path, arcee, real_graph, transcoders):
    # `explore --data DIR` without --sae: a graph's directory alone offers the transcoders its graphs name
    from hooked_models.explorer.server import graph_transcoders
    from hooked_models.transcoders import load_transcoders

    data = tmp_path / "data"
    data.mkdir()
    real_graph.to_json(data / "ioi.json")                 # built with `transcoders`, not the shipped ones
    (data / "graph-metadata.json").write_text('{"graphs": [{"slug": "ioi"}]}')
    found, notes = graph_transcoders(arcee, [data], embedded=True)
    # the shipped set reads the same hooks, but gives the graph's features other activations: not offered
    assert found == {} and notes == ["ioi.json: no transcoder set at hand gives its features' activations "
                                     "(name its set with --sae DIR)"]
    transcoders.save(data / "mine")                       # a set in a folder of the data directory
    found, notes = graph_transcoders(arcee, [data], embedded=False)
    assert list(found) == ["mine"] and notes == []
    assert all(torch.equal(a, b) for a, b in zip(found["mine"].state_dict().values(), transcoders.state_dict().values()))
    # a graph of the shipped set beside it: both sets offered, each for its own graph
    from hooked_models.attribution import attribute

    shipped = load_transcoders("embedded", arcee)
    attribute(arcee, PROMPT, shipped, batch_size=256).to_json(data / "shipped.json")
    found, notes = graph_transcoders(arcee, [data], embedded=True)
    assert sorted(found) == ["embedded", "mine"] and notes == []
    assert torch.equal(found["embedded"][1].W_enc, shipped[1].W_enc)
    # served: the features view lists each layer of each set, and a feature of the graph opens
    client = TestClient(create_app(arcee, [data], found))
    assert [s["name"] for s in client.get("/api/model").json()["saes"]] == [
        "embedded[0]", "embedded[1]", "mine[0]", "mine[1]"]
    # no graph file: nothing is offered and nothing said
    assert graph_transcoders(arcee, [tmp_path / "data" / "mine"], embedded=True) == ({}, [])
