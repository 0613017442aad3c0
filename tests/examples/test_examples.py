"""The example scripts run end to end and write their figures.

The main job runs as a user runs it, `python examples/activation_patching.py` in a subprocess; the
others run in this process through runpy (as `__main__`, with their own argv), because a fresh
interpreter pays 5+ s of imports on CI's two cores.
"""

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def run_example(script: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture
def run_in_process(monkeypatch, capsys):
    """Run an example as `python examples/SCRIPT ARGS` would, in this interpreter; returns its stdout."""

    def run(script: str, *args: str) -> str:
        monkeypatch.syspath_prepend(str(ROOT / "examples"))
        monkeypatch.setattr(sys, "argv", [script, *args])
        capsys.readouterr()
        runpy.run_path(str(ROOT / "examples" / script), run_name="__main__")
        return capsys.readouterr().out

    return run


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.fixture(scope="module")
def alpha_er_checkpoint(tmp_path_factory, reference_alpha_er_classes):
    """A tiny random alpha-er in the reference's checkpoint format (no tokenizer: the induction task)."""
    import torch

    from hooked_models import HookedAlphaEr

    classes = reference_alpha_er_classes
    torch.manual_seed(0)
    reference = classes["model"](classes["config"](**classes["tiny"]))
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.3)
    path = tmp_path_factory.mktemp("alpha_er") / "alpha-er.safetensors"
    HookedAlphaEr.from_reference(reference).save_pretrained(path)
    return path


def test_activation_patching_finds_the_embedded_circuit(tmp_path):
    out = tmp_path / "resid.png"
    stdout = run_example("activation_patching.py", "--out", str(out), "--prompts", "8", "--attribution")
    assert "HookedArcee" in stdout and "IOI" in stdout
    # The IOI answer is decided by the repeated name (S2): its residual stream, patched in layer 0,
    # restores the clean answer; so does the last position later on.
    strongest = stdout.split("strongest locations")[1].splitlines()[1:3]
    assert any("S2" in line and "restored   1.0" in line for line in strongest), stdout
    assert_png(out)
    assert_png(tmp_path / "resid_attribution.png")


def test_activation_and_head_patching_on_an_alpha_er_checkpoint(tmp_path, alpha_er_checkpoint, run_in_process):
    stdout = run_in_process("activation_patching.py", "--model", str(alpha_er_checkpoint), "--prompts", "4",
                         "--out", str(tmp_path / "resid.png"), "--batch-size", "5")
    assert "HookedAlphaEr" in stdout and "induction" in stdout
    assert_png(tmp_path / "resid.png")
    stdout = run_in_process("head_patching.py", "--model", str(alpha_er_checkpoint), "--prompts", "4",
                         "--out", str(tmp_path / "heads.png"))
    assert "values (by key/value head)" in stdout
    assert_png(tmp_path / "heads.png")


def test_activation_patching_on_an_hf_arcee_directory(tmp_path, hf_arcee_factory, run_in_process):
    from hooked_models import HookedArcee

    HookedArcee.from_hf(hf_arcee_factory()).save_pretrained(str(tmp_path / "arcee"))
    stdout = run_in_process("activation_patching.py", "--model", str(tmp_path / "arcee"), "--prompts", "4",
                            "--out", str(tmp_path / "resid.png"))
    assert stdout.startswith("HookedArcee (2 layers)") and "induction" in stdout  # detected; no tokenizer
    assert_png(tmp_path / "resid.png")


def test_head_patching_on_the_embedded_arcee(tmp_path, run_in_process):
    stdout = run_in_process("head_patching.py", "--prompts", "8", "--out", str(tmp_path / "heads.png"))
    assert "2 key/value heads" in stdout
    # The IOI circuit's first step (tutorial 2): layer 0's head 2 moves the repeated name to the end,
    # through the values of its key/value head 1.
    assert "head output (z)              strongest: L0 H2" in stdout
    assert "values (by key/value head)   strongest: L0 KV1" in stdout
    assert_png(tmp_path / "heads.png")


def test_alpha_er_experts_on_the_embedded_model(tmp_path, run_in_process):
    stdout = run_in_process("alpha_er_experts.py", "--prompts", "8", "--out", str(tmp_path / "experts.png"))
    assert "expert of each position: [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]" in stdout
    # The answer is read at position 15, expert 3's: in the last layer no other expert can move it, and
    # experts 0 and 1 own positions before the prompts' only difference, so an E3 patch comes first.
    assert stdout.split("experts (MLP output of each window)")[1].split("strongest: ")[1].startswith(("L1 E3", "L0 E3"))
    # The logits are linear in the LM head's normed bottleneck: its attribution estimate is exact.
    assert stdout.split("LM-head bottleneck units (normed)")[1].split("\n")[0].endswith("correlation 1.00")
    assert_png(tmp_path / "experts.png")


def test_a_model_with_its_own_tokenizer_gets_text_ioi_prompts(hf_arcee_factory, monkeypatch):
    """What --model gives an AFM checkpoint: IOI sentences through the model's tokenizer (here the word-level
    one, on a model whose vocabulary is not the embedded one), aligned, answers single tokens."""
    from hooked_models import HookedArcee
    from hooked_models.embedded.task import build_tokenizer

    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    from common import make_task

    model = HookedArcee.from_hf(hf_arcee_factory(vocab_size=131)).eval()
    model.tokenizer = build_tokenizer()
    task = make_task(model, prompts=6, seed=0)
    assert task.name == "IOI (the model's tokenizer)" and task.clean.shape == task.corrupted.shape == (6, 16)
    differ = (task.clean != task.corrupted).nonzero()[:, 1]
    assert differ.tolist() == [11] * 6
    # The clean answer is the name said once, which the corrupted prompt repeats instead.
    assert torch.equal(task.corrupted[:, 11], task.correct) and not torch.equal(task.clean[:, 11], task.correct)
    assert task.read_at == 15


def test_alpha_er_experts_offers_only_what_it_runs(tmp_path, hf_arcee_factory, run_in_process, capsys):
    """The script runs alpha-er only: it has no --family to choose Arcee with, says so in --help, and refuses
    an Arcee checkpoint by name before loading it. Every example takes dtype names (bf16, fp16)."""
    from hooked_models import HookedArcee

    with pytest.raises(SystemExit):
        run_in_process("alpha_er_experts.py", "--help")
    usage = capsys.readouterr().out
    assert "--family" not in usage and "alpha-er checkpoint" in usage and "Arcee" not in usage
    with pytest.raises(SystemExit):
        run_in_process("alpha_er_experts.py", "--family", "arcee")
    assert "unrecognized arguments: --family arcee" in capsys.readouterr().err
    HookedArcee.from_hf(hf_arcee_factory()).save_pretrained(str(tmp_path / "arcee"))
    with pytest.raises(SystemExit, match="is an HF Arcee directory .*; this script runs alpha-er only"):
        run_in_process("alpha_er_experts.py", "--model", str(tmp_path / "arcee"))
    with pytest.raises(SystemExit):
        run_in_process("activation_patching.py", "--dtype", "int8")
    assert "argument --dtype: dtype 'int8' is not a floating-point dtype" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_in_process("head_patching.py", "--help")
    assert "--family {arcee,alpha-er}" in capsys.readouterr().out


def test_an_example_runs_in_a_named_dtype(tmp_path, run_in_process):
    stdout = run_in_process("head_patching.py", "--dtype", "bf16", "--prompts", "4", "--out", str(tmp_path / "h.png"))
    assert "2 key/value heads" in stdout
    assert_png(tmp_path / "h.png")


def test_train_sae_trains_evaluates_and_reads_features(tmp_path, run_in_process):
    """SAELens's runner trains on the embedded model, its evals and the spliced SAE report sensible figures."""
    pytest.importorskip("sae_lens", reason="train_sae.py needs SAELens (pip install -e '.[sae]')")
    import re

    from sae_lens import StandardSAE

    stdout = run_in_process("train_sae.py", "--tokens", "16384", "--d-sae", "128", "--features", "3",
                            "--save", str(tmp_path / "sae"), "--out", str(tmp_path / "sae.png"))
    numbers = {k: float(v) for k, v in re.findall(r"([a-z][a-z ]+?) (-?\d+\.\d+)", stdout)}
    assert numbers["explained variance"] > 0.9, stdout
    ce = re.search(r"next-token loss: ([\d.]+) without the SAE, ([\d.]+) with it, ([\d.]+) with the value zeroed",
                   stdout)
    without, with_sae, zeroed = map(float, ce.groups())
    assert without < with_sae < zeroed and (zeroed - with_sae) > 0.8 * (zeroed - without), stdout
    assert len(re.findall(r"^  feature \d+ +fires on", stdout, flags=re.M)) == 3
    sae = StandardSAE.load_from_disk(str(tmp_path / "sae"))
    assert sae.cfg.d_sae == 128 and sae.cfg.metadata.hook_name == "blocks.1.hook_resid_pre"
    assert_png(tmp_path / "sae.png")


def test_figures_are_named_by_family_and_model(monkeypatch, alpha_er_checkpoint):
    """A run on another model writes its own figure, not over the last one's."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    from common import arguments, out_path

    parser = arguments("test", "head_patching")
    assert out_path(parser.parse_args([])) == Path("out/head_patching_arcee-embedded.png")
    assert out_path(parser.parse_args(["--family", "alpha-er"])) == Path("out/head_patching_alpha-er-embedded.png")
    assert out_path(parser.parse_args(["--model", str(alpha_er_checkpoint)])) == Path(
        f"out/head_patching_alpha-er-{Path(alpha_er_checkpoint).stem}.png")
    assert out_path(parser.parse_args(["--out", "x/y.png"])) == Path("x/y.png")


@pytest.mark.parametrize("family", ["arcee", "alpha-er"])
def test_circuit_discovery_on_the_embedded_models(tmp_path, run_in_process, family):
    stdout = run_in_process("circuit_discovery.py", "--family", family, "--prompts", "8",
                            "--out", str(tmp_path / "circuit.png"))
    r = float(stdout.split("against exact edge patching: correlation ")[1].split(",")[0])
    assert r > 0.95  # EAP-IG against every edge patched exactly
    kept = float(stdout.split("edges keep ")[1].split(" ")[0])
    assert kept >= 0.9
    # The first step of the IOI circuit (tutorial 2): the repeated name reaches layer 0's head 2 (Arcee;
    # alpha-er's head 1) through the values of its key/value head.
    first = stdout.split("of the logit difference\n")[1].splitlines()[0].split()
    assert first[:3] == ["input", "->", "layers.0.self_attn.kv_head.1.v"]
    assert_png(tmp_path / "circuit.png")
    assert_png(tmp_path / "circuit_faithfulness.png")


def check_attribution_outputs(stdout: str, out: Path, family: str) -> None:
    import json

    assert "strongest paths to it" in stdout and "replacement score" in stdout
    top = [line for line in stdout.splitlines() if line.startswith("top logit:")][0]
    assert "' Mary'" in top  # the indirect object
    paths = [line for line in stdout.splitlines() if line.startswith("  0.") or line.startswith("  1.")]
    assert paths and all(line.rstrip().endswith("(' Mary')") for line in paths)
    graph = json.loads((out / f"attribution_graph_{family}.json").read_text())
    kinds = {node["feature_type"] for node in graph["nodes"]}
    assert {"embedding", "logit", "cross layer transcoder"} <= kinds and graph["links"]
    assert_png(out / f"attribution_graph_{family}.png")


def test_attribution_graph_with_the_shipped_transcoders(tmp_path, run_in_process):
    stdout = run_in_process("attribution_graph.py", "--out", str(tmp_path))
    check_attribution_outputs(stdout, tmp_path, "arcee")


def test_attribution_graph_trains_transcoders_on_alpha_er(tmp_path, run_in_process):
    stdout = run_in_process("attribution_graph.py", "--family", "alpha_er", "--train", "60", "--out", str(tmp_path))
    check_attribution_outputs(stdout, tmp_path, "alpha_er")


@pytest.mark.parametrize("script", ["attribution_graph.py", "head_patching.py", "circuit_discovery.py"])
@pytest.mark.parametrize("spelling", ["alpha-er", "alpha_er"])
def test_family_takes_either_spelling(run_in_process, capsys, script, spelling):
    # argparse converts --family before it meets --help: a spelling it refused would exit 2 with its message
    with pytest.raises(SystemExit) as stopped:
        run_in_process(script, "--family", spelling, "--help")
    assert stopped.value.code == 0, capsys.readouterr().err
