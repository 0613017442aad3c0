"""Dtypes by name: the one conversion from what a user writes ("bfloat16", "bf16", "fp16", torch.float16)
to a torch dtype, used wherever the package takes a dtype (loaders, configs, `model.to`, the examples)."""

import torch

# Accepted names (case-insensitive, "torch." optional), as transformers and TransformerLens spell them.
DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "f32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "f16": torch.float16, "half": torch.float16,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
}


def is_dtype_name(name: str) -> bool:
    return name.strip().lower().removeprefix("torch.") in DTYPE_NAMES


def resolve_dtype(dtype: "torch.dtype | str | None") -> "torch.dtype | None":
    """A floating-point torch dtype from a torch dtype or one of DTYPE_NAMES; None stays None (the default).
    Anything else is a ValueError that lists the accepted names."""
    if dtype is None:
        return None
    if isinstance(dtype, str) and is_dtype_name(dtype):
        return DTYPE_NAMES[dtype.strip().lower().removeprefix("torch.")]
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    raise ValueError(f"dtype {dtype!r} is not a floating-point dtype; give a torch dtype (torch.bfloat16) or one "
                     f"of the names {', '.join(repr(n) for n in DTYPE_NAMES)}")


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype's name as config.json writes it ("bfloat16")."""
    return str(resolve_dtype(dtype)).removeprefix("torch.")


def dtype_argument(text: str) -> str:
    """An argparse `type=` for --dtype: the name back if `resolve_dtype` takes it, else argparse's error."""
    import argparse

    try:
        resolve_dtype(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text
