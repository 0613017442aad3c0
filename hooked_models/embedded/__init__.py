"""Small models trained on indirect-object identification (IOI), shipped inside the package.

`HookedArcee.from_pretrained("embedded")` loads `arcee/`, an HF directory (config.json,
model.safetensors, tokenizer.json) that transformers' `ArceeForCausalLM` and `AutoTokenizer` load too, in
transformers 4.5x and 5.x alike (tests/weight_conversion/test_transformers4.py). The task, its
tokenizer and its prompt pairs are in `hooked_models.embedded.task`; the training script is
`python -m hooked_models.embedded.train`.
"""

import os
from pathlib import Path

EMBEDDED_DIR = Path(__file__).parent
EMBEDDED_NAME = "embedded"


def embedded_checkpoint(family: str) -> Path:
    """The directory of the shipped checkpoint of `family` ("arcee" or "alpha_er")."""
    path = EMBEDDED_DIR / family
    if not (path / "config.json").exists() and not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"no embedded {family} checkpoint in {path}; "
                                "train it with python -m hooked_models.embedded.train")
    return path


def resolve_embedded(path_or_id: str | os.PathLike, family: str) -> str | os.PathLike:
    """"embedded" -> the shipped checkpoint's directory; anything else is returned as it is."""
    return embedded_checkpoint(family) if str(path_or_id) == EMBEDDED_NAME else path_or_id
