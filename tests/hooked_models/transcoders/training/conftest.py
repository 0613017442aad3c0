import pytest

from hooked_models import HookedAlphaEr, HookedArcee


@pytest.fixture(scope="session")
def arcee():
    return HookedArcee.from_pretrained("embedded")


@pytest.fixture(scope="session")
def alpha_er():
    return HookedAlphaEr.from_pretrained("embedded")


# The small run the command line and the launchers are compared on. streams=2 fixes how the data is split,
# so that one process and two train on the same global batches.
SMALL_RUN = dict(d_transcoder=32, steps=12, batch_tokens=128, buffer_tokens=512, forward_batch=8, streams=2,
                 lr=3e-3, seed=3, activation="topk", k=8, auxk_alpha=1 / 16, dead_tokens=256, log_every=2)
SMALL_RUN_FLAGS = ["--width", "32", "--steps", "12", "--batch-tokens", "128", "--buffer-tokens", "512",
                   "--forward-batch", "8", "--streams", "2", "--lr", "3e-3", "--seed", "3", "--activation", "topk",
                   "--k", "8", "--auxk-alpha", "0.0625", "--dead-tokens", "256", "--log-every", "2", "--no-progress"]


@pytest.fixture(scope="session")
def small_run(tmp_path_factory, arcee):
    """(a directory of token windows [96 16] of the embedded Arcee's task saved as tokens.npy, .pt and
    .safetensors, and 32 others as held-out.npy; what one process trains on them with SMALL_RUN; the flags
    that say SMALL_RUN)."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from hooked_models.embedded.task import make_ioi_prompts
    from hooked_models.transcoders import TrainingConfig, train_transcoders

    where = tmp_path_factory.mktemp("small-run")
    tokens = make_ioi_prompts(96, 5).clean_tokens
    np.save(where / "tokens.npy", tokens.numpy())
    np.save(where / "held-out.npy", make_ioi_prompts(32, 77).clean_tokens.numpy())
    torch.save(tokens, where / "tokens.pt")
    save_file({"input_ids": tokens.int().contiguous(), "attention_mask": torch.ones_like(tokens)},
              str(where / "tokens.safetensors"))
    trained = train_transcoders(arcee, dataset=tokens, config=TrainingConfig(**SMALL_RUN), progress=False)
    return where, trained, SMALL_RUN_FLAGS
