"""Devices: checking one a user names, and spreading a model's layers over several, as TransformerLens's
`n_devices` does.

`resolve_device` turns "cuda", "cuda:1", "mps" or a torch.device into a torch.device that exists here, or
raises a ValueError naming it and the devices there are (torch's own errors for a missing backend are an
AssertionError with no device list, or a failure deep inside the first copy).

Layers go in contiguous groups: layer i of L on device i·n // L (TransformerLens's
`utilities.multi_gpu.get_device_for_block_index`), the embeddings with the first layer, the final
norm and the head with the last. The residual stream follows the layers: each placed module moves
the tensors it is given to its own device before it runs (a forward pre-hook, as accelerate's
dispatch does), so the families' forwards need no device logic and a single-device model pays nothing.
"""

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

Device = torch.device | str


def available_devices() -> list[str]:
    """The devices torch can use here: cpu, then each visible CUDA device, then mps where there is one."""
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        devices.append("mps")
    return devices


def resolve_device(device: Device) -> torch.device:
    """`device` as a torch.device that exists on this machine; else a ValueError naming it and what there is."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device {device!r} is not a device name ({error}); available: "
                         f"{', '.join(available_devices())}") from None
    available = ", ".join(available_devices())
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r} needs CUDA, but this torch ({torch.__version__}) sees no CUDA "
                             f"device; available: {available}")
        count = torch.cuda.device_count()
        if resolved.index is not None and resolved.index >= count:
            raise ValueError(f"device {str(device)!r} does not exist: {count} CUDA device(s) are visible "
                             f"(cuda:0 to cuda:{count - 1}); available: {available}")
    elif resolved.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise ValueError(f"device {str(device)!r} needs Apple's MPS, which this machine does not have; "
                             f"available: {available}")
    elif resolved.type not in ("cpu", "meta"):
        backend = getattr(torch, resolved.type, None)
        if backend is None or not getattr(backend, "is_available", lambda: False)():
            raise ValueError(f"device {str(device)!r} is not available here; available: {available}")
    return resolved


def layer_device(index: int, num_layers: int, devices: Sequence[Device]) -> torch.device:
    """The device of layer `index`: contiguous groups, TransformerLens's rule."""
    return torch.device(devices[index * len(devices) // num_layers])


def cuda_devices(n_devices: int, device: Device | None = None) -> list[torch.device]:
    """cuda:k ... cuda:k+n-1 from `device` (cuda:0 by default), checked against what is visible."""
    if not isinstance(n_devices, int) or n_devices < 1:
        raise ValueError(f"n_devices must be a positive integer, got {n_devices!r}")
    first = torch.device(device if device is not None else "cuda")
    if first.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"n_devices={n_devices} spreads layers over CUDA devices, but this torch sees none; "
                         f"available: {', '.join(available_devices())}")
    if n_devices > 1 and first.type != "cuda":
        raise ValueError(f"n_devices={n_devices} spreads layers over CUDA devices, but device is {first}")
    if first.type != "cuda":
        return [first]
    start = first.index or 0
    visible = torch.cuda.device_count()
    if start + n_devices > visible:
        raise ValueError(f"n_devices={n_devices} from cuda:{start} needs cuda:{start}..cuda:{start + n_devices - 1}, "
                         f"but {visible} CUDA device(s) are visible")
    return [torch.device("cuda", start + i) for i in range(n_devices)]


def parameter_placement(num_layers: int, devices: Sequence[Device]) -> Callable[[str], torch.device]:
    """name -> device for every parameter of a model whose layers are `layers.{i}`: layers by index,
    everything else (embeddings, final norm, head) with the first or last layer as it is read."""
    first, last = layer_device(0, num_layers, devices), layer_device(num_layers - 1, num_layers, devices)

    def device_of(name: str) -> torch.device:
        if name.startswith("layers."):
            return layer_device(int(name.split(".")[1]), num_layers, devices)
        return first if name.startswith("embed") else last

    return device_of


def spread_layers(model: nn.Module, devices: Sequence[Device]) -> nn.Module:
    """Place `model`'s parameters by `parameter_placement` and let the residual stream follow.

    Moves what is not yet on its device (a loader that streamed each tensor to its device moves
    nothing), then adds the pre-hooks that carry activations across. Tied weights stay one tensor,
    on the device of the first module that owns them (the embedding); the head then reads the
    residual there. Returns the model, with `cfg.device` the first device.
    """
    if not devices:
        raise ValueError("devices is empty; give at least one device")
    num_layers = len(model.layers)
    device_of = parameter_placement(num_layers, devices)
    for name, module in model.named_modules():
        for leaf, param in list(module._parameters.items()):
            if param is None:
                continue
            full = f"{name}.{leaf}" if name else leaf
            target = device_of(full)
            if param.device != target:
                module._parameters[leaf] = nn.Parameter(param.data.to(target), requires_grad=param.requires_grad)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    for handle in getattr(model, "_device_hooks", []):
        handle.remove()
    handles = [model.register_forward_pre_hook(_MoveInputs(layer_device(0, num_layers, devices)), with_kwargs=True)]
    placed = [*model.layers, *(m for n, m in model.named_children() if n not in ("layers",) and _has_params(m))]
    for module in placed:
        device = next(module.parameters()).device
        handles.append(module.register_forward_pre_hook(_MoveInputs(device), with_kwargs=True))
    model._device_hooks = handles
    if hasattr(model, "cfg"):
        model.cfg.device = torch.device(devices[0])
    return model


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


class _MoveInputs:
    """A forward pre-hook moving every tensor argument (and tensor fields of dataclass arguments,
    such as AttentionInputs' mask, cos and sin) to one device."""

    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self, module, args, kwargs):
        return tuple(to_device(a, self.device) for a in args), {k: to_device(v, self.device) for k, v in kwargs.items()}


def to_device(value, device: torch.device):
    """`value` with its tensors on `device`: a tensor, a dataclass's tensor fields, or as it is."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: to_device(getattr(value, f.name), device) for f in dataclasses.fields(value)
                   if isinstance(getattr(value, f.name), torch.Tensor)}
        moved = {k: v for k, v in changes.items() if v is not getattr(value, k)}
        return dataclasses.replace(value, **moved) if moved else value
    return value
