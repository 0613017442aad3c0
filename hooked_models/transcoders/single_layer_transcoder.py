"""Per-layer transcoders (circuit-tracer's `transcoder/single_layer_transcoder.py`): `Transcoder`, one
layer's sparse replacement of its MLP, and `TranscoderSet`, one per layer of a model.

    tc = Transcoder(d_in=64, d_transcoder=512, layer=1, activation="topk", k=16)
    acts = tc.encode(x)                        # x: layers.1.mlp_input [... d_in] -> [... d_transcoder]
    out = tc(x)                                # decode(encode(x)) (+ x @ W_skip.T): layers.1.mlp.mlp_output
    tcs = TranscoderSet([...], model=model)    # one per layer, for one model (family, hidden size, layers)
    tcs.save("out/tc"); TranscoderSet.load("out/tc", model=model)    # circuit-tracer's layout

In memory W_enc is [d_in d_transcoder] and W_dec [d_transcoder d_out] (x @ W_enc, acts @ W_dec), W_skip
[d_out d_in] (applied as x @ W_skip.T, circuit-tracer's convention); on disk W_enc is circuit-tracer's
[d_transcoder d_in]. SAELens's transcoder classes convert both ways.
"""

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.nn as nn
import yaml
from jaxtyping import Float
from safetensors.torch import load_file, save_file
from torch import Tensor

from hooked_models.transcoders.activation_functions import (
    JUMPRELU_BANDWIDTH,
    check_activation,
    check_size,
    jumprelu,
    topk_relu,
)
from hooked_models.transcoders.files import SAE_LENS_CLASSES, SetBase, resolve_path
from hooked_models.transcoders.identity import ModelIdentity, input_hook_name, output_hook_name


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
            check_size(name, size)
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ValueError(f"layer={layer!r} must be a non-negative integer")
        check_activation(activation, k, d_transcoder)
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



class TranscoderSet(SetBase):
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
    k = property(lambda self: self.transcoders[0].k)

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
        self._writes_only_itself(source, target)
        return self[source].W_dec

    def _writes_only_itself(self, source: int, target: int) -> None:
        if self._layer(source) != self._layer(target):
            raise ValueError(f"a per-layer transcoder of layer {source} writes only layer {source}'s MLP output, "
                             f"not layer {target}'s")

    def encoder(self, layer: int) -> Float[Tensor, "d_in d_transcoder"]:
        return self[layer].W_enc

    def threshold_of(self, layer: int) -> Tensor | None:
        return self[layer].threshold

    def skip_weight(self, layer: int) -> Float[Tensor, "d_out d_in"] | None:
        """Layer `layer`'s W_skip (its skip connection is x @ W_skip.T), None without one."""
        return self[layer].W_skip

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
        files = [f"layer_{layer}.safetensors" for layer in range(self.n_layers)]
        for layer, name in enumerate(files):  # a layer at a time (a lazily loaded set reads one at a time)
            save_file(self[layer].state_for_file(), str(path / name))
        config = self._config(files, self.activation, self.k)
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
        path = resolve_path(path, model)
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

