"""alpha-er as a transformers model: `AlphaErModel` and `AlphaErForCausalLM`.

Self-contained (torch and transformers only, 4.57 and 5.x): `save_pretrained` copies this file and
configuration_alpha_er.py beside the weights, so `AutoModelForCausalLM.from_pretrained(dir,
trust_remote_code=True)` loads the model where hooked_models is not installed.

What differs from Llama (transformers' modeling_llama.py, whose layout this follows): learned absolute
positions instead of rotary; LayerNorm with bias; qkv, the attention output and the LM head are each a
rank-r factored projection (down -> LayerNorm on the bottleneck -> up); attention scores are soft-capped,
tanh(s/cap)·cap, before the mask; the MLP is G positional experts with tanh-approximate GELU, a token at
position t of T going to expert floor(t·G/T). So the sequence length is part of the architecture: a
forward takes T a multiple of G (at most max_position_embeddings), there is no key/value cache, and
`generate` pads each window to max_position_embeddings and reads the last real position.
Reference: the alpha-er reference implementation (hooked_models' shared/seeds/004_*.txt).
"""

import math
from collections.abc import Callable

import torch
import torch.nn as nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_alpha_er import AlphaErConfig

try:  # transformers 5: initializers that leave tensors loaded from a checkpoint as they are
    from transformers import initialization as init
except ImportError:  # 4.x initializes before loading
    from torch.nn import init

# The implementations transformers ships: none applies the soft cap exactly (sdpa never exposes the
# scores; flash and flex cap in their own kernels, unverified against the reference).
BUILT_IN_ATTENTION = frozenset(ALL_ATTENTION_FUNCTIONS.keys()) - {"eager"}


def attention_refusal(implementation: str) -> str:
    """Why `implementation` cannot run alpha-er, and what can."""
    return (f"attn_implementation={implementation!r} cannot run alpha-er: its attention soft-caps the scores, "
            "tanh(s/cap)·cap, before the softmax, so it needs the scores themselves, which sdpa never exposes "
            "(flash and flex attention cap inside their kernels, not as the reference does). Use "
            "attn_implementation='eager' (exact against the reference), or a function you register with "
            "transformers.AttentionInterface.register that applies the `softcap` it is passed")


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores, the soft cap, the boolean mask (True attends), softmax, values: the reference's order."""
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap:
        # Not optional: without it the reference's port was off by 82% of logit magnitude (the reference).
        attn_weights = torch.tanh(attn_weights / softcap) * softcap
    if attention_mask is not None:
        attn_weights = attn_weights.masked_fill(~attention_mask, float("-inf"))
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value).transpose(1, 2).contiguous()
    return attn_output, attn_weights


class AlphaErFactoredProjection(nn.Module):
    """x -> down_proj -> LayerNorm on the rank-r bottleneck -> up_proj. The norm is what kept the
    factored form from diverging in training (the reference)."""

    def __init__(self, in_features: int, rank: int, out_features: int, eps: float):
        super().__init__()
        self.down_proj = nn.Linear(in_features, rank, bias=False)
        self.norm = nn.LayerNorm(rank, eps=eps)
        self.up_proj = nn.Linear(rank, out_features, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.up_proj(self.norm(self.down_proj(hidden_states)))


class AlphaErAttention(nn.Module):
    """Multi-head attention (no GQA) with factored qkv and output projections and capped scores."""

    def __init__(self, config: AlphaErConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.scaling = 1.0 / math.sqrt(self.head_dim)  # the reference's; head_dim**-0.5 differs in float64 for some
        self.softcap = config.attn_soft_cap or None
        self.is_causal = True
        d = config.hidden_size
        self.qkv_proj = AlphaErFactoredProjection(d, config.attn_rank, 3 * d, config.layer_norm_eps)
        self.o_proj = AlphaErFactoredProjection(d, config.attn_rank, d, config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq, d = hidden_states.shape
        hidden_shape = (batch, seq, self.num_heads, self.head_dim)
        query, key, value = (t.view(hidden_shape).transpose(1, 2) for t in self.qkv_proj(hidden_states).split(d, -1))

        attention_interface: Callable = eager_attention_forward
        if self.config._attn_implementation not in (None, "eager"):
            # A function registered with AttentionInterface; the check repeats get_correct_attn_implementation's
            # for a value written to the config directly.
            implementation = self.config._attn_implementation
            if implementation in BUILT_IN_ATTENTION or implementation not in ALL_ATTENTION_FUNCTIONS:
                raise ValueError(attention_refusal(implementation))
            attention_interface = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        attn_output, attn_weights = attention_interface(
            self, query, key, value, attention_mask, scaling=self.scaling, softcap=self.softcap, dropout=0.0, **kwargs,
        )
        return self.o_proj(attn_output.reshape(batch, seq, d)), attn_weights


class AlphaErMLP(nn.Module):
    """G experts of width intermediate_size/G; the window of positions [g·T/G, (g+1)·T/G) goes to expert g.

    Routing on the position within the sequence (not in the flattened batch) is what makes a checkpoint
    give the same logits at any batch width (the reference).
    """

    def __init__(self, config: AlphaErConfig):
        super().__init__()
        experts, width, d = config.mlp_experts, config.intermediate_size // config.mlp_experts, config.hidden_size
        self.num_experts = experts
        self.up_proj = nn.Parameter(torch.empty(experts, width, d))
        self.down_proj = nn.Parameter(torch.empty(experts, d, width))
        self.act_fn = nn.GELU(approximate="tanh")  # the tanh form is what the native kernel computes

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, seq, d = hidden_states.shape
        windows = hidden_states.view(batch, self.num_experts, seq // self.num_experts, d)
        hidden = self.act_fn(torch.einsum("bgsd,gfd->bgsf", windows, self.up_proj))
        return torch.einsum("bgsf,gdf->bgsd", hidden, self.down_proj).reshape(batch, seq, d)


class AlphaErDecoderLayer(nn.Module):
    def __init__(self, config: AlphaErConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = AlphaErAttention(config, layer_idx)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = AlphaErMLP(config)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **kwargs) -> torch.Tensor:
        attn_output, _ = self.self_attn(self.input_layernorm(hidden_states), attention_mask, **kwargs)
        hidden_states = hidden_states + attn_output
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class AlphaErPreTrainedModel(PreTrainedModel):
    config_class = AlphaErConfig
    config: AlphaErConfig
    base_model_prefix = "model"
    _no_split_modules = ["AlphaErDecoderLayer"]
    # Eager only (or a registered function that caps): see attention_refusal.
    _supports_sdpa = False
    _supports_flash_attn = False
    _supports_flash_attn_2 = False
    _supports_flex_attn = False
    _supports_attention_backend = True

    def get_correct_attn_implementation(self, requested_attention: str | None, is_init_check: bool = False) -> str:
        """eager (the default), or a function registered with AttentionInterface; the built-in others refused."""
        if requested_attention in (None, "eager"):
            return "eager"
        if requested_attention in BUILT_IN_ATTENTION or requested_attention not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(attention_refusal(requested_attention))
        return requested_attention

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, AlphaErMLP):
            init.normal_(module.up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)


class AlphaErModel(AlphaErPreTrainedModel):
    """The embeddings, the decoder layers and the final LayerNorm; outputs the normed hidden states."""

    def __init__(self, config: AlphaErConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList([AlphaErDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embed_tokens = value

    def check_length(self, seq: int) -> None:
        """A ValueError unless alpha-er computes at length `seq`: a multiple of mlp_experts, at most
        max_position_embeddings."""
        experts, block = self.config.mlp_experts, self.config.max_position_embeddings
        if seq > block or seq % experts:
            why = (f"longer than max_position_embeddings={block}, the number of learned positions" if seq > block else
                   f"not a multiple of mlp_experts={experts}: the expert of position t is floor(t·{experts}/T), "
                   "so the model reproduces its training behaviour only at such lengths")
            raise ValueError(f"sequence length {seq} is {why}; pad the input to {block} and read the logits at the "
                             "last real position (attention is causal, so padding after the prompt cannot change "
                             "them); AlphaErForCausalLM.generate does this")

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast | tuple:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        if use_cache:
            raise ValueError("alpha-er has no key/value cache: a token's expert depends on the whole length T, "
                             "so every step reruns the padded window (use_cache=False)")
        if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
            raise ValueError("alpha-er has no key/value cache; pass no past_key_values")
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = (self.config.output_hidden_states if output_hidden_states is None
                                else output_hidden_states)
        return_dict = self.config.return_dict if return_dict is None else return_dict
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        batch, seq, _ = inputs_embeds.shape
        self.check_length(seq)
        positions = torch.arange(seq, device=inputs_embeds.device)
        if position_ids is not None and not torch.equal(position_ids.to(positions.device).expand(batch, seq),
                                                        positions.expand(batch, seq)):
            raise ValueError("alpha-er embeds and routes by the position within the sequence: position_ids must be "
                             f"0..{seq - 1} in every row")
        hidden_states = inputs_embeds + self.embed_positions(positions)
        mask = self._mask(attention_mask, batch, seq, inputs_embeds.device)

        # Each layer's attention weights, read as transformers 5 records outputs: a hook on the module.
        attentions, hidden = [], []
        hooks = [layer.self_attn.register_forward_hook(lambda module, args, out: attentions.append(out[1]))
                 for layer in self.layers] if output_attentions else []
        try:
            for layer in self.layers:
                hidden.append(hidden_states)
                hidden_states = layer(hidden_states, mask, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()
        hidden_states = self.norm(hidden_states)
        hidden.append(hidden_states)
        output = BaseModelOutputWithPast(
            last_hidden_state=hidden_states,
            hidden_states=tuple(hidden) if output_hidden_states else None,
            attentions=tuple(attentions) if output_attentions else None,
        )
        return output if return_dict else output.to_tuple()

    @staticmethod
    def _mask(attention_mask: torch.Tensor | None, batch: int, seq: int, device) -> torch.Tensor:
        """The boolean mask, True where a query attends: causal, and with a padding mask (right padding only,
        since positions and experts count from the first token) the real keys, and always itself."""
        causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
        if attention_mask is None:
            return causal[None, None].expand(batch, 1, seq, seq)
        keys = attention_mask.bool()
        if bool((keys[:, 1:] & ~keys[:, :-1]).any()):
            raise ValueError("alpha-er embeds and routes by position, so padding must be on the right "
                             "(an attention_mask of ones, then zeros)")
        # A padding query keeps itself, so its row stays finite (its output is never read).
        return (causal & keys[:, None, None, :]) | torch.eye(seq, dtype=torch.bool, device=device)


class AlphaErForCausalLM(AlphaErPreTrainedModel, GenerationMixin):
    """alpha-er with its factored LM head: logits = up(LayerNorm(down(norm(h))))."""

    def __init__(self, config: AlphaErConfig):
        super().__init__(config)
        self.model = AlphaErModel(config)
        self.lm_head = AlphaErFactoredProjection(config.hidden_size, config.lm_head_rank, config.vocab_size,
                                                 config.layer_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        """The logits; with `labels`, the next-token cross-entropy (labels -100 ignored, shifted inside)."""
        return_dict = self.config.return_dict if return_dict is None else return_dict
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             inputs_embeds=inputs_embeds, use_cache=use_cache, output_attentions=output_attentions,
                             output_hidden_states=output_hidden_states, return_dict=True, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        output = CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                        attentions=outputs.attentions)
        return output if return_dict else output.to_tuple()

    @torch.no_grad()
    def generate(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                 max_new_tokens: int = 20, do_sample: bool = False, temperature: float = 1.0, top_k: int | None = 50,
                 **unsupported) -> torch.LongTensor:
        """The reference's rule: each step pads the last max_position_embeddings tokens after the text with
        pad_token_id (0) to max_position_embeddings and reads the logits at the last real position (exact:
        attention is causal). Greedy, or with `do_sample` one draw from softmax(top_k logits / temperature)
        as the reference draws it (the same tokens from the same torch seed). Rows must be equal in length.

        transformers' own generate cannot serve: it calls forward at every length, and alpha-er computes
        only at multiples of mlp_experts.
        """
        if unsupported:
            raise TypeError(f"AlphaErForCausalLM.generate takes max_new_tokens, do_sample, temperature and top_k; "
                            f"not {sorted(unsupported)}")
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("AlphaErForCausalLM.generate takes rows of equal length (an attention_mask of ones)")
        if do_sample and temperature <= 0:
            raise ValueError(f"temperature={temperature} must be > 0 when sampling")
        block, pad = self.config.max_position_embeddings, self.config.pad_token_id or 0
        ids = input_ids
        for _ in range(max_new_tokens):
            window = ids[:, -block:]
            length = window.shape[1]
            padded = torch.cat([window, window.new_full((window.shape[0], block - length), pad)], dim=1)
            logits = self(padded).logits[:, length - 1]
            if not do_sample:
                next_ids = logits.argmax(-1)
            else:
                values, indices = torch.topk(logits, min(top_k or logits.shape[-1], logits.shape[-1]))
                probs = torch.softmax(values / temperature, dim=-1)
                next_ids = indices.gather(-1, torch.multinomial(probs, 1)).squeeze(-1)
            ids = torch.cat([ids, next_ids[:, None]], dim=1)
        return ids


# save_pretrained writes these two files beside the weights, and config.json's auto_map names them.
AlphaErConfig.register_for_auto_class()
AlphaErForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = ["AlphaErForCausalLM", "AlphaErModel", "AlphaErPreTrainedModel"]
