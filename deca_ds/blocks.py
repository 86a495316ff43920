"""Cutting a causal LM's trainable space into the blocks that DECA visits one at a time.

By default the trainable space is the decoder layers, `layers_per_block` consecutive layers
per block; embeddings, final norm and LM head stay frozen unless asked for, each as a block
of its own. `custom=` block specs replace all of that for architectures (or experiments) the
automatic cut does not fit.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

BLOCK_ORDERS = ("ascending", "descending", "random")
# What trains beside the decoder layers where asked, each as a block of its own: partition_model's
# train_<part> flags, in the order their blocks take around the layers' (embeddings first).
EXTRA_PARTS = ("embeddings", "final_norm", "lm_head")

_CUSTOM_EXAMPLE = 'custom=["model.layers.0", "model.layers.1"]'


@dataclass(frozen=True)
class Block:
    index: int  # position in Partition.blocks
    name: str  # "layers[0:2]" (half-open), "embeddings", "final_norm", "lm_head" or "custom[3]"
    param_names: tuple[str, ...]  # as in model.named_parameters(), in model order
    numel: int  # total elements over the block's tensors


@dataclass(frozen=True)
class Partition:
    blocks: tuple[Block, ...]
    frozen: tuple[str, ...]  # parameter names in no block: never trained
    frozen_numel: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def params(self, model: nn.Module, block_index: int) -> list[nn.Parameter]:
        # Looked up by name rather than cached, so the same partition serves deep copies of the model.
        return [model.get_parameter(name) for name in self.blocks[block_index].param_names]

    def describe(self) -> str:
        rows = [(str(b.index), b.name, len(b.param_names), b.numel) for b in self.blocks]
        rows.append(("-", "frozen", len(self.frozen), self.frozen_numel))
        name_width = max(len("name"), *(len(r[1]) for r in rows))
        lines = [f"{'block':>5}  {'name':<{name_width}}  {'#tensors':>8}  {'#params':>14}"]
        lines += [f"{i:>5}  {n:<{name_width}}  {t:>8}  {p:>14,}" for i, n, t, p in rows]
        return "\n".join(lines)


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's decoder-layer list: the one nn.ModuleList as long as config.num_hidden_layers."""
    cls = type(model).__name__
    num_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if num_layers is None:
        reason = "it has no config.num_hidden_layers"
    else:
        # named_modules() yields each module once, so a shared list cannot count twice.
        candidates = [
            (name, module)
            for name, module in model.named_modules()
            if isinstance(module, nn.ModuleList) and len(module) == num_layers
        ]
        if len(candidates) == 1:
            return candidates[0]
        found = ", ".join(repr(name) for name, _ in candidates) or "none"
        reason = f"expected exactly one nn.ModuleList of length {num_layers}, found {found}"
    raise ValueError(
        f"Could not find the decoder layers for this architecture ({cls}): {reason}. "
        f"Pass the blocks yourself as module-path prefixes, e.g. {_CUSTOM_EXAMPLE}."
    )


def partition_model(
    model: nn.Module,
    layers_per_block: int = 2,
    *,
    train_embeddings: bool = False,
    train_final_norm: bool = False,
    train_lm_head: bool = False,
    custom: Sequence[str | Sequence[str]] | None = None,
) -> Partition:
    """Cut the model's parameters into blocks (see the module docstring).

    With `custom` given, `layers_per_block` and the `train_*` flags are ignored: each spec is one
    block, and every parameter no spec matches is frozen. A spec is a string or a list of strings
    (their union); "re:<regex>" is matched with re.fullmatch against the full parameter name, any
    other string is a module-path prefix matched component-wise ("model.layers.1" catches
    model.layers.1.* but not model.layers.10.*).
    """
    named = list(model.named_parameters())
    if custom is not None:
        groups = _custom_groups(named, custom)
    else:
        groups = _layer_groups(model, named, layers_per_block, train_embeddings, train_final_norm, train_lm_head)

    sizes = {name: p.numel() for name, p in named}
    blocks = tuple(
        Block(index=i, name=name, param_names=tuple(names), numel=sum(sizes[n] for n in names))
        for i, (name, names) in enumerate(groups)
    )
    in_block = {n for b in blocks for n in b.param_names}
    frozen = tuple(n for n, _ in named if n not in in_block)
    return Partition(blocks=blocks, frozen=frozen, frozen_numel=sum(sizes[n] for n in frozen))


def block_layers(model: nn.Module, partition: Partition) -> list[tuple[int, list[int]]]:
    """For each block, (its entry layer, the decoder layers it holds params of): the entry layer is
    the lowest it holds, and for a block of none where it sits in the model: 0 for one that holds
    the input embeddings (every layer is above it, backward runs through them all), else the number
    of layers (the final norm, the LM head: every layer is below it, frozen)."""
    _, layers = find_decoder_layers(model)
    layer_of = {id(p): k for k, layer in enumerate(layers) for p in layer.parameters()}
    embedding = getattr(model, "get_input_embeddings", lambda: None)()
    embedding_ids = {id(p) for p in embedding.parameters()} if embedding is not None else set()
    spans = []
    for b in range(partition.num_blocks):
        params = partition.params(model, b)
        held = sorted({layer_of[id(p)] for p in params if id(p) in layer_of})
        entry = held[0] if held else 0 if any(id(p) in embedding_ids for p in params) else len(layers)
        spans.append((entry, held))
    return spans


def _layer_groups(
    model: nn.Module,
    named: list[tuple[str, nn.Parameter]],
    layers_per_block: int,
    train_embeddings: bool,
    train_final_norm: bool,
    train_lm_head: bool,
) -> list[tuple[str, list[str]]]:
    _, layers = find_decoder_layers(model)
    num_layers = len(layers)
    if not 1 <= layers_per_block <= num_layers:
        raise ValueError(
            f"layers_per_block must be between 1 and the number of decoder layers ({num_layers}), "
            f"got {layers_per_block}"
        )

    # By identity, so the result does not depend on how the model spells its module paths.
    layer_of = {id(p): i for i, layer in enumerate(layers) for p in layer.parameters()}
    head_ids = _untied_head_param_ids(model)

    num_blocks = math.ceil(num_layers / layers_per_block)
    layer_blocks: list[list[str]] = [[] for _ in range(num_blocks)]
    embeddings: list[str] = []
    final_norm: list[str] = []
    lm_head: list[str] = []
    seen_layer = False
    for name, p in named:
        if id(p) in layer_of:
            layer_blocks[layer_of[id(p)] // layers_per_block].append(name)
            seen_layer = True
        elif id(p) in head_ids:
            lm_head.append(name)
        elif not seen_layer:
            embeddings.append(name)
        else:
            final_norm.append(name)

    if train_lm_head and not head_ids:
        if _head_is_tied(model):
            raise ValueError(
                "train_lm_head=True, but the LM head is tied to the input embeddings and has no "
                "parameters of its own; use train_embeddings=True to train the shared matrix"
            )
        raise ValueError(f"train_lm_head=True, but {type(model).__name__} has no LM head parameters")
    for flag, group, label in (
        (train_embeddings, embeddings, "embeddings"),
        (train_final_norm, final_norm, "final_norm"),
    ):
        if flag and not group:
            raise ValueError(f"train_{label}=True, but {type(model).__name__} has no {label} parameters")

    groups: list[tuple[str, list[str]]] = []
    if train_embeddings:
        groups.append(("embeddings", embeddings))
    for k, names in enumerate(layer_blocks):
        groups.append((f"layers[{k * layers_per_block}:{min((k + 1) * layers_per_block, num_layers)}]", names))
    if train_final_norm:
        groups.append(("final_norm", final_norm))
    if train_lm_head:
        groups.append(("lm_head", lm_head))
    return groups


def _output_embeddings(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def _head_is_tied(model: nn.Module) -> bool:
    head = _output_embeddings(model)
    get_input = getattr(model, "get_input_embeddings", None)
    embed = get_input() if callable(get_input) else None
    return (
        head is not None
        and embed is not None
        and getattr(head, "weight", None) is not None
        and head.weight is getattr(embed, "weight", None)
    )


def _untied_head_param_ids(model: nn.Module) -> set[int]:
    head = _output_embeddings(model)
    if head is None or _head_is_tied(model):
        return set()
    return {id(p) for p in head.parameters()}


def _custom_groups(
    named: list[tuple[str, nn.Parameter]], custom: Sequence[str | Sequence[str]]
) -> list[tuple[str, list[str]]]:
    if isinstance(custom, str):
        raise TypeError(f"custom must be a list of block specs, got the string {custom!r}; wrap it in a list")
    if not custom:
        raise ValueError(f"custom is empty; give at least one block spec, e.g. {_CUSTOM_EXAMPLE}")

    owner: dict[str, int] = {}  # parameter name -> index of the spec that claimed it
    groups: list[tuple[str, list[str]]] = []
    for k, spec in enumerate(custom):
        patterns = [spec] if isinstance(spec, str) else list(spec)
        if not patterns:
            raise ValueError(f"custom[{k}] is an empty list of patterns")
        names: set[str] = set()
        for pattern in patterns:
            matched = {name for name, _ in named if _matches(pattern, name)}
            if not matched:
                raise ValueError(f"custom[{k}] pattern {pattern!r} matches no parameter")
            names |= matched
        for name in names:
            if name in owner:
                raise ValueError(
                    f"parameter {name!r} is matched by two custom block specs: "
                    f"custom[{owner[name]}] = {custom[owner[name]]!r} and custom[{k}] = {spec!r}"
                )
            owner[name] = k
        groups.append((f"custom[{k}]", [n for n, _ in named if n in names]))
    return groups


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        try:
            return re.fullmatch(pattern[3:], name) is not None
        except re.error as e:
            raise ValueError(f"invalid regular expression in custom spec {pattern!r}: {e}") from e
    prefix = pattern[:-1] if pattern.endswith(".") else pattern
    return name == prefix or name.startswith(prefix + ".")


def block_order(num_blocks: int, order: str = "ascending", round_index: int = 0, seed: int = 0) -> list[int]:
    """The order in which one round visits the blocks.

    "random" draws a fresh permutation per round from (seed, round_index) alone, so every client
    using the same seed visits the blocks in the same order without communicating.
    """
    if order == "ascending":
        return list(range(num_blocks))
    if order == "descending":
        return list(range(num_blocks - 1, -1, -1))
    if order == "random":
        generator = torch.Generator().manual_seed(seed * 1_000_003 + round_index)
        return torch.randperm(num_blocks, generator=generator).tolist()
    raise ValueError(f"unknown block order {order!r}; valid orders: {', '.join(BLOCK_ORDERS)}")
