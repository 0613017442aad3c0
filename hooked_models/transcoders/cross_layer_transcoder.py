"""The cross-layer transcoder (circuit-tracer's `transcoder/cross_layer_transcoder.py`): features
encoded from each layer's MLP input, decoded to that layer's MLP output and every later one's.

    clt = CrossLayerTranscoder(n_layers=2, d_in=64, d_transcoder=512, model=model)
    clt.decode_to(1, {0: acts0, 1: acts1})     # decoders from each layer to it and every later one
"""

import os
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
from hooked_models.transcoders.files import SetBase, resolve_path
from hooked_models.transcoders.identity import ModelIdentity


class CrossLayerTranscoder(SetBase):
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
            check_size(name, size)
        check_activation(activation, k, d_transcoder)
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
        path = resolve_path(path, model)
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

