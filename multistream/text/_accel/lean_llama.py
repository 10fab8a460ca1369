"""The embedded model as a Llama of our own: the same modules, without transformers' modeling code.

Importing transformers' ``modeling_llama`` takes about 2 s on a 2-core machine (its modeling
utilities import torch's distributed tensors, ``torch._dynamo``, accelerate and more): half of the
``multistream text`` command's time to its first token. None of it serves the embedded model on a
CPU, whose every decoder layer runs in C (`multistream.text._accel.native_layers`).

`LeanLlamaForCausalLM` holds the modules of transformers' ``LlamaForCausalLM`` under the same names
(``model.embed_tokens``, ``model.layers[i].self_attn.q_proj`` ... ``model.norm``,
``model.rotary_emb``, ``lm_head``) and loads the same ``model.safetensors``, so quantization,
the native layers and the engine's decode step (`FastDecode`) treat it as they treat transformers'
model. Its forward is transformers' for what the native layers compute (a batch without padding, or
the engine's padded batches with ``row_starts``): the embedding, each decoder layer, the final norm
and the LM head, in that order, on the same modules, so its logits are bit for bit those of
``LlamaForCausalLM`` with the same layers (``tests/text/test_lean_llama.py``).

Anything else (``generate``, a padded batch without ``row_starts``, another dtype or device) goes to a
transformers ``LlamaForCausalLM`` built at first use around the same weights (`as_transformers`):
it pays the import then, and computes what transformers computes.

`load_text_model()` uses it for the embedded model when the native layers serve it (a CPU with a C
compiler, ``quantize="auto"``, ``"int4"`` or ``"int8"``); otherwise it loads transformers' model.

Example:
    >>> model = LeanLlamaForCausalLM.from_folder(folder)          # doctest: +SKIP
    >>> model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape    # doctest: +SKIP
    torch.Size([1, 3, 49152])
"""

from __future__ import annotations

import inspect
import json
import os
import threading
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._kv_cache import KVCache

__all__ = ["LeanLlamaConfig", "LeanLlamaForCausalLM", "LeanRMSNorm", "lean_llama_problem"]

_WEIGHTS = "model.safetensors"


class LeanLlamaConfig:
    """A Llama ``config.json`` as attributes (what transformers' ``LlamaConfig`` holds for the
    fields the model reads); `to_dict` gives them back, e.g. to build ``LlamaConfig``.

    Example:
        >>> LeanLlamaConfig({"model_type": "llama", "hidden_size": 8}).hidden_size
        8
    """

    def __init__(self, fields: dict[str, Any], name_or_path: str = "") -> None:
        self._fields = dict(fields)
        for key, value in fields.items():
            setattr(self, key, value)
        self.__dict__.setdefault("sliding_window", None)
        self.__dict__.setdefault("head_dim", None)
        self._name_or_path = name_or_path
        # The engine's attention (`row_attention`): the forward takes the engine's ``row_starts``.
        from .row_attention import ROW_ATTENTION

        self._attn_implementation = ROW_ATTENTION

    def get_text_config(self) -> LeanLlamaConfig:
        return self

    def to_dict(self) -> dict[str, Any]:
        """The fields as ``config.json`` had them, with any later change (``tie_word_embeddings``)."""
        return {key: getattr(self, key) for key in self._fields}

    def rotary_base(self) -> float:
        """The rotary embedding's base (``rope_parameters["rope_theta"]``, or ``rope_theta`` in older files)."""
        return float((self._fields.get("rope_parameters") or {}).get("rope_theta", self._fields.get("rope_theta", 1e4)))


def lean_llama_problem(folder: Path) -> str | None:
    """Why `LeanLlamaForCausalLM` cannot hold the model in ``folder`` (None if it can): a Llama whose
    layers the native kernels compute (`native_layers`), in one safetensors file.

    Example:
        >>> lean_llama_problem(Path("/no/such/folder"))
        'no config.json'
    """
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return "no config.json"
    if not (folder / _WEIGHTS).is_file():
        return f"no {_WEIGHTS}"
    rope = config.get("rope_parameters") or {"rope_type": (config.get("rope_scaling") or {}).get("rope_type", "default")}
    checks = {
        "not a Llama": config.get("model_type") == "llama",
        "a rotary embedding other than the default": rope.get("rope_type", "default") == "default",
        "biases": not config.get("attention_bias") and not config.get("mlp_bias"),
        "an activation other than SiLU": config.get("hidden_act") == "silu",
    }
    failed = [what for what, ok in checks.items() if not ok]
    return ", ".join(failed) or None


def _empty_linear(in_features: int, out_features: int) -> nn.Linear:
    """An ``nn.Linear`` without a bias whose weight is an empty meta tensor, for
    ``load_state_dict(assign=True)`` to fill: nn.Linear's own init draws random values for every
    weight (on the meta device it imports ``torch._dynamo``, another 0.9 s)."""
    layer = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(layer)
    layer.in_features, layer.out_features = in_features, out_features
    layer.weight = nn.Parameter(torch.empty(out_features, in_features, device="meta"))
    layer.register_parameter("bias", None)
    return layer


class LeanRMSNorm(nn.Module):
    """transformers' ``LlamaRMSNorm``, op for op."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, device="meta"))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class LeanRotaryEmbedding(nn.Module):
    """transformers' ``LlamaRotaryEmbedding`` for the default rotary type, op for op: ``(cos, sin)``
    ``[rows, positions, head_dim]`` of ``position_ids`` (`native_layers.RotaryTable` reads it)."""

    def __init__(self, config: LeanLlamaConfig) -> None:
        super().__init__()
        dim = config.head_dim or config.hidden_size // config.num_attention_heads
        self.rope_type = "default"
        self.attention_scaling = 1.0
        inv_freq = 1.0 / (config.rotary_base() ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class LeanAttention(nn.Module):
    def __init__(self, config: LeanLlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        self.q_proj = _empty_linear(config.hidden_size, config.num_attention_heads * self.head_dim)
        self.k_proj = _empty_linear(config.hidden_size, config.num_key_value_heads * self.head_dim)
        self.v_proj = _empty_linear(config.hidden_size, config.num_key_value_heads * self.head_dim)
        self.o_proj = _empty_linear(config.num_attention_heads * self.head_dim, config.hidden_size)


class LeanMLP(nn.Module):
    def __init__(self, config: LeanLlamaConfig) -> None:
        super().__init__()
        self.gate_proj = _empty_linear(config.hidden_size, config.intermediate_size)
        self.up_proj = _empty_linear(config.hidden_size, config.intermediate_size)
        self.down_proj = _empty_linear(config.intermediate_size, config.hidden_size)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LeanDecoderLayer(nn.Module):
    """A Llama decoder layer's modules; it computes only through its native path (`native_layers`),
    which `attach_native_layers` gives it. The model sends every other forward to transformers."""

    def __init__(self, config: LeanLlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LeanAttention(config, layer_idx)
        self.mlp = LeanMLP(config)
        self.input_layernorm = LeanRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = LeanRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError(
            "this decoder layer of the embedded model computes through the native kernels only (fp32 on a CPU, "
            "no padding without row_starts); LeanLlamaForCausalLM.forward sends other inputs to as_transformers()")


class LeanLlamaModel(nn.Module):
    def __init__(self, config: LeanLlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, getattr(config, "pad_token_id", None),
                                         _weight=torch.empty(config.vocab_size, config.hidden_size, device="meta"))
        self.layers = nn.ModuleList(LeanDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = LeanRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = LeanRotaryEmbedding(config)


_OUTPUT: type | None = None


def _causal_lm_output() -> type:
    """A ``ModelOutput`` with the fields of transformers' ``CausalLMOutputWithPast`` (``logits``,
    ``cache``; ``loss``, ``hidden_states`` and ``attentions`` None): ``transformers.modeling_outputs``
    costs 0.13 s of imports at the first request. Made at first use, as ``LeanCausalLMOutput`` of
    this module (pickle finds it through `__getattr__`)."""
    global _OUTPUT
    if _OUTPUT is None:
        from dataclasses import dataclass

        from transformers.utils.generic import ModelOutput

        @dataclass
        class LeanCausalLMOutput(ModelOutput):
            loss: torch.Tensor | None = None
            logits: torch.Tensor | None = None
            cache: Any = None
            hidden_states: Any = None
            attentions: Any = None

        LeanCausalLMOutput.__qualname__ = "LeanCausalLMOutput"
        _OUTPUT = LeanCausalLMOutput
    return _OUTPUT


def __getattr__(name: str) -> Any:
    if name == "LeanCausalLMOutput":
        return _causal_lm_output()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class GenerationValues:
    """``generation_config.json``'s values as attributes, None where unset (transformers' 5.x
    ``GenerationConfig`` leaves the sampling fields None too): what `SamplingPlan.resolve` and the
    end-of-sequence ids read.

    Example:
        >>> GenerationValues({"eos_token_id": 2}).eos_token_id, GenerationValues({}).top_k
        (2, None)
    """

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = dict(values)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "values":  # copy and pickle probe before values is set
            raise AttributeError(name)
        return self.values.get(name)


class LeanLlamaForCausalLM(nn.Module):
    """The embedded Llama without transformers' modeling modules (see the module docstring).

    Example:
        >>> model = LeanLlamaForCausalLM.from_folder(folder)                 # doctest: +SKIP
        >>> model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4)      # doctest: +SKIP
    """

    def __init__(self, config: LeanLlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LeanLlamaModel(config)
        self.lm_head = _empty_linear(config.hidden_size, config.vocab_size)
        self._generation: Any = None
        self.name_or_path = config._name_or_path
        self._twin: Any = None
        self._twin_lock = threading.Lock()

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str]) -> LeanLlamaForCausalLM:
        """The model in ``folder`` (``config.json``, ``model.safetensors``, ``generation_config.json``),
        fp32 on the CPU; `lean_llama_problem` says whether it can hold it."""
        from safetensors.torch import load_file

        folder = Path(folder)
        problem = lean_llama_problem(folder)
        if problem is not None:
            raise ValueError(f"{folder} is not a model LeanLlamaForCausalLM holds: {problem}")
        config = LeanLlamaConfig(json.loads((folder / "config.json").read_text()), str(folder))
        model = cls(config)  # weights: empty meta tensors until the file's are assigned
        state = load_file(folder / _WEIGHTS)
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        expected_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
        if set(missing) != expected_missing or unexpected:
            raise ValueError(f"{folder / _WEIGHTS} does not fit the config: missing {missing}, unexpected {unexpected}")
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        generation = folder / "generation_config.json"
        values = json.loads(generation.read_text()) if generation.is_file() else \
            {k: v for k, v in config.to_dict().items() if k.endswith("token_id")}
        model._generation = GenerationValues(values)
        return model.eval()

    @property
    def generation_config(self) -> Any:
        """transformers' ``GenerationConfig`` of the model, built at the first read (it imports
        transformers); the engine reads `generation_settings` instead."""
        if isinstance(self._generation, GenerationValues):
            from transformers.generation.configuration_utils import GenerationConfig

            self._generation = GenerationConfig.from_dict(dict(self._generation.values))
        return self._generation

    @generation_config.setter
    def generation_config(self, value: Any) -> None:
        self._generation = value

    @property
    def generation_settings(self) -> Any:
        """``generation_config``'s values as attributes (None where unset), without transformers
        (`multistream.text._sampling.generation_settings`): the ``GenerationConfig`` itself once
        built or set, so its changes count."""
        return self._generation

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        row_starts: list[int] | None = None,
        **kwargs: Any,
    ) -> Any:
        """transformers' ``LlamaForCausalLM.forward`` on the native layers: ``.logits`` and ``.cache``
        (``out["cache"]``). ``row_starts``: the engine's padded batches (each row's first column).
        ``return_dict=False``: the tuple ``(logits, cache)``, made without importing transformers
        when a cache is given (the engine gives a `KVCache` from `new_cache`)."""
        if "past_key_values" in kwargs:  # its name before transformers 5.40, which callers still use
            cache = kwargs.pop("past_key_values")
        if not self._native_takes(input_ids, inputs_embeds, attention_mask, cache, logits_to_keep, row_starts,
                                  kwargs):
            return self._twin_forward(cache, input_ids=input_ids, attention_mask=attention_mask,
                                      position_ids=position_ids, inputs_embeds=inputs_embeds, use_cache=use_cache,
                                      logits_to_keep=logits_to_keep,
                                      **({"row_starts": row_starts} if row_starts is not None else {}), **kwargs)
        hidden = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if use_cache is None:
            use_cache = bool(getattr(self.config, "use_cache", True))
        if use_cache and cache is None:
            from transformers.cache_utils import DynamicCache

            cache = DynamicCache()
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(hidden.shape[1], device=hidden.device) + past).unsqueeze(0)
        for layer in self.model.layers:
            hidden = layer(hidden, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                           use_cache=use_cache, row_starts=row_starts)
        hidden = self.model.norm(hidden)
        if isinstance(logits_to_keep, int):
            hidden = hidden[:, -logits_to_keep:, :] if logits_to_keep else hidden
        else:  # a 0-d or 1-d tensor of positions (`_native_takes`), as transformers' slice_logits_to_keep
            hidden = hidden[:, logits_to_keep, :]
        logits = self.lm_head(hidden)
        if kwargs.get("return_dict") is False:  # ModelOutput.to_tuple: the fields that are not None
            return (logits,) if cache is None else (logits, cache)
        return _causal_lm_output()(logits=logits, cache=cache)

    def new_cache(self) -> KVCache:
        """An empty cache for the engine: transformers' ``DynamicCache`` layout without its import
        (`multistream.text._kv_cache`)."""
        return KVCache()

    def _twin_forward(self, cache: Any, **kwargs: Any) -> Any:
        """The inputs the native layers do not take, on `as_transformers`. A `KVCache` goes in as a
        ``DynamicCache`` and takes its new columns back (the engine grows a cache in place)."""
        twin = self.as_transformers()
        cache_arg = "cache" if "cache" in inspect.signature(twin.forward).parameters else "past_key_values"
        given = cache
        if isinstance(given, KVCache):
            cache = given.as_dynamic()
        out = twin(**kwargs, **{cache_arg: cache})
        if isinstance(given, KVCache):
            given.take(cache)
            if isinstance(out, tuple):
                out = tuple(given if item is cache else item for item in out)
            elif out.get(cache_arg) is cache:
                out[cache_arg] = given
        return out

    def _native_takes(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None,
                      attention_mask: torch.Tensor | None, cache: Any, logits_to_keep: int | torch.Tensor,
                      row_starts: list[int] | None, extra: dict[str, Any]) -> bool:
        """True if every decoder layer computes these inputs on its native path and this forward
        reads the rest as transformers' does; else the twin takes them."""
        from .native_layers import native_layer

        if (input_ids is None) == (inputs_embeds is None) or extra.get("output_attentions") \
                or extra.get("output_hidden_states") or extra.get("labels") is not None:
            return False
        if not isinstance(logits_to_keep, int) and (logits_to_keep.dim() > 1 or logits_to_keep.dtype == torch.bool):
            return False
        if not all(native_layer(layer) is not None for layer in self.model.layers):
            return False
        if self.dtype != torch.float32 or self.device.type != "cpu":
            return False
        if inputs_embeds is not None and (inputs_embeds.dtype != torch.float32 or inputs_embeds.device.type != "cpu"):
            return False
        if attention_mask is None:
            return True
        rows, count = (input_ids if input_ids is not None else inputs_embeds).shape[:2]  # type: ignore[union-attr]
        past = int(cache.get_seq_length()) if cache is not None else 0
        # A 2-d mask over every column (the cached ones and these): transformers masks any it lacks.
        if attention_mask.dim() != 2 or attention_mask.shape[-1] != past + count:
            return False
        return bool(attention_mask.all()) or (row_starts is not None and len(row_starts) == rows)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' ``generate``, on `as_transformers` (the same weights and native layers)."""
        return self.as_transformers().generate(*args, **kwargs)

    def as_transformers(self) -> Any:
        """A transformers ``LlamaForCausalLM`` around this model's weights: the same embedding, LM
        head, projection layers (quantized ones included) and norm weights, native layers attached
        as `load_text_model` attaches them. Built once, at the first call (it imports transformers'
        modeling code, about 2 s)."""
        with self._twin_lock:
            if self._twin is None:
                # Not a submodule (nn.Module's setattr would register it): state_dict() and modules()
                # stay this model's own.
                object.__setattr__(self, "_twin", self._build_twin())
            return self._twin

    def _build_twin(self) -> Any:
        from transformers import LlamaConfig, LlamaForCausalLM

        from .native_layers import attach_native_layers, native_layer
        from .row_attention import use_row_attention

        config = LlamaConfig(**self.config.to_dict())
        config._name_or_path = self.config._name_or_path
        with torch.device("meta"):
            twin = LlamaForCausalLM(config)
        ours = dict(self.named_modules())
        for path, module in list(twin.named_modules()):
            if not path:
                continue
            own = ours.get(path)
            if own is None:
                continue
            parent_path, _, name = path.rpartition(".")
            parent = twin.get_submodule(parent_path) if parent_path else twin
            if isinstance(own, LeanRMSNorm):
                module.weight = own.weight
                module.variance_epsilon = own.variance_epsilon
            elif isinstance(own, LeanRotaryEmbedding):
                module.inv_freq = own.inv_freq
                module.original_inv_freq = own.inv_freq.clone()
            elif not list(own.children()) and not isinstance(own, nn.SiLU):
                setattr(parent, name, own)  # embedding, LM head, projections: the same objects
        for path, module in self.named_modules():  # the fused projections quantization added
            for fused in ("qkv_fused", "gate_up_fused"):
                if isinstance(getattr(module, fused, None), nn.Module):
                    setattr(twin.get_submodule(path), fused, getattr(module, fused))
        twin.config.tie_word_embeddings = bool(getattr(self.config, "tie_word_embeddings", False))
        left = [name for name, t in [*twin.named_parameters(), *twin.named_buffers()] if t.is_meta]
        if left:
            raise RuntimeError(f"the transformers twin of the embedded model lacks {left[:3]}")
        twin.generation_config = self.generation_config
        twin.eval()
        if any(native_layer(layer) is not None for layer in self.model.layers):
            attach_native_layers(twin)
            use_row_attention(twin)
        return twin
