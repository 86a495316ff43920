"""Dec-Adapter: Houlsby bottleneck adapters after each decoder layer's attention and MLP, on a frozen
base, trained with local Adam and mixed with W (adapter parameters only).

Each adapter maps h ↦ h + U·σ(D·h + d) + u with D: hidden → size, U: size → hidden and U, u = 0 at
the start, so the adapted model starts as the base model (Houlsby et al., 2019). Adapters are
submodules of the attention/MLP modules they follow (`…self_attn.adapter.down.weight`), applied by a
forward hook, so the base model's parameter names do not change.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..blocks import find_decoder_layers
from .adam import AdamConfig, AdamMethod
from .base import seeded

ATTENTION = ("self_attn", "attn", "attention")  # where an attention module may sit in a decoder layer
_MLP = ("mlp",)
_CONFIG = "adapter_config.json"
_WEIGHTS = "adapter_model.safetensors"
ADAPTER_TYPE = "houlsby_bottleneck"


class Bottleneck(nn.Module):
    def __init__(self, hidden: int, size: int, init_std: float = 1e-3) -> None:
        super().__init__()
        self.down = nn.Linear(hidden, size)
        self.up = nn.Linear(size, hidden)
        nn.init.normal_(self.down.weight, std=init_std)
        nn.init.zeros_(self.down.bias)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.up(nn.functional.gelu(self.down(h)))


def _apply_adapter(module: nn.Module, args, output):
    if isinstance(output, tuple):  # attention returns (hidden states, attention weights, …)
        return (module.adapter(output[0]), *output[1:])
    return module.adapter(output)


def _targets(model: nn.Module) -> list[nn.Module]:
    modules = []
    for i, layer in enumerate(find_decoder_layers(model)[1]):
        for names in (ATTENTION, _MLP):
            found = next((getattr(layer, n) for n in names if hasattr(layer, n)), None)
            if found is None:
                raise ValueError(f"decoder layer {i} ({type(layer).__name__}) has none of {names}: "
                                 "Dec-Adapter does not know where to insert its adapters")
            modules.append(found)
    return modules


def add_adapters(model: nn.Module, size: int, seed: int = 0) -> nn.Module:
    """Insert bottleneck adapters of width `size` in place, identical for the same seed."""
    hidden = model.config.hidden_size
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    with seeded(seed):
        for module in _targets(model):
            module.adapter = Bottleneck(hidden, size).to(device=device, dtype=dtype)
            module.register_forward_hook(_apply_adapter)
    return model


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if ".adapter." in n}


def save_adapters(model: nn.Module, directory: Path, size: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(adapter_state(model), directory / _WEIGHTS, metadata={"format": "pt"})
    (directory / _CONFIG).write_text(json.dumps({"adapter_type": ADAPTER_TYPE, "size": size,
                                                 "positions": ["attention", "mlp"]}, indent=2, allow_nan=False))


def load_adapters(model: nn.Module, directory: str | Path) -> nn.Module:
    """A base model plus the adapters saved by a Dec-Adapter run (the `adapter/` folder of its
    export)."""
    directory = Path(directory)
    config = json.loads((directory / _CONFIG).read_text())
    add_adapters(model, config["size"])
    weights = load_file(directory / _WEIGHTS)
    mismatch = set(adapter_state(model)) ^ set(weights)
    if mismatch:
        raise ValueError(f"adapter weights in {directory} do not fit the model: {sorted(mismatch)[:5]}")
    model.load_state_dict(weights, strict=False)
    return model


def saved_adapters(directory: str | Path) -> Path | None:
    """The Dec-Adapter adapters a model directory carries (its adapter/ folder), if any. peft's
    adapter folder beside a merged LoRA model is not one: that model is complete."""
    folder = Path(directory) / "adapter"
    try:
        return folder if json.loads((folder / _CONFIG).read_text()).get("adapter_type") == ADAPTER_TYPE else None
    except (OSError, ValueError):
        return None


class DecAdapter(AdamMethod):
    name = "dec_adapter"

    def __init__(self, config: AdamConfig, *, size: int = 64, seed: int = 0) -> None:
        if size < 1:
            raise ValueError(f"adapter size must be >= 1, got {size}")
        self.config, self.size, self.seed = config, size, seed

    def prepare(self, model: nn.Module) -> nn.Module:
        return add_adapters(model, self.size, self.seed)

    def trainable(self, model: nn.Module) -> list[nn.Parameter]:
        return [p for n, p in model.named_parameters() if ".adapter." in n]

    def plain_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The frozen base; its adapters go to adapter/ (save_extras)."""
        return {n: p for n, p in model.state_dict().items() if ".adapter." not in n}

    def save_extras(self, model: nn.Module, directory: Path) -> None:
        save_adapters(model, directory / "adapter", self.size)

    def save_consensus(self, model: nn.Module, directory: Path, tokenizer) -> nn.Module:
        """The frozen base (loadable by from_pretrained) and, in its adapter/ folder, the consensus
        adapters (`load_adapters` puts them back; deca-eval does so itself). A bottleneck adapter is
        non-linear, so unlike LoRA it cannot be merged into the base weights, and peft has no
        format for it."""
        model.save_pretrained(directory, state_dict=self.plain_state(model), safe_serialization=True)
        tokenizer.save_pretrained(directory)
        self.save_extras(model, directory)
        return model
