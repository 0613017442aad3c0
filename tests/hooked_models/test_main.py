"""The command line's rough edges (hooked_models/__main__.py): a user's error is one line in the command
line's words (the traceback behind --debug), Ctrl-C during a harvest says how to resume, a mistyped value
gets a suggestion, the top list holds only locations with an effect, --help imports no torch, and the
pool is sized to the work."""

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")

from hooked_models import corpus  # noqa: E402
from hooked_models.__main__ import cli_words, main  # noqa: E402
from hooked_models.corpus import engines  # noqa: E402
from hooked_models.corpus.harvester import HarvestSummary  # noqa: E402
from hooked_models.embedded.task import make_ioi_prompts  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PROG = "python -m hooked_models"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A text corpus, IOI prompt pairs (datasets on disk) and token windows (.npy) of the embedded models."""
    where = tmp_path_factory.mktemp("cli")
    model = corpus.load_model("embedded")
    datasets.Dataset.from_dict({"text": make_ioi_prompts(16, 0).clean_text}).save_to_disk(str(where / "text"))
    ioi = make_ioi_prompts(8, 1, tokenizer=model.tokenizer)
    pairs = {"clean": ioi.clean_tokens, "corrupted": ioi.corrupted_tokens, "answer": ioi.correct,
             "wrong": ioi.incorrect}
    datasets.Dataset.from_dict({k: v.tolist() for k, v in pairs.items()}).save_to_disk(str(where / "pairs"))
    np.save(where / "tokens.npy", ioi.clean_tokens.numpy())
    (where / "full").mkdir()
    (where / "full" / "something").write_text("not a harvest")
    return where


def harvest(files, *flags) -> list[str]:
    return ["harvest", "--model", "embedded", "--names", "layers.1.layer_output", "--no-progress", *flags]


# Each: the arguments (given the files), and what the one line must say.
ERRORS = {
    "alpha-er length": (lambda f: harvest(f, "--family", "alpha_er", "--dataset", str(f / "text"), "--out",
                                          str(f / "a"), "--context-size", "14"),
                        ["--context-size 14", "not a multiple of mlp_experts=4", "choose a --context-size"]),
    "text without a context size": (lambda f: harvest(f, "--dataset", str(f / "text"), "--out", str(f / "b")),
                                    ["--context-size is needed to pack text"]),
    "no resume": (lambda f: harvest(f, "--dataset", str(f / "tokens.npy"), "--out", str(f / "full"), "--no-resume"),
                  ["is not empty; drop --no-resume to continue the harvest there"]),
    "local with workers": (lambda f: harvest(f, "--dataset", str(f / "tokens.npy"), "--out", str(f / "c"),
                                             "--workers", "2"),
                           ["--workers 2 needs --engine ray"]),
    "missing file": (lambda f: harvest(f, "--dataset", str(f / "missing.npy"), "--out", str(f / "d")),
                     ["missing.npy"]),
    "unknown name": (lambda f: ["harvest", "--model", "embedded", "--names", "layers.1.layer_outptu",
                                "--dataset", str(f / "tokens.npy"), "--out", str(f / "e"), "--no-progress"],
                     ["no hook named 'layers.1.layer_outptu'", "did you mean 'layers.1.layer_output'"]),
    "mistyped value": (lambda f: ["patch", "--model", "embedded", "--pairs", str(f / "pairs"), "--value",
                                  "layer_inptu", "--no-progress"],
                       ["has no value 'layer_inptu'; did you mean 'layer_input'?"]),
}


@pytest.mark.parametrize("case", ERRORS)
def test_a_user_error_is_one_line_in_the_command_line_words(files, capsys, case):
    arguments, said = ERRORS[case]
    assert main(arguments(files)) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    command = arguments(files)[0]
    assert lines[0].startswith(f"{PROG} {command}: error: ") and lines[0].endswith("(--debug shows the traceback)")
    for words in said:
        assert words in lines[0]
    for api_word in ("context_size", "num_workers", "resume=True", "engine=", "model.generate", "Traceback"):
        assert api_word not in lines[0]


def test_debug_keeps_the_traceback(files):
    with pytest.raises(ValueError, match="mlp_experts"):
        main(ERRORS["alpha-er length"][0](files) + ["--debug"])


def test_cli_words():
    assert cli_words("engine='local' runs one worker; num_workers=2 needs engine='ray'") == \
        "--engine local runs one worker; --workers 2 needs --engine ray"
    assert cli_words("out='x y' is a file,\n  not a directory") == "--out x y is a file, not a directory"
    assert cli_words("block_size=16 and mlp_experts=4 stay") == "block_size=16 and mlp_experts=4 stay"


def test_patch_lists_only_locations_with_an_effect(files, capsys):
    """The embedded Arcee's prompts differ at one name: most (layer, position) patches change nothing, and
    the top list stops at the ones that do."""
    assert main(["patch", "--model", "embedded", "--pairs", str(files / "pairs"), "--over", "layer", "seq",
                 "--top", "40", "--no-progress"]) == 0
    printed = capsys.readouterr().out.splitlines()
    expected = corpus.patch("embedded", str(files / "pairs"), "layer_input", ("layer", "seq"))
    moved = int((expected.effect() != 0).sum())
    assert 0 < moved < expected.values.numel() < 40
    assert printed[1:1 + moved] == [f"  {label:<24} {value:.4g}" for label, value in expected.top(moved)]
    assert printed[1 + moved] == f"  (the other {expected.values.numel() - moved} locations: no effect)"
    assert printed[2 + moved].startswith("patched ")


def test_help_imports_neither_torch_nor_transformer_lens():
    code = ("import sys\nfrom hooked_models.__main__ import main\ntry:\n    main(['harvest', '--help'])\n"
            "except SystemExit:\n    pass\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformer_lens', 'numpy', 'ray'}))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "--context-size" in result.stdout and result.stdout.strip().endswith("[]")


@pytest.mark.parametrize("module", ["hooked_models.attribution", "hooked_models.features",
                                    "hooked_models.transcoders"])
def test_reading_graphs_statistics_and_transcoders_does_not_import_transformer_lens(module):
    # Loading a graph store, feature statistics or a transcoder set needs no model: TransformerLens (seconds
    # to import) comes in with the first hooked model, not before.
    code = f"import sys\nimport {module}\nprint('transformer_lens' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_ctrl_c_during_a_harvest_says_how_to_resume(tmp_path):
    """SIGINT once a shard is done: exit 130, and one line (after the ^C) that says to rerun the command."""
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(1, 100, size=(1000, 16)))
    command = [sys.executable, "-m", "hooked_models", "harvest", "--model", "embedded", "--names",
               "layers.1.layer_output", "--dataset", str(tmp_path / "tokens.npy"), "--out", str(tmp_path / "out"),
               "--shard-size", "8", "--batch-size", "8", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    manifest = tmp_path / "out" / "manifest.json"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None:
        if manifest.exists() and json.loads(manifest.read_text()).get("shards"):  # replaced whole, never partial
            break
        time.sleep(0.2)
    assert process.poll() is None, process.communicate()
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [f"interrupted: the shards done are kept in {tmp_path / 'out'}; run the same command "
                     "again to resume"]


def test_a_pool_has_no_more_workers_than_units():
    assert [engines.pool_size(4, units) for units in (0, 1, 3, 4, 9)] == [1, 1, 3, 4, 4]
    summary = HarvestSummary(Path("out"), ("layers.1.layer_output",), 8, 16, 1, 1, 2.0, 2, "ray", 2)
    assert summary.workers == 1
    assert "(ray, 1 worker (--workers 2, but 1 shard to run: a worker takes a shard at a time)" in \
        cli_words(str(summary))


def test_a_cluster_the_run_starts_drops_only_the_token_auth_notice(monkeypatch):
    """Ray logs "Token authentication is enabled" on every start of a local cluster (it is the default):
    the run drops that notice, during its own ray.init only; the logger's other messages still show."""
    ray = pytest.importorskip("ray")
    logger = logging.getLogger(engines._AUTH_LOGGER)
    notices = ["Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.",
               "Token authentication is disabled for this Ray cluster. Anyone with network access ..."]
    shown = []

    class Keep(logging.Handler):
        def emit(self, record):
            shown.append(record.getMessage())

    handler = Keep()
    logger.addHandler(handler)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: [logger.warning(notice) for notice in notices])
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    try:
        with engines.ray_cluster():
            pass
        assert shown == notices[1:]
        logger.warning(notices[0])  # outside the run's start: shown
        assert shown == notices[1:] + notices[:1]
    finally:
        logger.removeHandler(handler)


def test_a_ray_run_starts_no_more_actors_than_units(monkeypatch):
    """`--workers 2` on one shard: the actor pool has one actor (Ray warned, and a replica loaded to idle)."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    sizes = []

    class Units:
        def map_batches(self, *args, compute, **kwargs):
            return self

        def iter_rows(self):
            return iter([])

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(ray.data, "from_items", lambda items, **kwargs: Units())
    monkeypatch.setattr(ray.data, "ActorPoolStrategy", lambda size: sizes.append(size))
    for units, workers in ((1, 2), (3, 2), (5, 8)):
        list(engines.run(object, None, None, [{"shard": s} for s in range(units)], "ray", workers))
    assert sizes == [1, 2, 5]


def test_explore_with_data_and_no_sae_serves_the_graphs_transcoders(tmp_path, monkeypatch, capsys):
    # `explore --data DIR` alone, DIR holding a graph of the shipped transcoders: the features view gets them
    # (before, it had none and failed with sae=''); serving itself is replaced by a recorder.
    import socket

    import hooked_models.explorer
    from hooked_models import HookedArcee
    from hooked_models.attribution import attribute
    from hooked_models.transcoders import load_transcoders

    model = HookedArcee.from_pretrained("embedded")
    attribute(model, "When Mary and John went to the store, John gave a drink to",
              load_transcoders("embedded", model), batch_size=256).to_json(tmp_path / "ioi.json")
    served = {}
    monkeypatch.setattr(hooked_models.explorer, "serve", lambda model, data, saes, **kw: served.update(saes=saes))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["explore", "--data", str(tmp_path), "--port", str(port)]) == 0
    assert list(served["saes"]) == ["embedded"]
    assert "the graphs' transcoders embedded (no --sae given)" in capsys.readouterr().out
