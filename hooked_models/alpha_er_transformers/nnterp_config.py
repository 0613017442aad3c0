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
from collections.abc import Iterator

import nnterp.rename_utils
import nnterp.utils
import torch
from nnterp import StandardizedTransformer
from nnterp.rename_utils import RenameConfig
from transformers import AutoConfig

ALPHA_ER_RENAME = RenameConfig(
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


@contextlib.contextmanager
def checks_at_length(seq: int) -> Iterator[None]:
    """nnterp checks a model on `input_ids` [[0, 1, 1]]; alpha-er refuses that length (the expert of position t is
    floor(t·G/T), so it computes only at multiples of mlp_experts). Inside this block the same checks run on
    [[0, 1, 1, ..., 1]] of length `seq`; nnterp is restored on the way out."""
    original = nnterp.utils.dummy_inputs

    def dummy_inputs() -> dict[str, torch.Tensor]:
        return {"input_ids": torch.tensor([[0] + [1] * (seq - 1)])}

    nnterp.utils.dummy_inputs = nnterp.rename_utils.dummy_inputs = dummy_inputs
    try:
        yield
    finally:
        nnterp.utils.dummy_inputs = nnterp.rename_utils.dummy_inputs = original


def load_standardized(path, **kwargs) -> StandardizedTransformer:
    """nnterp's StandardizedTransformer on an alpha-er transformers checkpoint, with ALPHA_ER_RENAME and
    nnterp's loading checks run at max_position_embeddings; `kwargs` go to StandardizedTransformer."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=kwargs.get("trust_remote_code", False))
    kwargs.setdefault("device_map", "cpu")
    with checks_at_length(config.max_position_embeddings):
        return StandardizedTransformer(str(path), rename_config=ALPHA_ER_RENAME, **kwargs)
