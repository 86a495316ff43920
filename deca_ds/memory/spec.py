"""The model an estimate is for: its config, the architecture built on the meta device (nothing
downloaded, nothing allocated) and the sizes the estimate reads, cut into blocks by the trainer's
own `partition_model`."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..blocks import Partition, block_layers, find_decoder_layers, partition_model


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def load_config(source, trust_remote_code: bool = False):
    """An HF config from a config.json path, a directory holding one, or a config object. A
    directory's own configuration code (its config's auto_map) runs only with `trust_remote_code`."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(source, PretrainedConfig):
        return source
    path = Path(source).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"model config {source!r}: no such file (give a config.json or a directory with one)")
    try:
        # a model directory's own code is found beside its config.json, so the directory is what is read
        return AutoConfig.from_pretrained(str(path.parent if path.name == "config.json" else path),
                                          trust_remote_code=trust_remote_code)
    except OSError as err:  # transformers' word for a file that is not JSON
        raise ValueError(f"model config {source!r}: {err}") from None


def meta_model(config, trust_remote_code: bool = False) -> nn.Module:
    """The causal LM of `config` with every parameter and buffer on the meta device (no memory); a
    model of its own code (its config's auto_map) only with `trust_remote_code`.

    accelerate's init_empty_weights() with include_buffers=False leaves tie_word_embeddings
    untied in transformers 5 (the LM head gets its own meta matrix, over-counting by V·h); with
    include_buffers=True the model is built as on a real device and ties as configured. The tie
    is checked below either way.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=True):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "tie_word_embeddings", False):
        model.tie_weights()
        head, embed = model.get_output_embeddings(), model.get_input_embeddings()
        if head is not None and head.weight is not embed.weight:
            raise RuntimeError(f"{type(model).__name__}: tie_word_embeddings is set but the LM head is not tied")
    return model


@dataclass
class ModelSpec:
    """One architecture: its meta model, exact parameter counts and the shapes activations need."""

    name: str
    config: Any
    model: nn.Module = field(repr=False)
    num_layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    total_params: int  # d: every parameter once (a tied embedding/LM head counted once)
    layer_params: tuple[int, ...]  # per decoder layer
    largest_param: int  # the largest tensor's elements (setup's transient copy)

    @classmethod
    def from_config(cls, source, name: str | None = None, trust_remote_code: bool = False) -> "ModelSpec":
        """The spec of a config (object, config.json or model directory; a model of its own code only
        with `trust_remote_code`), or `source` itself if it is one."""
        if isinstance(source, ModelSpec):
            return source
        config = load_config(source, trust_remote_code=trust_remote_code)
        if name is None:
            name = Path(str(source)).stem if not hasattr(source, "to_dict") else getattr(
                config, "name_or_path", "") or config.model_type
        model = meta_model(config, trust_remote_code=trust_remote_code)
        _, layers = find_decoder_layers(model)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        return cls(
            name=name, config=config, model=model, num_layers=len(layers),
            hidden=text.hidden_size, intermediate=text.intermediate_size, heads=heads,
            kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            vocab=text.vocab_size, tied=bool(getattr(text, "tie_word_embeddings", False)),
            total_params=sum(p.numel() for p in model.parameters()),
            layer_params=tuple(sum(p.numel() for p in layer.parameters()) for layer in layers),
            largest_param=max(p.numel() for p in model.parameters()),
        )

    @property
    def decoder_params(self) -> int:
        return sum(self.layer_params)

    @property
    def non_layer_params(self) -> int:
        """Embeddings, final norm and LM head (once if tied)."""
        return self.total_params - self.decoder_params

    @cached_property
    def _partitions(self) -> dict[tuple, Partition]:
        return {}

    @cached_property
    def _layers(self) -> dict[Partition, list[tuple[int, list[int]]]]:
        return {}

    def partition(self, layers_per_block: int, **trains: bool) -> Partition:
        """The trainer's partition: the decoder layers, and the embeddings, final norm and LM head
        as blocks of their own where `trains` (partition_model's train_* flags) asks for them."""
        key = (layers_per_block, *sorted(trains.items()))
        if key not in self._partitions:
            self._partitions[key] = partition_model(self.model, layers_per_block, **trains)
        return self._partitions[key]

    def block_layers(self, partition: Partition, block: int) -> tuple[int, int]:
        """(the entry layer, how many decoder layers it holds) of a block (deca_ds.blocks.block_layers)."""
        if partition not in self._layers:
            self._layers[partition] = block_layers(self.model, partition)
        entry, held = self._layers[partition][block]
        return entry, len(held)

    def tensor_numels(self, partition: Partition, block: int) -> list[int]:
        return [self.model.get_parameter(n).numel() for n in partition.blocks[block].param_names]
