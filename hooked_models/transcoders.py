"""Transcoders: sparse replacements of the MLPs, read from the MLP's input and written to its output.

    tc = Transcoder(d_in=64, d_transcoder=512, layer=1, activation="topk", k=16)
    acts = tc.encode(x)                        # x: layers.1.mlp_input [... d_in] -> [... d_transcoder]
    out = tc(x)                                # decode(encode(x)) (+ x @ W_skip.T): layers.1.mlp.mlp_output
    tcs = TranscoderSet([...], model=model)    # one per layer, for one model (family, hidden size, layers)
    tcs.save("out/tc"); TranscoderSet.load("out/tc", model=model)    # circuit-tracer's layout
    clt = CrossLayerTranscoder(n_layers=2, d_in=64, d_transcoder=512, model=model)   # encoders per layer,
    clt.decode_to(1, {0: acts0, 1: acts1})     # decoders from each layer to it and every later one

Names, layouts and files follow circuit-tracer (`SingleLayerTranscoder`, `TranscoderSet`,
`CrossLayerTranscoder`): a transcoder of layer l reads `layers.{l}.mlp_input` (the normed stream the MLP
is called with) and writes `layers.{l}.mlp.mlp_output`. In memory W_enc is [d_in d_transcoder] and
W_dec [d_transcoder d_out] (x @ W_enc, acts @ W_dec), W_skip [d_out d_in] (applied as x @ W_skip.T,
circuit-tracer's convention). On disk (`save`): a `config.yaml` (model_kind, feature_input_hook,
feature_output_hook, activation, the file list, and the model identity) and per-layer safetensors with
W_enc in circuit-tracer's [d_transcoder d_in].

Activations: "relu"; "topk" (the k largest pre-activations, then ReLU, as Gao et al. 2024 and SAELens;
circuit-tracer's TopK keeps negative ones, which differs only where fewer than k are positive);
"jumprelu" (pre · [pre > threshold], Rajamanoharan et al. 2024, with its straight-through threshold
gradient: SAELens's and circuit-tracer's `JumpReLU`).

Training: `train_transcoders(harvest_dir)` from a `corpus.harvest` of every layer's `mlp_input` and
`mlp.mlp_output` on disk (batches of rows drawn from the memory-mapped dataset, so memory does not
grow with the corpus), or `train_transcoders(model, dataset=...)`, which harvests first. A progress
bar; a checkpoint file that a rerun resumes from (the result is the uninterrupted run's, bit for bit).
SAELens (6.x) has transcoder classes but trains none, so the trainer is this small one.
`transcoder_fidelity(model, transcoders, tokens)` measures what they explain.
"""

import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import yaml
from jaxtyping import Float
from safetensors.torch import load_file, save_file
from torch import Tensor
from tqdm import tqdm

ACTIVATIONS = ("relu", "topk", "jumprelu")
# The hooks a transcoder of layer l reads and writes, relative to `layers.{l}` (circuit-tracer's config
# names its hooks relative to the block too: "hook_resid_mid", "mlp.hook_out").
FEATURE_INPUT_HOOK = "mlp_input"
FEATURE_OUTPUT_HOOK = "mlp.mlp_output"
# JumpReLU's straight-through kernel width (SAELens's default bandwidth).
JUMPRELU_BANDWIDTH = 0.001
# SAELens's transcoder classes by (activation, skip connection); it has no TopK transcoder.
SAE_LENS_CLASSES = {("relu", False): "Transcoder", ("relu", True): "SkipTranscoder",
                    ("jumprelu", False): "JumpReLUTranscoder", ("jumprelu", True): "JumpReLUSkipTranscoder"}


def input_hook_name(layer: int) -> str:
    """The value a transcoder of `layer` reads: the normed stream the MLP is called with."""
    return f"layers.{layer}.{FEATURE_INPUT_HOOK}"


def output_hook_name(layer: int) -> str:
    """The value a transcoder of `layer` writes: what the MLP adds to the residual stream."""
    return f"layers.{layer}.{FEATURE_OUTPUT_HOOK}"


# ------------------------------------------------------------------------------------- activations
def _rectangle(x: Tensor) -> Tensor:
    return ((x > -0.5) & (x < 0.5)).to(x.dtype)


class _JumpReLU(torch.autograd.Function):
    """pre · [pre > threshold]; the threshold's gradient is the straight-through estimate
    -(θ/ε)·rect((pre-θ)/ε) (Rajamanoharan et al. 2024, eq. 11; SAELens's `JumpReLU`), the input's the
    true one (no estimate through the jump)."""

    @staticmethod
    def forward(ctx, pre: Tensor, threshold: Tensor, bandwidth: float) -> Tensor:
        ctx.save_for_backward(pre, threshold)
        ctx.bandwidth = bandwidth
        return pre * (pre > threshold).to(pre.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        pre, threshold = ctx.saved_tensors
        bandwidth = ctx.bandwidth
        pre_grad = (pre > threshold).to(grad.dtype) * grad
        threshold_grad = -(threshold / bandwidth) * _rectangle((pre - threshold) / bandwidth) * grad
        return pre_grad, _sum_to(threshold_grad, threshold.shape), None


class _Step(torch.autograd.Function):
    """[pre > threshold], the L0 of a JumpReLU; the threshold's straight-through gradient is
    -(1/ε)·rect((pre-θ)/ε) (Rajamanoharan et al. 2024, eq. 12), the input gets none."""

    @staticmethod
    def forward(ctx, pre: Tensor, threshold: Tensor, bandwidth: float) -> Tensor:
        ctx.save_for_backward(pre, threshold)
        ctx.bandwidth = bandwidth
        return (pre > threshold).to(pre.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        pre, threshold = ctx.saved_tensors
        bandwidth = ctx.bandwidth
        threshold_grad = -(1.0 / bandwidth) * _rectangle((pre - threshold) / bandwidth) * grad
        return torch.zeros_like(pre), _sum_to(threshold_grad, threshold.shape), None


def _sum_to(grad: Tensor, shape: torch.Size) -> Tensor:
    """Sum a broadcast gradient back to the parameter's shape."""
    lead = grad.ndim - len(shape)
    grad = grad.sum(dim=tuple(range(lead))) if lead else grad
    keep = [i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1]
    return grad.sum(dim=keep, keepdim=True) if keep else grad


def jumprelu(pre: Tensor, threshold: Tensor, bandwidth: float = JUMPRELU_BANDWIDTH) -> Tensor:
    """JumpReLU with its straight-through threshold gradient."""
    return _JumpReLU.apply(pre, threshold, bandwidth)


def step(pre: Tensor, threshold: Tensor, bandwidth: float = JUMPRELU_BANDWIDTH) -> Tensor:
    """[pre > threshold] with the straight-through threshold gradient (a JumpReLU's L0 penalty)."""
    return _Step.apply(pre, threshold, bandwidth)


def topk_relu(pre: Tensor, k: int) -> Tensor:
    """The k largest entries of the last axis, through ReLU; the rest zero."""
    values, indices = pre.topk(k, dim=-1)
    return torch.zeros_like(pre).scatter(-1, indices, torch.relu(values))


def _check_activation(activation: str, k: int | None, d_transcoder: int) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} must be one of {', '.join(ACTIVATIONS)}")
    if activation == "topk":
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= d_transcoder:
            raise ValueError(f"k={k!r}: a TopK transcoder needs an integer k in [1, d_transcoder={d_transcoder}]")
    elif k is not None:
        raise ValueError(f"k={k!r} is for activation='topk', not {activation!r}")


def _check_size(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


# ---------------------------------------------------------------------------------- model identity
@dataclass(frozen=True)
class ModelIdentity:
    """The model a transcoder set was trained for: family, hidden size, layer count. A set is refused by
    any model that differs in one of them."""

    family: str
    hidden_size: int
    num_layers: int

    @classmethod
    def of(cls, model) -> "ModelIdentity":
        from hooked_models.families.alpha_er import HookedAlphaEr
        from hooked_models.families.arcee import HookedArcee

        family = {HookedArcee: "arcee", HookedAlphaEr: "alpha_er"}.get(type(model))
        if family is None:
            raise ValueError(f"{type(model).__name__} is not a hooked model (HookedArcee or HookedAlphaEr)")
        return cls(family, model.cfg.hidden_size, model.cfg.num_layers)

    def check(self, model, what: str = "these transcoders") -> None:
        """Raise a ValueError naming the first field where `model` differs from this identity."""
        other = ModelIdentity.of(model)
        for field, mine in asdict(self).items():
            theirs = getattr(other, field)
            if mine != theirs:
                raise ValueError(f"{what} were trained for the {self.family} model with hidden_size="
                                 f"{self.hidden_size}, num_layers={self.num_layers}; this model has "
                                 f"{field}={theirs!r} (expected {mine!r})")


# ------------------------------------------------------------------------------- one-layer transcoder
class Transcoder(nn.Module):
    """A per-layer transcoder (circuit-tracer's `SingleLayerTranscoder`): features read from the MLP's
    input, the MLP's output written from the features.

        forward(x) = act(x @ W_enc + b_enc) @ W_dec + b_dec  (+ x @ W_skip.T with a skip connection)

    `hook_name`/`hook_name_out` name what it reads and writes, as SAELens's transcoders do, so
    `model.add_sae(transcoder)` splices it (hooked_models/saes.py).
    """

    def __init__(self, d_in: int, d_transcoder: int, d_out: int | None = None, layer: int = 0,
                 activation: str = "relu", k: int | None = None, skip: bool = False,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        d_out = d_in if d_out is None else d_out
        for name, size in (("d_in", d_in), ("d_transcoder", d_transcoder), ("d_out", d_out)):
            _check_size(name, size)
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ValueError(f"layer={layer!r} must be a non-negative integer")
        _check_activation(activation, k, d_transcoder)
        self.d_in, self.d_transcoder, self.d_out, self.layer = d_in, d_transcoder, d_out, layer
        self.activation, self.k = activation, k
        kw = dict(dtype=dtype, device=device)
        self.W_enc = nn.Parameter(torch.zeros(d_in, d_transcoder, **kw))
        self.b_enc = nn.Parameter(torch.zeros(d_transcoder, **kw))
        self.W_dec = nn.Parameter(torch.zeros(d_transcoder, d_out, **kw))
        self.b_dec = nn.Parameter(torch.zeros(d_out, **kw))
        self.W_skip = nn.Parameter(torch.zeros(d_out, d_in, **kw)) if skip else None
        self.threshold = nn.Parameter(torch.zeros(d_transcoder, **kw)) if activation == "jumprelu" else None
        self.bandwidth = JUMPRELU_BANDWIDTH  # the straight-through kernel's width: training only

    @property
    def input_hook(self) -> str:
        return input_hook_name(self.layer)

    @property
    def output_hook(self) -> str:
        return output_hook_name(self.layer)

    hook_name = input_hook
    hook_name_out = output_hook

    @property
    def has_skip(self) -> bool:
        return self.W_skip is not None

    def activate(self, pre: Float[Tensor, "... d_transcoder"]) -> Float[Tensor, "... d_transcoder"]:
        """The activation function on pre-activations."""
        if self.activation == "relu":
            return torch.relu(pre)
        if self.activation == "topk":
            return topk_relu(pre, self.k)
        return jumprelu(pre, self.threshold, self.bandwidth)

    def encode(self, x: Float[Tensor, "... d_in"], apply_activation: bool = True) -> Float[Tensor, "... d_transcoder"]:
        """The features of `x` (their pre-activations with apply_activation=False)."""
        pre = x.to(self.W_enc.dtype) @ self.W_enc + self.b_enc
        return self.activate(pre) if apply_activation else pre

    def decode(self, acts: Float[Tensor, "... d_transcoder"]) -> Float[Tensor, "... d_out"]:
        """What the features write (without the skip connection, which reads the input)."""
        return acts @ self.W_dec + self.b_dec

    def skip(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        """The skip connection's contribution, x @ W_skip.T (zero without one)."""
        if self.W_skip is None:
            return torch.zeros(*x.shape[:-1], self.d_out, dtype=self.W_dec.dtype, device=x.device)
        return x.to(self.W_skip.dtype) @ self.W_skip.T

    def forward(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        out = self.decode(self.encode(x))
        return out if self.W_skip is None else out + self.skip(x)

    def extra_repr(self) -> str:
        act = f"topk(k={self.k})" if self.activation == "topk" else self.activation
        return (f"layer={self.layer}, {self.d_in} -> {self.d_transcoder} -> {self.d_out}, {act}"
                f"{', skip' if self.has_skip else ''}")

    # ------------------------------------------------------------------------------- SAELens
    def to_sae_lens(self):
        """This transcoder as SAELens's `Transcoder`, `SkipTranscoder`, `JumpReLUTranscoder` or
        `JumpReLUSkipTranscoder` (SAELens must be installed), its metadata naming the hooks; the same
        function (SAELens's JumpReLU is relu(pre)·[pre > θ], ours with θ >= 0, which training keeps)."""
        import sae_lens.saes.transcoder as sae_lens_transcoders
        from sae_lens.saes.sae import SAEMetadata

        name = SAE_LENS_CLASSES.get((self.activation, self.has_skip))
        if name is None:
            raise ValueError(f"SAELens has no {self.activation} transcoder (it has relu and jumprelu ones, with "
                             "or without a skip connection): this one cannot be exported")
        if self.threshold is not None and bool((self.threshold < 0).any()):
            raise ValueError("a negative JumpReLU threshold has no SAELens equivalent (it applies ReLU first)")
        config = getattr(sae_lens_transcoders, name + "Config")(
            d_in=self.d_in, d_sae=self.d_transcoder, d_out=self.d_out, apply_b_dec_to_input=False,
            dtype=str(self.W_enc.dtype).removeprefix("torch."), device=str(self.W_enc.device),
            metadata=SAEMetadata(hook_name=self.input_hook, hook_name_out=self.output_hook))
        sae = getattr(sae_lens_transcoders, name)(config)
        sae.load_state_dict({n: p.detach().clone() for n, p in self.named_parameters()}, strict=True)
        return sae.eval()

    @classmethod
    def from_sae_lens(cls, sae, layer: int | None = None) -> "Transcoder":
        """A SAELens transcoder as this class; `layer` defaults to the one its hook name says."""
        kinds = {name: key for key, name in SAE_LENS_CLASSES.items()}
        if type(sae).__name__ not in kinds:
            raise ValueError(f"{type(sae).__name__} is not one of SAELens's transcoders ({', '.join(kinds)})")
        if getattr(sae.cfg, "normalize_activations", "none") != "none":
            raise ValueError(f"normalize_activations={sae.cfg.normalize_activations!r}: fold it into the weights first")
        if layer is None:
            hook = str(getattr(sae.cfg.metadata, "hook_name", ""))
            match = re.match(r"(?:layers|blocks)\.(\d+)\.", hook)
            if match is None:
                raise ValueError(f"no layer in the hook name {hook!r}: pass layer=")
            layer = int(match.group(1))
        activation, skip = kinds[type(sae).__name__]
        tc = cls(sae.cfg.d_in, sae.cfg.d_sae, sae.cfg.d_out, layer, activation, skip=skip, dtype=sae.W_enc.dtype)
        tc.load_state_dict({n: p.detach().cpu() for n, p in sae.named_parameters()}, strict=True)
        return tc

    # ------------------------------------------------------------- circuit-tracer's file layout
    def state_for_file(self) -> dict[str, Tensor]:
        """circuit-tracer's per-layer safetensors: W_enc [d_transcoder d_in], W_dec [d_transcoder d_out],
        b_enc, b_dec, `activation_function.threshold` (JumpReLU), `k` (TopK), W_skip [d_out d_in]."""
        state = {"W_enc": self.W_enc.T, "W_dec": self.W_dec, "b_enc": self.b_enc, "b_dec": self.b_dec}
        if self.threshold is not None:
            state["activation_function.threshold"] = self.threshold
        if self.k is not None:
            state["k"] = torch.tensor(self.k)
        if self.W_skip is not None:
            state["W_skip"] = self.W_skip
        return {name: t.detach().cpu().contiguous() for name, t in state.items()}

    @classmethod
    def from_file_state(cls, state: Mapping[str, Tensor], layer: int, activation: str | None = None,
                        where: str = "transcoder") -> "Transcoder":
        """A transcoder from circuit-tracer's per-layer tensors (see `state_for_file`)."""
        missing = [n for n in ("W_enc", "W_dec", "b_enc", "b_dec") if n not in state]
        if missing:
            raise ValueError(f"{where} has no {', '.join(missing)}: not a transcoder in circuit-tracer's layout")
        d_transcoder, d_in = state["W_enc"].shape
        d_out = state["W_dec"].shape[1]
        if activation is None:
            activation = ("jumprelu" if "activation_function.threshold" in state
                          else "topk" if "k" in state else "relu")
        k = int(state["k"]) if activation == "topk" and "k" in state else None
        tc = cls(d_in, d_transcoder, d_out, layer, activation, k, skip="W_skip" in state,
                 dtype=state["W_enc"].dtype)
        expected = {name: tuple(t.shape) for name, t in tc.state_for_file().items()}
        for name, shape in expected.items():
            if name in state and tuple(state[name].shape) != shape:
                raise ValueError(f"{where}: {name} is {tuple(state[name].shape)}, expected {shape}")
        unexpected = sorted(set(state) - set(expected))
        if unexpected:
            raise ValueError(f"{where} has tensors {unexpected} that a {activation} transcoder does not")
        with torch.no_grad():
            tc.W_enc.copy_(state["W_enc"].T)
            for name in ("W_dec", "b_enc", "b_dec", "W_skip"):
                if name in state:
                    getattr(tc, name).copy_(state[name])
            if tc.threshold is not None:
                tc.threshold.copy_(state["activation_function.threshold"])
        return tc


# ----------------------------------------------------------------------------------------- sets
class _Set(nn.Module):
    """What a TranscoderSet and a CrossLayerTranscoder share: the model identity, hook names and the
    circuit-tracer config file."""

    model_kind: str

    def __init__(self, identity: ModelIdentity | None):
        super().__init__()
        self.identity = identity

    def input_hook(self, layer: int) -> str:
        return input_hook_name(self._layer(layer))

    def output_hook(self, layer: int) -> str:
        return output_hook_name(self._layer(layer))

    def _layer(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.n_layers:
            raise ValueError(f"layer={layer!r} is not a layer of these transcoders (0 ... {self.n_layers - 1})")
        return layer

    def check_model(self, model) -> None:
        """Refuse a model these transcoders were not trained for (family, hidden size, layer count)."""
        if self.identity is not None:
            self.identity.check(model, f"{type(self).__name__}s")
            return
        if (model.cfg.hidden_size, model.cfg.num_layers) != (self.d_in, self.n_layers):
            raise ValueError(f"these transcoders read {self.d_in}-wide inputs over {self.n_layers} layers; the "
                             f"model has hidden_size={model.cfg.hidden_size}, num_layers={model.cfg.num_layers}")

    def _config(self, files: list[str], activation: str, k: int | None) -> dict:
        config = {"model_kind": self.model_kind, "feature_input_hook": FEATURE_INPUT_HOOK,
                  "feature_output_hook": FEATURE_OUTPUT_HOOK, "activation": activation}
        if k is not None:
            config["k"] = k
        if self.identity is not None:
            config.update(model_name=self.identity.family, model_family=self.identity.family,
                          hidden_size=self.identity.hidden_size, num_layers=self.identity.num_layers)
        config["d_transcoder"] = self.d_transcoder
        config["transcoders"] = files
        return config

    @staticmethod
    def _read_config(path: Path, kind: str) -> dict:
        config_file = path / "config.yaml"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.yaml in {path}: not a saved transcoder set")
        config = yaml.safe_load(config_file.read_text())
        if not isinstance(config, dict) or config.get("model_kind") != kind:
            found = config.get("model_kind") if isinstance(config, dict) else None
            raise ValueError(f"{config_file} has model_kind={found!r}, expected {kind!r}")
        hooks = (config.get("feature_input_hook"), config.get("feature_output_hook"))
        if hooks != (FEATURE_INPUT_HOOK, FEATURE_OUTPUT_HOOK):
            raise ValueError(f"{config_file} reads {hooks[0]!r} and writes {hooks[1]!r}; these transcoders read "
                             f"{FEATURE_INPUT_HOOK!r} and write {FEATURE_OUTPUT_HOOK!r} of each layer")
        return config

    @staticmethod
    def _identity_from(config: dict) -> ModelIdentity | None:
        if "model_family" not in config:
            return None
        return ModelIdentity(config["model_family"], int(config["hidden_size"]), int(config["num_layers"]))

    @staticmethod
    def _resolve_identity(model, identity: ModelIdentity | None) -> ModelIdentity | None:
        if model is not None and identity is not None and ModelIdentity.of(model) != identity:
            raise ValueError(f"model is {ModelIdentity.of(model)}, identity= says {identity}")
        return ModelIdentity.of(model) if model is not None else identity


class TranscoderSet(_Set):
    """The per-layer transcoders of one model, one per layer from 0 (circuit-tracer's `TranscoderSet`).

    `model=` (or `identity=`) records the model they were trained for; `check_model` refuses another.
    Saved (`save(dir)`) as circuit-tracer saves one: `config.yaml` (model_kind "transcoder_set", the
    hooks, the activation, `transcoders: [layer_0.safetensors, ...]`, and the model identity) and
    `layer_{i}.safetensors`.
    """

    model_kind = "transcoder_set"

    def __init__(self, transcoders: Sequence[Transcoder], model=None, identity: ModelIdentity | None = None):
        super().__init__(self._resolve_identity(model, identity))
        transcoders = list(transcoders)
        if not transcoders:
            raise ValueError("a TranscoderSet needs at least one transcoder")
        layers = [tc.layer for tc in transcoders]
        if layers != list(range(len(transcoders))):
            raise ValueError(f"a TranscoderSet holds one transcoder per layer 0 ... n-1, in order; got layers {layers}")
        first = transcoders[0]
        for tc in transcoders[1:]:
            for field in ("d_in", "d_transcoder", "d_out", "activation", "k", "has_skip"):
                if getattr(tc, field) != getattr(first, field):
                    raise ValueError(f"layer {tc.layer}'s transcoder has {field}={getattr(tc, field)!r}, layer 0's "
                                     f"{getattr(first, field)!r}: a set's transcoders share their shape")
        self.transcoders = nn.ModuleList(transcoders)
        if self.identity is not None:
            if self.identity.num_layers != len(transcoders):
                raise ValueError(f"{len(transcoders)} transcoders for a model of {self.identity.num_layers} layers")
            if self.identity.hidden_size not in (first.d_in, first.d_out) or first.d_in != first.d_out:
                raise ValueError(f"transcoders of d_in={first.d_in}, d_out={first.d_out} for a model of "
                                 f"hidden_size={self.identity.hidden_size}")

    n_layers = property(lambda self: len(self.transcoders))
    d_transcoder = property(lambda self: self.transcoders[0].d_transcoder)
    d_in = property(lambda self: self.transcoders[0].d_in)
    d_out = property(lambda self: self.transcoders[0].d_out)
    activation = property(lambda self: self.transcoders[0].activation)
    has_skip = property(lambda self: self.transcoders[0].has_skip)

    def __len__(self) -> int:
        return len(self.transcoders)

    def __getitem__(self, layer: int) -> Transcoder:
        return self.transcoders[self._layer(layer)]

    def __iter__(self):
        return iter(self.transcoders)

    def spliced_modules(self) -> list[Transcoder]:
        """What `model.add_sae(set)` and `model.saes(set)` splice: each layer's transcoder."""
        return list(self.transcoders)

    def encode(self, layer: int, x: Float[Tensor, "... d_in"], apply_activation: bool = True
               ) -> Float[Tensor, "... d_transcoder"]:
        """Layer `layer`'s features of its MLP input `x`."""
        return self[layer].encode(x, apply_activation)

    def activate(self, layer: int, pre: Float[Tensor, "... d_transcoder"]) -> Float[Tensor, "... d_transcoder"]:
        return self[layer].activate(pre)

    def decoder(self, source: int, target: int) -> Float[Tensor, "d_transcoder d_out"]:
        """The decoder from layer `source`'s features to layer `target`'s MLP output (per-layer: only
        source == target writes; another target is a ValueError)."""
        if self._layer(source) != self._layer(target):
            raise ValueError(f"a per-layer transcoder of layer {source} writes only layer {source}'s MLP output, "
                             f"not layer {target}'s")
        return self[source].W_dec

    def encoder(self, layer: int) -> Float[Tensor, "d_in d_transcoder"]:
        return self[layer].W_enc

    def threshold_of(self, layer: int) -> Tensor | None:
        return self[layer].threshold

    def decoder_norms(self, layer: int) -> Float[Tensor, " d_transcoder"]:
        """Each feature's decoder norm (the L1 penalty's weights)."""
        return self[layer].W_dec.norm(dim=-1)

    def decode_to(self, layer: int, acts_by_source_layer: Mapping[int, Tensor] | Sequence[Tensor],
                  x: Tensor | None = None) -> Float[Tensor, "... d_out"]:
        """Layer `layer`'s MLP output from the features (only layer `layer`'s are read), plus its skip
        connection of the input `x` where the transcoder has one."""
        out = self[layer].decode(acts_by_source_layer[layer])
        if self.has_skip:
            if x is None:
                raise ValueError(f"layer {layer}'s transcoder has a skip connection: pass its input x")
            out = out + self[layer].skip(x)
        return out

    def save(self, path: str | os.PathLike) -> Path:
        """Write circuit-tracer's layout to the directory `path`."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        files = [f"layer_{tc.layer}.safetensors" for tc in self.transcoders]
        for name, tc in zip(files, self.transcoders):
            save_file(tc.state_for_file(), str(path / name))
        config = self._config(files, self.activation, self.transcoders[0].k)
        (path / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    def save_sae_lens(self, path: str | os.PathLike) -> Path:
        """Each layer's transcoder as SAELens saves one (`save_model`): `path/layer_{l}/` with cfg.json and
        sae_weights.safetensors, which `sae_lens.SAE.load_from_disk` loads."""
        path = Path(path)
        for tc in self.transcoders:
            tc.to_sae_lens().save_model(str(path / f"layer_{tc.layer}"))
        return path

    @classmethod
    def load_sae_lens(cls, path: str | os.PathLike, model=None) -> "TranscoderSet":
        """A set written by `save_sae_lens` (SAELens must be installed); `model` records and checks identity."""
        from sae_lens import SAE

        path = Path(path)
        layers = sorted((p for p in path.glob("layer_*") if p.is_dir()), key=lambda p: int(p.name.split("_")[1]))
        if not layers:
            raise FileNotFoundError(f"no layer_*/ directories in {path}")
        return cls([Transcoder.from_sae_lens(SAE.load_from_disk(str(p)), int(p.name.split("_")[1])) for p in layers],
                   model=model)

    @classmethod
    def load(cls, path: str | os.PathLike, model=None, dtype: torch.dtype | None = None,
             device=None) -> "TranscoderSet":
        """A set saved by `save` (or by circuit-tracer, local files), or "embedded": the ones shipped for
        the embedded `model`; refused for a `model` it was not trained for."""
        path = _resolve_path(path, model)
        config = cls._read_config(path, cls.model_kind)
        activation = config.get("activation") or None
        transcoders = []
        for layer, name in enumerate(config.get("transcoders") or []):
            file = Path(name) if Path(name).is_absolute() else path / name
            if not file.is_file():
                raise FileNotFoundError(f"{path / 'config.yaml'} lists {name}, which does not exist")
            state = load_file(str(file))
            if activation == "topk" and "k" not in state:
                state["k"] = torch.tensor(int(config["k"]))
            transcoders.append(Transcoder.from_file_state(state, layer, activation, where=str(file)))
        if not transcoders:
            raise ValueError(f"{path / 'config.yaml'} lists no transcoders")
        tcs = cls(transcoders, identity=cls._identity_from(config)).to(dtype=dtype, device=device)
        if model is not None:
            tcs.check_model(model)
        return tcs


class CrossLayerTranscoder(_Set):
    """A cross-layer transcoder (circuit-tracer's `CrossLayerTranscoder`): features encoded from each
    layer's MLP input, decoded to that layer's MLP output and every later one's.

        acts[l]     = act(x[l] @ W_enc[l] + b_enc[l])
        out[target] = sum over l <= target of acts[l] @ W_dec[l][:, target - l] + b_dec[target]
                      (+ x[target] @ W_skip[target].T with skip connections)

    W_enc [layer d_in d_transcoder], b_enc [layer d_transcoder], W_dec[l] [d_transcoder (n_layers - l)
    d_out], b_dec [layer d_out], threshold [layer d_transcoder] (JumpReLU), W_skip [layer d_out d_in].
    Saved as circuit-tracer saves one: `W_enc_{l}.safetensors` (W_enc_l [d_transcoder d_in], b_enc_l,
    b_dec_l, threshold_l, W_skip_l) and `W_dec_{l}.safetensors` (W_dec_l), beside `config.yaml`.
    """

    model_kind = "cross_layer_transcoder"

    def __init__(self, n_layers: int, d_in: int, d_transcoder: int, d_out: int | None = None,
                 activation: str = "relu", k: int | None = None, skip: bool = False, model=None,
                 identity: ModelIdentity | None = None, dtype: torch.dtype = torch.float32, device=None):
        super().__init__(self._resolve_identity(model, identity))
        d_out = d_in if d_out is None else d_out
        for name, size in (("n_layers", n_layers), ("d_in", d_in), ("d_transcoder", d_transcoder), ("d_out", d_out)):
            _check_size(name, size)
        _check_activation(activation, k, d_transcoder)
        if self.identity is not None and (self.identity.num_layers, self.identity.hidden_size) != (n_layers, d_in):
            raise ValueError(f"a cross-layer transcoder of n_layers={n_layers}, d_in={d_in} for a model of "
                             f"num_layers={self.identity.num_layers}, hidden_size={self.identity.hidden_size}")
        self._n_layers, self.d_in, self.d_transcoder, self.d_out = n_layers, d_in, d_transcoder, d_out
        self.activation, self.k = activation, k
        kw = dict(dtype=dtype, device=device)
        self.W_enc = nn.Parameter(torch.zeros(n_layers, d_in, d_transcoder, **kw))
        self.b_enc = nn.Parameter(torch.zeros(n_layers, d_transcoder, **kw))
        self.W_dec = nn.ParameterList([nn.Parameter(torch.zeros(d_transcoder, n_layers - l, d_out, **kw))
                                       for l in range(n_layers)])
        self.b_dec = nn.Parameter(torch.zeros(n_layers, d_out, **kw))
        self.W_skip = nn.Parameter(torch.zeros(n_layers, d_out, d_in, **kw)) if skip else None
        self.threshold = (nn.Parameter(torch.zeros(n_layers, d_transcoder, **kw))
                          if activation == "jumprelu" else None)
        self.bandwidth = JUMPRELU_BANDWIDTH  # the straight-through kernel's width: training only

    n_layers = property(lambda self: self._n_layers)
    has_skip = property(lambda self: self.W_skip is not None)

    def activate(self, layer: int, pre: Float[Tensor, "... d_transcoder"]) -> Float[Tensor, "... d_transcoder"]:
        """Layer `layer`'s activation function on pre-activations."""
        if self.activation == "relu":
            return torch.relu(pre)
        if self.activation == "topk":
            return topk_relu(pre, self.k)
        return jumprelu(pre, self.threshold[self._layer(layer)], self.bandwidth)

    def encode(self, layer: int, x: Float[Tensor, "... d_in"], apply_activation: bool = True
               ) -> Float[Tensor, "... d_transcoder"]:
        """Layer `layer`'s features of its MLP input `x`."""
        pre = x.to(self.W_enc.dtype) @ self.W_enc[self._layer(layer)] + self.b_enc[layer]
        return self.activate(layer, pre) if apply_activation else pre

    def encoder(self, layer: int) -> Float[Tensor, "d_in d_transcoder"]:
        return self.W_enc[self._layer(layer)]

    def threshold_of(self, layer: int) -> Tensor | None:
        return None if self.threshold is None else self.threshold[self._layer(layer)]

    def decoder_norms(self, layer: int) -> Float[Tensor, " d_transcoder"]:
        """Each feature's norm over its decoders to every later layer (the L1 penalty's weights)."""
        return self.W_dec[self._layer(layer)].flatten(1).norm(dim=-1)

    def decoder(self, source: int, target: int) -> Float[Tensor, "d_transcoder d_out"]:
        """The decoder from layer `source`'s features to layer `target`'s MLP output (target >= source)."""
        if self._layer(target) < self._layer(source):
            raise ValueError(f"layer {source}'s features write layers {source} ... {self.n_layers - 1}, "
                             f"not layer {target}")
        return self.W_dec[source][:, target - source]

    def skip(self, layer: int, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        """Layer `layer`'s skip connection, x @ W_skip[layer].T (zero without one)."""
        if self.W_skip is None:
            return torch.zeros(*x.shape[:-1], self.d_out, dtype=self.b_dec.dtype, device=x.device)
        return x.to(self.W_skip.dtype) @ self.W_skip[self._layer(layer)].T

    def decode_to(self, layer: int, acts_by_source_layer: Mapping[int, Tensor] | Sequence[Tensor],
                  x: Tensor | None = None) -> Float[Tensor, "... d_out"]:
        """Layer `layer`'s MLP output from the features of layers 0 ... layer (a source layer missing from
        a mapping contributes nothing), plus its skip connection of its input `x` where there is one."""
        self._layer(layer)
        sources = (acts_by_source_layer.items() if isinstance(acts_by_source_layer, Mapping)
                   else enumerate(acts_by_source_layer))
        out = self.b_dec[layer]
        for source, acts in sources:
            if source <= layer:
                out = out + acts @ self.decoder(source, layer)
        if self.W_skip is not None:
            if x is None:
                raise ValueError(f"layer {layer} has a skip connection: pass its input x")
            out = out + self.skip(layer, x)
        return out

    def decode(self, acts_by_layer: Sequence[Tensor], xs: Sequence[Tensor] | None = None) -> list[Tensor]:
        """Every layer's MLP output from every layer's features (and inputs, with skip connections)."""
        return [self.decode_to(l, acts_by_layer, None if xs is None else xs[l]) for l in range(self.n_layers)]

    def forward(self, xs: Sequence[Tensor]) -> list[Tensor]:
        """Every layer's MLP output from every layer's MLP input."""
        if len(xs) != self.n_layers:
            raise ValueError(f"{len(xs)} inputs for a cross-layer transcoder of {self.n_layers} layers")
        return self.decode([self.encode(l, x) for l, x in enumerate(xs)], xs)

    def extra_repr(self) -> str:
        act = f"topk(k={self.k})" if self.activation == "topk" else self.activation
        return (f"n_layers={self.n_layers}, {self.d_in} -> {self.d_transcoder} per layer -> {self.d_out}, {act}"
                f"{', skip' if self.has_skip else ''}")

    def save(self, path: str | os.PathLike) -> Path:
        """Write circuit-tracer's CLT layout to the directory `path`."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        files = []
        for l in range(self.n_layers):
            enc = {f"W_enc_{l}": self.W_enc[l].T, f"b_enc_{l}": self.b_enc[l], f"b_dec_{l}": self.b_dec[l]}
            if self.threshold is not None:
                enc[f"threshold_{l}"] = self.threshold[l]
            if self.W_skip is not None:
                enc[f"W_skip_{l}"] = self.W_skip[l]
            for name, tensors in ((f"W_enc_{l}.safetensors", enc),
                                  (f"W_dec_{l}.safetensors", {f"W_dec_{l}": self.W_dec[l]})):
                save_file({n: t.detach().cpu().contiguous() for n, t in tensors.items()}, str(path / name))
                files.append(name)
        (path / "config.yaml").write_text(yaml.safe_dump(self._config(files, self.activation, self.k),
                                                         sort_keys=False))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, model=None, dtype: torch.dtype | None = None,
             device=None) -> "CrossLayerTranscoder":
        """A cross-layer transcoder saved by `save`; refused for a `model` it was not trained for."""
        path = _resolve_path(path, model)
        config = cls._read_config(path, cls.model_kind)
        n_layers = sum(1 for _ in path.glob("W_enc_*.safetensors"))
        if n_layers == 0:
            raise FileNotFoundError(f"no W_enc_*.safetensors in {path}")
        states = []
        for l in range(n_layers):
            files = [path / f"W_enc_{l}.safetensors", path / f"W_dec_{l}.safetensors"]
            for file in files:
                if not file.is_file():
                    raise FileNotFoundError(f"{file} is missing: a cross-layer transcoder of {n_layers} layers")
            states.append({**load_file(str(files[0])), **load_file(str(files[1]))})
        d_transcoder, d_in = states[0]["W_enc_0"].shape
        activation = config.get("activation") or ("jumprelu" if "threshold_0" in states[0] else "relu")
        k = int(config["k"]) if activation == "topk" else None
        clt = cls(n_layers, d_in, d_transcoder, states[0]["W_dec_0"].shape[-1], activation, k,
                  skip="W_skip_0" in states[0], identity=cls._identity_from(config), dtype=states[0]["W_enc_0"].dtype)
        with torch.no_grad():
            for l, state in enumerate(states):
                targets = {f"W_enc_{l}": clt.W_enc[l].T, f"b_enc_{l}": clt.b_enc[l], f"b_dec_{l}": clt.b_dec[l],
                           f"W_dec_{l}": clt.W_dec[l]}
                if clt.threshold is not None:
                    targets[f"threshold_{l}"] = clt.threshold[l]
                if clt.W_skip is not None:
                    targets[f"W_skip_{l}"] = clt.W_skip[l]
                for name, target in targets.items():
                    if name not in state or state[name].shape != target.shape:
                        found = tuple(state[name].shape) if name in state else "missing"
                        raise ValueError(f"{path}: {name} is {found}, expected {tuple(target.shape)}")
                    target.copy_(state[name])
        clt = clt.to(dtype=dtype, device=device)
        if model is not None:
            clt.check_model(model)
        return clt


def load_transcoders(path: str | os.PathLike, model=None, dtype: torch.dtype | None = None,
                     device=None) -> TranscoderSet | CrossLayerTranscoder:
    """A TranscoderSet or CrossLayerTranscoder from a directory in circuit-tracer's layout, by the
    `model_kind` its config.yaml names; "embedded": the ones shipped for the embedded `model`."""
    path = _resolve_path(path, model)
    config_file = path / "config.yaml"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.yaml in {path}: not a saved transcoder set")
    kind = (yaml.safe_load(config_file.read_text()) or {}).get("model_kind")
    classes = {c.model_kind: c for c in (TranscoderSet, CrossLayerTranscoder)}
    if kind not in classes:
        raise ValueError(f"{config_file} has model_kind={kind!r}; expected one of {sorted(classes)}")
    return classes[kind].load(path, model, dtype, device)


def _resolve_path(path: str | os.PathLike, model) -> Path:
    """A directory; "embedded" is the package's transcoders of `model`'s family."""
    if str(path) != "embedded":
        return Path(path)
    if model is None:
        raise ValueError('"embedded" transcoders are those of the embedded model: pass model=')
    from hooked_models.embedded import EMBEDDED_DIR

    return EMBEDDED_DIR / ModelIdentity.of(model).family / "transcoders"


def init_transcoder_(tc: Transcoder | CrossLayerTranscoder, seed: int = 0, threshold: float = 0.0) -> None:
    """Random weights for training or tests: decoder rows of unit norm, the encoder their transpose
    (as SAELens initializes; scaled normal where d_in != d_out), biases zero, skip zero, JumpReLU
    thresholds `threshold`. A cross-layer decoder is split evenly over the layers it writes."""
    generator = torch.Generator().manual_seed(seed)

    def pair() -> tuple[Tensor, Tensor]:
        w = torch.randn(tc.d_transcoder, tc.d_out, generator=generator)
        w = w / w.norm(dim=-1, keepdim=True)
        if tc.d_in == tc.d_out:
            return w.T, w
        return torch.randn(tc.d_in, tc.d_transcoder, generator=generator) / math.sqrt(tc.d_in), w

    with torch.no_grad():
        if isinstance(tc, Transcoder):
            enc, dec = pair()
            tc.W_enc.copy_(enc)
            tc.W_dec.copy_(dec)
        else:
            for l in range(tc.n_layers):
                enc, dec = pair()
                tc.W_enc[l].copy_(enc)
                tc.W_dec[l].copy_(dec[:, None, :].expand(-1, tc.n_layers - l, -1) / (tc.n_layers - l))
        for name in ("b_enc", "b_dec", "W_skip"):
            if getattr(tc, name, None) is not None:
                getattr(tc, name).zero_()
        if tc.threshold is not None:
            tc.threshold.fill_(threshold)


# -------------------------------------------------------------------------------------- training
@dataclass(frozen=True)
class TrainingConfig:
    """What `train_transcoders` trains, and how. The loss per token is, summed over layers, the squared
    error of the MLP output divided by its mean squared norm, plus `sparsity` times the features' L1
    weighted by their decoder norms (ReLU; Anthropic's and SAELens's penalty) or their L0 through the
    straight-through step (JumpReLU; Rajamanoharan et al. 2024); TopK needs none. Adam at `lr`, the
    last fifth of the steps decayed linearly to zero."""

    d_transcoder: int = 256
    activation: str = "relu"
    k: int | None = None
    skip: bool = False
    cross_layer: bool = False
    steps: int = 2000
    batch_tokens: int = 1024
    lr: float = 2e-3
    sparsity: float = 1e-3
    threshold: float = 0.01  # JumpReLU's initial threshold
    bandwidth: float = 0.05  # JumpReLU's straight-through kernel width
    seed: int = 0
    checkpoint_every: int = 250

    def __post_init__(self):
        for name in ("d_transcoder", "steps", "batch_tokens", "checkpoint_every"):
            _check_size(name, getattr(self, name))
        _check_activation(self.activation, self.k, self.d_transcoder)
        for name in ("lr", "sparsity", "threshold", "bandwidth"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0 or (name in ("lr", "bandwidth") and value == 0):
                kind = "positive" if name in ("lr", "bandwidth") else "non-negative"
                raise ValueError(f"{name}={value!r} must be a {kind} number")


_FAMILIES_BY_CLASS = {"HookedArcee": "arcee", "HookedAlphaEr": "alpha_er"}


class HarvestReader:
    """Batches of (MLP inputs, MLP outputs) of every layer from a `corpus.harvest` on disk, drawn at
    random rows of the memory-mapped dataset: one batch in memory, whatever the corpus's size."""

    def __init__(self, path: str | os.PathLike):
        import datasets

        self.path = Path(path)
        manifest_file = self.path / "manifest.json"
        if not manifest_file.is_file():
            raise FileNotFoundError(f"no manifest.json in {self.path}: not a corpus.harvest output")
        manifest = json.loads(manifest_file.read_text())
        if not manifest.get("complete"):
            raise ValueError(f"the harvest in {self.path} is not complete: rerun corpus.harvest to finish it")
        model, config = manifest["model"], manifest["model"]["config"]
        family = _FAMILIES_BY_CLASS.get(model["family"])
        if family is None:
            raise ValueError(f"{self.path} is a harvest of a {model['family']}, not a hooked model family")
        self.identity = ModelIdentity(family, int(config.get("hidden_size", config.get("n_embd"))),
                                      int(config.get("num_layers", config.get("n_layer"))))
        names = [name for l in range(self.identity.num_layers) for name in (input_hook_name(l), output_hook_name(l))]
        missing = [name for name in names if name not in manifest["names"]]
        if missing:
            raise ValueError(f"the harvest in {self.path} lacks {', '.join(missing)}: transcoders of every layer "
                             f"train on {', '.join(names)}")
        self.names, self.context_size = names, int(manifest["context_size"])
        self.dataset = datasets.load_from_disk(str(self.path)).with_format("numpy", columns=names)
        self.rows = len(self.dataset)

    def batch(self, step: int, tokens: int, seed: int) -> tuple[Tensor, Tensor]:
        """Step `step`'s batch, the same on every run: inputs and outputs [layer tokens hidden_size]."""
        rows = max(1, -(-tokens // self.context_size))
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        index = torch.randint(0, self.rows, (rows,), generator=generator).sort().values.tolist()
        data = self.dataset[index]
        def stack(names):  # [layer tokens hidden_size]
            return torch.stack([torch.from_numpy(data[n]).reshape(-1, data[n].shape[-1]) for n in names])

        return stack(self.names[0::2]), stack(self.names[1::2])


def new_transcoders(identity: ModelIdentity, config: TrainingConfig) -> TranscoderSet | CrossLayerTranscoder:
    """Untrained transcoders for a model, as `config` says, initialized from `config.seed`."""
    d = identity.hidden_size
    if config.cross_layer:
        tcs = CrossLayerTranscoder(identity.num_layers, d, config.d_transcoder, activation=config.activation,
                                   k=config.k, skip=config.skip, identity=identity)
        init_transcoder_(tcs, config.seed, config.threshold)
        tcs.bandwidth = config.bandwidth
        return tcs
    layers = []
    for l in range(identity.num_layers):
        tc = Transcoder(d, config.d_transcoder, layer=l, activation=config.activation, k=config.k, skip=config.skip)
        init_transcoder_(tc, config.seed + l, config.threshold)
        tc.bandwidth = config.bandwidth
        layers.append(tc)
    return TranscoderSet(layers, identity=identity)


def _training_loss(tcs, x: Tensor, y: Tensor, scale: Tensor, config: TrainingConfig) -> tuple[Tensor, Tensor]:
    """(loss, normalized squared error per layer) of one batch."""
    pre = [tcs.encode(l, x[l], apply_activation=False) for l in range(tcs.n_layers)]
    acts = [tcs.activate(l, p) for l, p in enumerate(pre)]
    errors = torch.stack([((tcs.decode_to(l, acts, x[l]) - y[l]) ** 2).sum(-1).mean() for l in range(tcs.n_layers)])
    errors = errors / scale
    penalty = torch.zeros(())
    if config.activation == "relu":
        penalty = sum((a * tcs.decoder_norms(l)).sum(-1).mean() for l, a in enumerate(acts))
    elif config.activation == "jumprelu":
        penalty = sum(step(p, tcs.threshold_of(l), config.bandwidth).sum(-1).mean() for l, p in enumerate(pre))
    return errors.sum() + config.sparsity * penalty, errors.detach()


def _lr_factor(step_index: int, steps: int) -> float:
    decay_from = steps - steps // 5
    return 1.0 if step_index < decay_from else (steps - step_index) / (steps - decay_from)


def train_transcoders(source, *, dataset=None, config: TrainingConfig = TrainingConfig(),
                      checkpoint: str | os.PathLike | None = None, progress: bool | None = None,
                      context_size: int | None = None, family: str | None = None,
                      harvest_dir: str | os.PathLike | None = None) -> TranscoderSet | CrossLayerTranscoder:
    """Transcoders (per layer, or one cross-layer transcoder with `config.cross_layer`) trained to map
    every layer's `mlp_input` to its `mlp.mlp_output`.

    source: a `corpus.harvest` directory holding every layer's `layers.{l}.mlp_input` and
      `layers.{l}.mlp.mlp_output`; or, with `dataset`, a model (a hooked model, a checkpoint path or
      "embedded", `family` saying which) whose activations over `dataset` (anything `corpus.harvest`
      takes, with its `context_size`) are harvested first, into `harvest_dir` (default: a temporary one).
    checkpoint: a file written every `config.checkpoint_every` steps and at the end (parameters,
      optimizer state, step); a rerun with the same file, source and config resumes from it and ends
      with the uninterrupted run's weights bit for bit. One of other settings is refused.
    progress: a progress bar (default: on a terminal).
    """
    if dataset is not None:
        if harvest_dir is None:
            with tempfile.TemporaryDirectory(prefix="transcoder-harvest-") as tmp:
                return train_transcoders(source, dataset=dataset, config=config, checkpoint=checkpoint,
                                         progress=progress, context_size=context_size, family=family,
                                         harvest_dir=tmp)
        _harvest_mlps(source, dataset, harvest_dir, context_size, family, progress)
        source = harvest_dir
    elif not isinstance(source, (str, os.PathLike)):
        raise ValueError(f"source is a {type(source).__name__}: pass a harvest directory, or a model with dataset=")
    reader = HarvestReader(source)
    torch.manual_seed(config.seed)
    tcs = new_transcoders(reader.identity, config)
    optimizer = torch.optim.Adam(tcs.parameters(), lr=config.lr)
    x0, y0 = reader.batch(0, config.batch_tokens, config.seed)
    with torch.no_grad():  # the decoder bias starts at the mean output; errors are relative to the output's size
        scale = (y0 ** 2).sum(-1).mean(-1)
        for l in range(tcs.n_layers):
            (tcs[l].b_dec if isinstance(tcs, TranscoderSet) else tcs.b_dec[l]).copy_(y0[l].mean(0))
    start = 0
    job = {"config": asdict(config), "identity": asdict(reader.identity), "rows": reader.rows}
    if checkpoint is not None and Path(checkpoint).is_file():
        saved = torch.load(checkpoint, weights_only=True)
        theirs = json.loads(saved["job"])
        for key, mine in job.items():
            if theirs.get(key) != mine:
                raise ValueError(f"checkpoint {checkpoint} is of another training run: its {key} is {theirs.get(key)}, "
                                 f"this run's {mine}")
        tcs.load_state_dict(saved["transcoders"])
        optimizer.load_state_dict(saved["optimizer"])
        start, scale = int(saved["step"]), saved["scale"]
    show = sys.stderr.isatty() if progress is None else progress
    with tqdm(total=config.steps, initial=start, desc="transcoders", unit="step", disable=not show) as bar:
        for step_index in range(start, config.steps):
            x, y = reader.batch(step_index, config.batch_tokens, config.seed)
            for group in optimizer.param_groups:
                group["lr"] = config.lr * _lr_factor(step_index, config.steps)
            loss, errors = _training_loss(tcs, x, y, scale, config)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if config.activation == "jumprelu":
                with torch.no_grad():  # a threshold stays non-negative
                    for l in range(tcs.n_layers):
                        tcs.threshold_of(l).clamp_(min=0)
            done = step_index + 1
            if checkpoint is not None and (done % config.checkpoint_every == 0 or done == config.steps):
                _save_checkpoint(checkpoint, tcs, optimizer, done, scale, job)
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.4f}", fve=f"{1 - errors.mean().item():.3f}", refresh=False)
    return tcs.eval()


def _save_checkpoint(path, tcs, optimizer, step_index: int, scale: Tensor, job: dict) -> None:
    """Written under a temporary name and renamed into place: a killed run leaves the previous one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"transcoders": tcs.state_dict(), "optimizer": optimizer.state_dict(), "step": step_index,
                "scale": scale, "job": json.dumps(job)}, tmp)
    os.replace(tmp, path)


def _harvest_mlps(model, dataset, out, context_size, family, progress) -> None:
    """Every layer's MLP input and output over `dataset`, into `out` (corpus.harvest)."""
    from hooked_models import corpus
    from hooked_models.families import load_model
    from hooked_models.model import HookedModel

    num_layers = (model if isinstance(model, HookedModel) else load_model(model, family)).cfg.num_layers
    names = [name for l in range(num_layers) for name in (input_hook_name(l), output_hook_name(l))]
    corpus.harvest(model, dataset, names, out, context_size=context_size, family=family, progress=progress)


# -------------------------------------------------------------------------------------- fidelity
@torch.no_grad()
def transcoder_fidelity(model, transcoders: TranscoderSet | CrossLayerTranscoder, tokens: Tensor) -> dict:
    """How much of the MLPs the transcoders replace, on `tokens` [batch seq]:

    variance_explained: per layer, 1 - Σ|y - ŷ|² / Σ|y - mean y|² over every position, ŷ the
      transcoders' output from the model's own MLP inputs;
    loss, loss_spliced, loss_zero_ablated: the next-token loss of the model, of the replacement model
      (every MLP output replaced by the transcoders' from the replacement model's own MLP inputs, no
      error terms), and with every MLP output zero;
    loss_recovered: (zero_ablated - spliced) / (zero_ablated - loss), 1 when the replacement is perfect;
    loss_gap: spliced - loss.
    """
    transcoders.check_model(model)
    n = transcoders.n_layers
    inputs, outputs = [input_hook_name(l) for l in range(n)], [output_hook_name(l) for l in range(n)]
    _, cache = model.run_with_cache(tokens, names_filter=lambda name: name in inputs + outputs)
    acts = [transcoders.encode(l, cache[inputs[l]]) for l in range(n)]
    explained = []
    for l in range(n):
        y = cache[outputs[l]].reshape(-1, cache[outputs[l]].shape[-1])
        y_hat = transcoders.decode_to(l, acts, cache[inputs[l]]).reshape(y.shape)
        explained.append(1 - float(((y - y_hat) ** 2).sum() / ((y - y.mean(0)) ** 2).sum()))
    loss = float(model(tokens, return_type="loss"))
    live: dict[int, Tensor] = {}  # the replacement model's features, layer by layer
    live_inputs: dict[int, Tensor] = {}

    def read(layer):
        def hook(x, hook):
            live[layer], live_inputs[layer] = transcoders.encode(layer, x), x
        return hook

    def write(layer):
        return lambda y, hook: transcoders.decode_to(layer, live, live_inputs[layer]).to(y.dtype)

    spliced = float(model.run_with_hooks(tokens, return_type="loss", fwd_hooks=[
        hook for l in range(n) for hook in ((inputs[l], read(l)), (outputs[l], write(l)))]))
    ablated = float(model.run_with_hooks(tokens, return_type="loss",
                                         fwd_hooks=[(name, lambda y, hook: torch.zeros_like(y)) for name in outputs]))
    return {"variance_explained": explained, "loss": loss, "loss_spliced": spliced, "loss_zero_ablated": ablated,
            "loss_recovered": (ablated - spliced) / (ablated - loss), "loss_gap": spliced - loss}
