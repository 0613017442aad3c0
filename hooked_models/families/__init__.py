"""Hooked model families: each a short recipe over the shared components; and which family a checkpoint is."""

import json
import os
from pathlib import Path

FAMILIES = ("arcee", "alpha_er")


def detect_family(source: str | os.PathLike) -> str:
    """"arcee" for an HF Arcee directory or a Hub id, "alpha_er" for an alpha-er checkpoint (a file, or a
    directory without an Arcee config.json); "embedded" means the Arcee one."""
    if str(source) == "embedded":
        return "arcee"
    path = Path(source)
    if path.is_file():
        return "alpha_er"
    if path.is_dir():
        config = path / "config.json"
        if config.is_file() and json.loads(config.read_text()).get("model_type") == "arcee":
            return "arcee"
        return "alpha_er"
    return "arcee"  # a Hub id: alpha-er is not on the Hub


def family_name(family: str) -> str:
    """A family as FAMILIES spells it ("alpha-er" is accepted for "alpha_er"); a ValueError otherwise."""
    name = family.replace("-", "_")
    if name not in FAMILIES:
        raise ValueError(f"family={family!r} must be one of {', '.join(FAMILIES)}")
    return name


def load_model(source: str | os.PathLike, family: str | None = None, dtype=None, device=None):
    """A hooked model in eval mode from a checkpoint path, "embedded" or a Hub id in the local cache, its family
    detected (`family` says which embedded model "embedded" means: "arcee", the default, or "alpha_er")."""
    from hooked_models import HookedAlphaEr, HookedArcee

    family = detect_family(source) if family is None else family_name(family)
    cls = HookedArcee if family == "arcee" else HookedAlphaEr
    return cls.from_pretrained(source, dtype=dtype, device=device).eval()
