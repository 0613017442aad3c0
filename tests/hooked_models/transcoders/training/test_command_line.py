"""`python -m hooked_models train-transcoders`: every TrainingConfig field has its flag, the command trains
what the Python API trains bit for bit (from a token file) and writes what load_transcoders reads; under
torchrun two processes train what one trains, and process 0 alone prints; a bad argument is one line
naming it."""

import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import torch

from hooked_models.__main__ import build_parser, main, training_config
from hooked_models.transcoders import TrainingConfig, TranscoderSet, evaluate, load_transcoders

ROOT = Path(__file__).parents[4]
PROG = "python -m hooked_models train-transcoders"


def parse(*flags):
    return build_parser().parse_args(["train-transcoders", "embedded", "--dataset", "t.npy", "--out", "o", *flags])


# A value for each field, none its default, and the flags that give it.
EVERY_FIELD = dict(
    d_transcoder=48, activation="batchtopk", k=6, skip=True, cross_layer=False, layers=(0, 1), steps=7,
    batch_tokens=96, lr=1e-3, warmup_steps=3, decay_fraction=0.5, init="zero_decoder", init_scale=0.2,
    init_spread="equal", auxk_alpha=0.25, dead_tokens=500, sparsity=2e-3, penalty="l0", tanh_scale=3.0,
    pre_act_loss=1e-4,
    threshold=0.02, bandwidth=0.1, threshold_momentum=0.05, buffer_tokens=960, forward_batch=4, layout="features",
    streams=4, seed=9, checkpoint_every=5, log_every=3)
EVERY_FLAG = ["--width", "48", "--activation", "batchtopk", "--k", "6", "--skip", "--layers", "1", "0", "--steps", "7",
              "--batch-tokens", "96", "--lr", "1e-3", "--warmup-steps", "3", "--decay-fraction", "0.5", "--init",
              "zero_decoder", "--init-scale", "0.2", "--init-spread", "equal", "--auxk-alpha", "0.25", "--dead-tokens",
              "500", "--sparsity", "2e-3", "--penalty", "l0", "--tanh-scale", "3", "--pre-act-loss", "1e-4", "--threshold", "0.02",
              "--bandwidth", "0.1", "--threshold-momentum", "0.05", "--buffer-tokens", "960", "--forward-batch",
              "4", "--layout", "features", "--streams", "4", "--seed", "9", "--checkpoint-every", "5",
              "--log-every", "3"]


def test_every_field_has_a_flag_and_the_flags_defaults_are_the_configs():
    assert {f.name for f in fields(TrainingConfig)} == set(EVERY_FIELD)
    assert all(EVERY_FIELD[f.name] != f.default for f in fields(TrainingConfig) if f.name != "cross_layer")
    assert training_config(parse()) == TrainingConfig()
    assert training_config(parse(*EVERY_FLAG)) == TrainingConfig(**EVERY_FIELD)
    assert training_config(parse("--cross-layer")).cross_layer
    assert training_config(parse("--tokens", "10000", "--batch-tokens", "512")).steps == 19


def test_the_command_trains_what_the_api_trains_and_writes_what_load_transcoders_reads(small_run, arcee, capsys):
    """From a .safetensors file of token windows (input_ids beside an attention mask); --eval-dataset's lines
    are transcoders.evaluate's numbers on the held-out windows."""
    where, trained, flags = small_run
    out = where / "cli"
    assert main(["train-transcoders", "embedded", "--dataset", str(where / "tokens.safetensors"), "--out", str(out),
                 "--eval-dataset", str(where / "held-out.npy"), *flags]) == 0
    loaded = load_transcoders(out)
    assert isinstance(loaded, TranscoderSet) and loaded.k == 8
    for (name, a), b in zip(trained.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == ("trained topk per-layer transcoders of width 32 on 1,536 tokens (12 steps of 128), "
                          "1 process (data); last batch:")
    assert [line.split(":")[0] for line in printed[1:3]] == ["  layer 0", "  layer 1"]
    measured = evaluate(arcee, trained, np.load(where / "held-out.npy"), progress=False)
    assert printed[3] == (f"held out (512 tokens): loss recovered {measured['loss_recovered']:.4g}, "
                          f"loss gap {measured['loss_gap']:.4g}, KL {measured['kl_divergence']:.4g}")
    assert printed[4:6] == [f"  layer {l}: FVU {measured['fvu'][l]:.4g}  L0 {measured['l0'][l]:.1f}  "
                            f"dead {measured['dead_percent'][l]:.1f}%" for l in range(2)]
    assert printed[6] == f"wrote {out}" and (out / "training.json").is_file() and (out / "training.png").is_file()


def test_from_a_harvest_some_layers(small_run, arcee, capsys):
    """MODEL a harvest of the MLPs and no --dataset; --layers 1 writes layer_1.safetensors, which read_result
    reads back as {1: Transcoder}, bit for bit the API's."""
    from hooked_models import corpus
    from hooked_models.transcoders.training import train_transcoders
    from hooked_models.transcoders.training.report import read_result

    where = small_run[0]
    names = [name for l in range(2) for name in (f"layers.{l}.mlp_input", f"layers.{l}.mlp.mlp_output")]
    corpus.harvest(arcee, str(where / "tokens.npy"), names, where / "harvest", progress=False)
    flags = ["--width", "16", "--steps", "4", "--batch-tokens", "64", "--layers", "1", "--activation", "jumprelu"]
    assert main(["train-transcoders", str(where / "harvest"), "--out", str(where / "from-harvest"), *flags,
                 "--no-progress"]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("  layer 1: FVU ")
    expected = train_transcoders(where / "harvest", config=TrainingConfig(
        d_transcoder=16, steps=4, batch_tokens=64, layers=(1,), activation="jumprelu"), progress=False)
    read = read_result(where / "from-harvest")
    assert read.keys() == expected.keys() == {1} and read[1].threshold is not None
    for (name, a), b in zip(expected[1].state_dict().items(), read[1].state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def torchrun(*arguments: str) -> subprocess.CompletedProcess:
    # --standalone: a rendezvous on a free port (torch 2.13's workers get MASTER_PORT=0 from --master-port 0).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "hooked_models", "train-transcoders", *arguments], env=env, capture_output=True,
                          text=True, timeout=300)


def test_under_torchrun_two_processes_train_what_one_trains_and_process_0_alone_prints(small_run):
    """Feature sharded over 2 gloo processes: within 2e-6 of each tensor's largest entry (measured: 2e-7)."""
    where, trained, flags = small_run
    out = where / "torchrun"
    done = torchrun("embedded", "--dataset", str(where / "tokens.npy"), "--out", str(out), "--layout", "features",
                    *flags)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("wrote ") == 1 and "2 processes (features)" in done.stdout, done.stdout
    for (name, a), b in zip(trained.state_dict().items(), load_transcoders(out).state_dict().values(), strict=True):
        assert float((a - b).abs().max()) <= 2e-6 * float(a.abs().max()), name


def test_under_torchrun_only_process_0_reports_an_error(small_run, monkeypatch, capsys):
    """Every process raises a bad argument's error; the others exit with its code, silently."""
    flags = ["embedded", "--dataset", str(small_run[0] / "tokens.npy"), "--tokens", "100", "--no-progress"]
    monkeypatch.setenv("RANK", "1")
    assert main(["train-transcoders", *flags, "--out", str(small_run[0] / "no")]) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert main(["train-transcoders", *flags, "--out", str(small_run[0] / "no")]) == 2
    assert capsys.readouterr().err.startswith(f"{PROG}: error: --tokens 100")


@pytest.fixture(scope="module")
def not_a_hooked_checkpoint(tmp_path_factory):
    """A GPT-2 checkpoint: a model, but of neither family."""
    from transformers import GPT2Config, GPT2LMHeadModel

    where = tmp_path_factory.mktemp("gpt2")
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, bos_token_id=0,
                               eos_token_id=0)).save_pretrained(where)
    return where


# Each: the flags after `train-transcoders` given the token files' directory d and the GPT-2 checkpoint g, and
# what the one line must say (with {d} and {g}).
ERRORS = {
    "k above the width": (lambda d, g: ["embedded", "--dataset", f"{d}/tokens.npy", "--activation", "topk", "--k",
                                        "64", "--width", "32"], ["--k 64: topk needs", "[1, --width 32]"]),
    "topk without k": (lambda d, g: ["embedded", "--dataset", f"{d}/tokens.npy", "--activation", "batchtopk"],
                       ["--activation batchtopk needs --k"]),
    "k without topk": (lambda d, g: ["embedded", "--dataset", f"{d}/tokens.npy", "--k", "4"],
                       ["--k 4 is for --activation topk", "(drop --k)"]),
    "width the workers do not divide": (lambda d, g: ["embedded", "--dataset", f"{d}/tokens.npy", "--layout",
                                                      "features", "--width", "33", "--engine", "ray", "--workers", "2"],
                                        ["--width 33 is not divisible by the 2 processes"]),
    "dataset too small": (lambda d, g: ["embedded", "--dataset", f"{d}/tokens.npy", "--batch-tokens", "4096",
                                        "--buffer-tokens", "0"],
                          ["--dataset {d}/tokens.npy is too small for one batch", "--batch-tokens 4096"]),
    "not a checkpoint of either family": (lambda d, g: [str(g), "--dataset", f"{d}/tokens.npy"],
                                         ["{g}", "model_type is 'gpt2'"]),
    "tokens under one batch": (lambda d, g: ["embedded", "--dataset", f"{d}/tokens.npy", "--tokens", "100"],
                               ["--tokens 100 is less than one batch (--batch-tokens 1024)"]),
    "layers out of range": (lambda d, g: ["embedded", "--dataset", f"{d}/tokens.npy", "--layers", "0", "5"],
                            ["--layers 0 5: the model has layers 0 ... 1"]),
    "no dataset": (lambda d, g: ["embedded"], ["--dataset is needed: MODEL embedded is not a harvest directory"]),
    "workers without ray": (lambda d, g: ["embedded", "--dataset", f"{d}/tokens.npy", "--workers", "2"],
                            ["--workers 2 needs --engine ray"]),
    "missing token file": (lambda d, g: ["embedded", "--dataset", f"{d}/missing.npy"], ["{d}/missing.npy"]),
    "bad held-out windows": (lambda d, g: ["embedded", "--dataset", f"{d}/tokens.npy", "--eval-dataset",
                                           f"{d}/tokens.pt/nothing"],
                             ["--eval-dataset {d}/tokens.pt/nothing: dataset path", "is not a directory saved"]),
}


@pytest.mark.parametrize("case", ERRORS)
def test_a_bad_argument_is_one_line_naming_it(small_run, not_a_hooked_checkpoint, tmp_path, capsys, case):
    arguments, said = ERRORS[case]
    d, g = small_run[0], not_a_hooked_checkpoint
    flags = arguments(d, g)
    assert main(["train-transcoders", *flags, "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"{PROG}: error: ") and lines[0].endswith("(--debug shows the traceback)")
    for words in said:
        assert words.format(d=d, g=g) in lines[0], lines[0]
    for api_word in ("d_transcoder", "batch_tokens", "layers=", "k=", "num_workers", "Traceback"):
        assert api_word not in lines[0]
    assert not (tmp_path / "out").exists()


def test_help_names_every_flag_and_imports_no_torch(small_run):
    code = ("import sys\nfrom hooked_models.__main__ import main\ntry:\n    main(['train-transcoders', '--help'])\n"
            "except SystemExit:\n    pass\nprint(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'ray'}))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("[]")
    for flag in EVERY_FLAG + small_run[2] + ["--tokens", "--cross-layer", "--engine", "--cpus-per-worker"]:
        assert not flag.startswith("--") or flag in done.stdout, flag
