"""alpha-er under nnterp: the `RenameConfig` that names its modules, and a loader that runs nnterp's own
checks at a length the architecture computes at.

    from hooked_models.alpha_er_transformers.nnterp_config import load_standardized
    model = load_standardized("path/to/alpha-er-hf", enable_attention_probs=True)
    with model.trace(tokens):            # tokens: [batch, T], T a multiple of mlp_experts
        probs = model.attention_probabilities[0].save()

Needs nnterp (1.3, with nnsight 0.6: `bash .ci/nn-env.sh` builds such an environment); the rest of this
package does not import this module. The module paths are Llama's, so nnterp's defaults would find them
too; the config says them outright, with the config keys for heads, width and vocabulary. The attention
probabilities are read where nnterp reads transformers' eager attention: the output of the dropout after
the softmax in `eager_attention_forward`, which here comes after the soft cap.
"""

import contextlib
import importlib
from collections.abc import Iterator

import torch
from transformers import AutoConfig

# nnterp's RenameConfig fields for alpha-er; `ALPHA_ER_RENAME` is the RenameConfig made of them, built when first
# read, so this module imports (and is documented) where nnterp is not installed.
RENAME_FIELDS = dict(
    model_name="model",
    layers_name="model.layers",
    attn_name="self_attn",
    mlp_name="mlp",
    ln_final_name="model.norm",
    lm_head_name="lm_head",
    attn_head_config_key="num_attention_heads",
    hidden_size_config_key="hidden_size",
    vocab_size_config_key="vocab_size",
)


def _nnterp(module: str = "nnterp"):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(f"{error.msg}: alpha-er under nnterp needs nnterp 1.3 with nnsight 0.6 "
                                  "(`bash .ci/nn-env.sh` builds such an environment)") from error


def __getattr__(name: str):
    if name == "ALPHA_ER_RENAME":
        return _nnterp("nnterp.rename_utils").RenameConfig(**RENAME_FIELDS)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@contextlib.contextmanager
def checks_at_length(seq: int) -> Iterator[None]:
    """nnterp checks a model on `input_ids` [[0, 1, 1]]; alpha-er refuses that length (the expert of position t is
    floor(t·G/T), so it computes only at multiples of mlp_experts). Inside this block the same checks run on
    [[0, 1, 1, ..., 1]] of length `seq`; nnterp is restored on the way out."""
    utils, rename_utils = _nnterp("nnterp.utils"), _nnterp("nnterp.rename_utils")
    original = utils.dummy_inputs

    def dummy_inputs() -> dict[str, torch.Tensor]:
        return {"input_ids": torch.tensor([[0] + [1] * (seq - 1)])}

    utils.dummy_inputs = rename_utils.dummy_inputs = dummy_inputs
    try:
        yield
    finally:
        utils.dummy_inputs = rename_utils.dummy_inputs = original


def load_standardized(path, **kwargs):
    """nnterp's StandardizedTransformer on an alpha-er transformers checkpoint, with ALPHA_ER_RENAME and
    nnterp's loading checks run at max_position_embeddings; `kwargs` go to StandardizedTransformer."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=kwargs.get("trust_remote_code", False))
    kwargs.setdefault("device_map", "cpu")
    with checks_at_length(config.max_position_embeddings):
        return _nnterp().StandardizedTransformer(str(path), rename_config=__getattr__("ALPHA_ER_RENAME"), **kwargs)
