"""Loading the model and tokenizer: a local checkpoint, a hub id, a bare config, or the built-in tiny Llama."""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers import initialization as init

from .blocks import find_decoder_layers

# Small enough for CPU demos and tests. initializer_range is raised from Llama's 0.02 because the
# demo keeps the random embeddings and LM head frozen: with rows of std 0.02 the head caps every
# logit near ±1, so the loss could not fall much below ln(vocab) however well the layers learn.
TINY_LLAMA = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
    initializer_range=0.1,
)

# Config keys of transformers models that transform the LM head's output before it becomes the
# logits (Gemma 2/3's soft-capping, Cohere's scale): loss_chunk would skip that.
RESCALED_LOGITS = ("final_logit_softcapping", "logit_scale")


def tiny_config(vocab_size: int, **overrides) -> LlamaConfig:
    """The config of TINY_LLAMA's shape (updated by `overrides`) for a tokenizer of `vocab_size`."""
    return LlamaConfig(**{**TINY_LLAMA, **overrides, "vocab_size": vocab_size})


def tiny_llama(vocab_size: int, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> PreTrainedModel:
    """A randomly initialised Llama of TINY_LLAMA's shape (updated by `overrides`), the same for the same seed.

    The global RNG is left as it was, so building a model does not shift anyone else's random stream.
    """
    return _from_config(tiny_config(vocab_size, **overrides), dtype=dtype, seed=seed, attn_implementation="eager")


def load_model(
    name_or_path: str,
    *,
    dtype: torch.dtype,
    trust_remote_code: bool = False,
    from_config: bool = False,
    vocab_size: int | None = None,
    seed: int = 0,
    init_device: torch.device | str = "cpu",
    host_memory: bool = False,
    attention: str | None = None,
) -> PreTrainedModel:
    """The causal LM named by `name_or_path`.

    "tiny": `tiny_llama(vocab_size, seed)`. A local directory or hub id: its pretrained weights,
    or with `from_config=True` a random initialisation (from `seed`) of its architecture, which
    needs only a config.json (a directory holding one, or the file itself) - enough for
    measuring memory and speed without downloading weights: `draw_from_config` on `init_device`
    (the same seed gives different weights on different devices), the model left there or, with
    `host_memory=True`, in host memory (each module drawn on the device in turn). `vocab_size`
    is used by "tiny" only; a checkpoint or config fixes its own vocabulary. `attention`: a
    checkpoint's attn_implementation (None: transformers' default; "tiny" computes eager).
    """
    if name_or_path == "tiny":
        if vocab_size is None:
            raise ValueError("load_model('tiny') needs vocab_size (the tokenizer's length)")
        return tiny_llama(vocab_size, seed=seed, dtype=dtype)
    _check_local(name_or_path, "model")
    try:
        if from_config:
            config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
            with torch.device("cpu" if host_memory else init_device):
                return draw_from_config(config, dtype=dtype, seed=seed, device=init_device,
                                        trust_remote_code=trust_remote_code)
        return AutoModelForCausalLM.from_pretrained(
            name_or_path, dtype=dtype, trust_remote_code=trust_remote_code,
            use_safetensors=_has_safetensors(name_or_path), attn_implementation=attention,
        )
    except (OSError, ValueError) as e:  # transformers raises either, depending on what is missing
        raise ValueError(f"could not load model {name_or_path!r}. {_ALTERNATIVES}\n{e}") from e


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """AutoTokenizer for `name_or_path`, with pad = eos where it has no pad token (e.g. Llama, GPT-2)."""
    _check_local(name_or_path, "tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load tokenizer {name_or_path!r}. {_ALTERNATIVES}\n{e}") from e
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


_ALTERNATIVES = (
    "Use the model 'tiny' (the built-in tiny Llama, with the synthetic task's word tokenizer) or a local "
    "directory written by save_pretrained."
)


def _from_config(config, *, dtype: torch.dtype, seed: int, **kwargs) -> PreTrainedModel:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)


def draw_from_config(config, *, dtype: torch.dtype, seed: int, device: torch.device | str,
                     **kwargs) -> PreTrainedModel:
    """`config`'s model with transformers' own random initialisation (from `seed`), drawn on
    `device` one module at a time. The model is built where the default device puts it, with no
    initialisation; each module's parameters and buffers then visit `device` for their draw and go
    back. Built in host memory, the device never holds the whole model (--offload frozen; drawn
    on the CPU, an 8B model took minutes); built on `device`, nothing moves. Either way the same
    seed gives the same weights on the same device, in a single pass (transformers' own start
    draws every weight twice: the layers' defaults, then its initialisation over them)."""
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        with init.no_init_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
        torch.manual_seed(seed)
        with torch.no_grad(), init.guard_torch_init_functions():
            _draw(model, model._initialize_weights, device, model.is_custom_code())
        model.tie_weights()
    return model


def _draw(module: nn.Module, initialize, device: torch.device, custom_code: bool) -> None:
    """PreTrainedModel.initialize_weights's traversal (children first, a sub-model with its own
    initialisation), each module's own tensors on `device` while it is initialised."""
    for child in module.children():
        _draw(child, child._initialize_weights if isinstance(child, PreTrainedModel) else initialize, device,
              custom_code)
    own = [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]
    homes = [t.device for t in own]
    for t in own:
        t.data = t.data.to(device)
    initialize(module, custom_code)
    for t, home in zip(own, homes):
        t.data = t.data.to(home)


def _looks_local(name_or_path: str) -> bool:
    # Hub ids are "name" or "org/name"; anything else can only be a filesystem path.
    return os.path.isabs(name_or_path) or name_or_path.startswith((".", "~")) or name_or_path.count("/") > 1


def _check_local(name_or_path: str, what: str) -> None:
    # Anything that can only be a filesystem path fails here, before transformers would take it
    # for a hub id and go to the network.
    if _looks_local(name_or_path) and not os.path.exists(os.path.expanduser(name_or_path)):
        raise ValueError(f"{what} {name_or_path!r}: no such file or directory. {_ALTERNATIVES}")


def is_hub_id(name_or_path: str) -> bool:
    """Whether load_model would read `name_or_path` from the hub (or its cache): not 'tiny', not a
    path, nothing there on disk."""
    return name_or_path != "tiny" and not _looks_local(name_or_path) and not os.path.exists(name_or_path)


def _has_safetensors(name_or_path: str) -> bool | None:
    # True for a local checkpoint in safetensors (never unpickle one); None lets a hub repo fall
    # back to .bin weights when it has no safetensors.
    path = Path(name_or_path).expanduser()
    return True if path.is_dir() and any(path.glob("*.safetensors")) else None


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Non-reentrant checkpointing of every decoder layer. Layers below the active block build no
    graph (nothing in them requires grad), so in effect only the layers from the active block up
    are recomputed in backward."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # transformers also makes the embeddings' output require grad (for reentrant checkpointing
    # and PEFT); that would build a graph through every layer below the active block and run
    # backward through all of them. Non-reentrant checkpointing does not need it.
    model.disable_input_require_grads()


def compile_layers(model: nn.Module) -> None:
    """Each decoder layer's forward through torch.compile while gradients are enabled (training);
    evaluation and generation, under no_grad, run the eager forward: generation's KV cache is
    indexed by the layer, which would compile the layer once per index. One compiled forward serves
    every layer (the weights are its inputs), in a few versions: no gradient below the active block,
    the block's own, and only the input's above it. Where the device waits for the host's launches
    (a small micro-batch on a fast GPU), the fused kernels launch fewer times; the arithmetic is the
    same up to rounding, and dropout (LoRA's) draws the eager masks from torch's generator
    (fallback_random: inductor's own generator would draw others). Call it after
    enable_activation_checkpointing, whose wrapper it compiles."""
    for layer in find_decoder_layers(model)[1]:
        eager, compiled = layer.forward, torch.compile(layer.forward, options={"fallback_random": True})

        def forward(*args, eager=eager, compiled=compiled, **kwargs):
            return (compiled if torch.is_grad_enabled() else eager)(*args, **kwargs)
        layer.forward = forward


def labelled_logits(model, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, targets) at the positions that predict a labelled token (labels -100 elsewhere),
    the union over the batch: logits (batch, k, vocab), targets (batch, k), -100 where a row has
    no label there. The LM head runs at those k positions only (transformers' logits_to_keep):
    the full (batch, length, vocab) logits and their fp32 copies are the largest activation of a
    real vocabulary (about 1 GiB for Llama-3's at 512 tokens), while a classification answer is
    one or two tokens.

    use_cache=False: a model in eval mode (evaluation, under no_grad) would otherwise keep every
    layer's keys and values in a KV cache until the forward returns, which nothing here reads
    (2 GiB for Llama-3.1-8B at 32 × 512, the first evaluation's batch, held on top of the weights
    and the first block's optimizer state before training starts)."""
    targets = batch["labels"][:, 1:]  # position t predicts token t + 1
    keep = (targets != -100).any(0).nonzero().squeeze(1)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return model(**inputs, logits_to_keep=keep, use_cache=False).logits, targets[:, keep]


def causal_lm_loss(model, batch: Mapping[str, torch.Tensor], *, loss_chunk: int = 0) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled tokens (transformers' causal-LM loss), with
    the LM head applied only where a token is labelled. The loss the trainer and the simulator
    minimize.

    loss_chunk > 0: the LM head and the loss run over `loss_chunk` of those positions at a time,
    and backward recomputes each chunk's logits (non-reentrant checkpoint). The (batch, positions,
    vocab) logits and their fp32 copies, about 12 bytes per logit and the largest activation of a
    real vocabulary, then exist for one chunk at a time; the price is one more LM-head matmul.
    Same loss and gradients up to rounding (each row's are computed by the same ops)."""
    if not loss_chunk:
        logits, targets = labelled_logits(model, batch)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)
    with _lm_head_detached(model) as head:
        hidden, targets = labelled_logits(model, batch)  # the final hidden states at those positions
    total = sum(checkpoint(_summed_loss, head, h, t, use_reentrant=False)
                for h, t in zip(hidden.split(loss_chunk, 1), targets.split(loss_chunk, 1)))
    # Dividing the sum by the count gives each logit the gradient the mean gives it.
    return total / (targets != -100).sum()


def _summed_loss(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float().flatten(0, 1), targets.flatten(), ignore_index=-100,
                           reduction="sum")


def check_positions(config, max_seq_len: int) -> None:
    """Examples of up to `max_seq_len` tokens fit the model's positions: beyond max_position_embeddings
    a model with learned position embeddings indexes past its table (a device-side assert on a GPU)
    and a rotary one runs on positions it never saw."""
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and max_seq_len > positions:
        raise ValueError(f"--max-seq-len {max_seq_len} is longer than the model's context (max_position_embeddings "
                         f"{positions}): give --max-seq-len {positions} or less (examples are cut to it from the "
                         "left; shorter ones are unchanged)")


def check_plain_logits(config) -> None:
    """loss_chunk needs logits that are the LM head's output as is."""
    for name in RESCALED_LOGITS:
        if getattr(config, name, None) not in (None, 0, 1):
            raise ValueError(f"loss_chunk: {config.model_type} rescales its logits after the LM head ({name}="
                             f"{getattr(config, name)}); run it with loss_chunk 0")


@contextmanager
def _lm_head_detached(model):
    """The model (or the DeepSpeed engine / PEFT wrapper around it) with its LM head replaced by
    the identity, so its forward returns the final hidden states where it would return logits;
    yields the head. Only for models whose logits are the head's output as is."""
    inner = getattr(model, "module", model)  # a DeepSpeed engine holds the model as .module
    check_plain_logits(inner.config)
    head = inner.get_output_embeddings()
    inner.set_output_embeddings(nn.Identity())
    try:
        yield head
    finally:
        inner.set_output_embeddings(head)
