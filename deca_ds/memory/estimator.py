"""DECA's estimate of one client (estimate_block, and a round's peak: estimate_memory) for a
Workload on a ModelSpec, and the bytes it sends (communication)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from ..config import check_master_dtype, check_state_bits, check_variant, dtype_name, parse_dtype
from ..mixing import MIX_CHUNK
from ..offload import OFFLOAD_MODES, check_keep
from ..quantized import num_absmax
from .activations import (
    ATTN_IMPLEMENTATIONS,
    eval_forward_bytes,
    layer_activation_bytes,
    layer_backward_transient_bytes,
    logits_bytes,
    top_saved_bytes,
)
from .phases import MemoryEstimate
from .spec import ModelSpec, dtype_bytes

# DeepSpeed's stage-0 gradient all-reduce bucket (engine.allreduce_gradients -> allreduce_no_retain,
# MEMORY_OPT_ALLREDUCE_SIZE): tensors are appended until the bucket holds more than this many elements.
DEEPSPEED_ALLREDUCE_BUCKET = 500_000_000

PAPER_STEPS_PER_BLOCK = 48  # R, the paper's default; used for the per-round communication

TRANSFER_DTYPES = ("master", "working")


def largest_bucket(numels: list[int], limit: int = DEEPSPEED_ALLREDUCE_BUCKET) -> int:
    """Largest bucket DeepSpeed's allreduce_no_retain forms: append until numel > limit, flush."""
    largest = current = 0
    for n in numels:
        current += n
        if current > limit:
            largest, current = max(largest, current), 0
    return max(largest, current)


def offload_block_stream(below: list[int], above: list[int], steps: int, prefix: bool = True) -> int:
    """Bytes FrozenLayerOffload copies to the device over one block's `steps` inner steps, given the
    sizes of the streamed layers below and above the block, bottom up.

    A step uses the layers below (unless FrozenPrefix, `prefix`, ran them once for the whole block
    first), then those above going up (forward) and down again (backward; the top one, still in use,
    is not asked for again). At each use the offload keeps two layers on the device, the one in use
    and the next one used (prefetched), and copies whichever of them is not there: at the top of the
    walk the last two layers are reused, at the bottom the lowest one above the block. After the
    block's last use it prefetches what a next step would use first, in vain."""
    size = {("below", i): n for i, n in enumerate(below)} | {("above", i): n for i, n in enumerate(above)}
    lower = [("below", i) for i in range(len(below))]
    upper = [("above", i) for i in range(len(above))]
    step = ([] if prefix else lower) + upper + upper[::-1][1:]
    uses = (lower if prefix else []) + step * steps
    after = step[0] if step else (lower[0] if lower else None)
    held, copied = set(), 0
    for j, use in enumerate(uses):
        following = uses[j + 1] if j + 1 < len(uses) else after
        held &= {use, following}
        for layer in (use, following):
            if layer is not None and layer not in held:
                held.add(layer)
                copied += size[layer]
    return copied


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one client runs, whatever method trains it: the batch and its loss, the dtype of the
    weights and of what it sends its `n_neighbors`, activation checkpointing and attention, and the
    evaluation before training. Checked once, here; DECA's estimate (estimate_block) and the
    baselines' (deca_ds.baseline_memory.estimate_method) take it whole.

    deepspeed_allreduce: count DeepSpeed's stage-0 gradient all-reduce buckets; the runtime runs
    that all-reduce only with more than one rank per client.
    loss_positions: positions per micro-batch at which the LM head runs (models.causal_lm_loss:
    the union of those predicting a labelled token); default seq_len, every position (language
    modelling; a classification answer needs one or two). loss_chunk > 0: the head and the loss
    run over that many of them at a time (models.causal_lm_loss), so one chunk's logits are held.
    eval_batch > 0: the evaluation before training scores eval_batch sequences of seq_len tokens
    per forward, the LM head at eval_positions of them (eval_forward_bytes).
    """

    working_dtype: str | torch.dtype = "bf16"  # held as the torch dtype
    transfer_dtype: str = "master"
    n_neighbors: int = 2
    micro_batch: int = 1
    seq_len: int = 512
    checkpointing: bool = True
    attn_implementation: str = "sdpa"
    deepspeed_allreduce: bool = False
    loss_positions: int | None = None
    loss_chunk: int = 0
    eval_batch: int = 0
    eval_positions: int = 2

    def __post_init__(self) -> None:
        working = parse_dtype(self.working_dtype, "working_dtype", (torch.bfloat16, torch.float16, torch.float32))
        object.__setattr__(self, "working_dtype", working)
        if self.transfer_dtype not in TRANSFER_DTYPES:
            raise ValueError(f"transfer_dtype must be one of {TRANSFER_DTYPES}, got {self.transfer_dtype!r}")
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, "
                             f"got {self.attn_implementation!r}")
        for name, least in (("n_neighbors", 0), ("micro_batch", 1), ("seq_len", 1), ("loss_chunk", 0),
                            ("eval_batch", 0), ("eval_positions", 1), ("loss_positions", 1)):
            value = getattr(self, name)
            if value is not None and value < least:
                raise ValueError(f"{name} must be >= {least}, got {value}")

    @property
    def working_bytes(self) -> int:
        return dtype_bytes(self.working_dtype)

    def transfer(self, master: torch.dtype) -> torch.dtype:
        """The dtype a client sends its neighbours, given its master's."""
        return master if self.transfer_dtype == "master" else self.working_dtype

    def logits_bytes(self, spec: ModelSpec) -> int:
        """The LM head's logits of one micro-batch (logits_bytes), at the positions it runs at, a
        chunk of them at a time."""
        s = self.seq_len
        return logits_bytes(spec, self.micro_batch, min(s, self.loss_positions or s, self.loss_chunk or s),
                            self.working_bytes)

    def recorded(self) -> dict:
        """MemoryEstimate's fields that record this workload."""
        return dict(working_dtype=dtype_name(self.working_dtype), transfer_dtype=self.transfer_dtype,
                    n_neighbors=self.n_neighbors, micro_batch=self.micro_batch, seq_len=self.seq_len,
                    checkpointing=self.checkpointing, attn_implementation=self.attn_implementation)


def estimate_block(spec, layers_per_block: int = 1, block: int = 0, workload: Workload = Workload(), *,
                   master_dtype="fp32", offload: str = "none", offload_keep: int = 0, variant: str = "deca",
                   state_bits: int = 32, fused_update: bool = False, steps_per_block: int = PAPER_STEPS_PER_BLOCK,
                   grad_accum: int = 1, inputs_require_grad: bool = False, eval_kv_cache: bool = False,
                   train_embeddings: bool = False, train_final_norm: bool = False,
                   train_lm_head: bool = False) -> MemoryEstimate:
    """The estimate while block `block` of the partition is active (see MemoryEstimate), for one
    client running `workload` with DECA's settings (DecaConfig's names; train_*: the embeddings
    before the layers' blocks, the final norm and the LM head after them, a block each, as the
    trainer cuts them).

    inputs_require_grad: whether the embedding output requires grad. transformers >= 5's
    checkpointing switch turns it on for every input_ids model; then the layers BELOW the active
    block also keep their checkpointed inputs and backward recomputes them, down to the embeddings.
    The runtime undoes it (models.enable_activation_checkpointing), hence the default False.
    grad_accum: micro-batches per step (FrozenPrefix caches what enters the block for all of them).
    eval_kv_cache: the evaluation before training (workload.eval_batch) with the KV cache the
    scoring forward kept before use_cache=False (eval_forward_bytes).
    """
    spec = ModelSpec.from_config(spec)
    for name, value in (("steps_per_block", steps_per_block), ("grad_accum", grad_accum)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    master = check_master_dtype(master_dtype)
    if offload not in OFFLOAD_MODES:
        raise ValueError(f"offload must be one of {OFFLOAD_MODES}, got {offload!r}")
    check_keep(spec.num_layers, offload_keep)
    check_state_bits(state_bits)
    check_variant(variant)

    trains = dict(train_embeddings=train_embeddings, train_final_norm=train_final_norm, train_lm_head=train_lm_head)
    partition = spec.partition(layers_per_block, **trains)
    B = partition.num_blocks
    if not 0 <= block < B:
        raise ValueError(f"block must be in [0, {B}), got {block}")
    n = partition.blocks[block].numel
    w, mb = workload.working_bytes, dtype_bytes(master)
    transfer = workload.transfer(master)
    tb, cast = dtype_bytes(transfer), transfer != master
    n_neighbors = workload.n_neighbors
    chunk = min(n, MIX_CHUNK)  # DistributedMixer.mix exchanges the block in chunks
    numels = spec.tensor_numels(partition, block)
    # 8-bit moments: one code per element and one fp32 absmax per quantization block of each tensor
    moment = n + 4 * num_absmax(numels) if state_bits == 8 else n * mb

    # the layers [first, first + in_block); a block of none sits below them all (the embeddings) or above
    first, in_block = spec.block_layers(partition, block)
    name = partition.blocks[block].name
    # a tied head trains with the embeddings
    top = {"norm_trained": name == "final_norm",
           "head_trained": name == "lm_head" or (name == "embeddings" and spec.tied)}
    activations = _activation_terms(spec, workload, first, in_block, inputs_require_grad, top)
    offloaded = (_offload_terms(spec, workload, first, in_block, offload_keep, steps_per_block, grad_accum,
                                inputs_require_grad) if offload == "frozen"
                 else {"weights": spec.total_params * w, "offload_buffers": 0, "host_weights": 0,
                       "offload_stream_block": 0, "prefix_cache": 0})

    grad_allreduce = 0
    if workload.deepspeed_allreduce:
        grad_allreduce = largest_bucket(spec.tensor_numels(partition, block)) * (w + (4 if w != 4 else 0))

    d, M = spec.total_params, 2 * spec.total_params
    in_place = fused_update and state_bits == 32 and n_neighbors == 0  # deca_ds.updates.InPlaceUpdate
    return MemoryEstimate(
        model=spec.name, total_params=d, decoder_params=spec.decoder_params, non_layer_params=spec.non_layer_params,
        num_layers=spec.num_layers, layers_per_block=layers_per_block, num_blocks=B, block=block, block_params=n,
        **workload.recorded(), master_dtype=dtype_name(master), offload=offload, variant=variant,
        state_bits=state_bits, fused_update=fused_update, inputs_require_grad=inputs_require_grad,
        steps_per_block=steps_per_block,
        master=n * mb, m=moment, v=moment, grad=n * w, grad_allreduce=grad_allreduce,
        x_half=0 if in_place else n * mb, send_copy=chunk * tb if cast and n_neighbors else 0,
        recv=n_neighbors * chunk * tb, x_plus=chunk * mb if cast and n_neighbors else 0,
        grad_kept=n * w if in_place else 0,
        trivial_bma_extra=2 * moment if variant == "trivial_bma" and not in_place else 0,
        quant_transient=3 * max(numels) * mb if state_bits == 8 else 0,
        **offloaded, offload_keep=offload_keep,
        offload_stream=round(offloaded["offload_stream_block"] / steps_per_block), **activations,
        act_logits=workload.logits_bytes(spec),
        comm_per_step=n_neighbors * n * tb,
        comm_per_round=sum(steps_per_block * n_neighbors * blk.numel * tb for blk in partition.blocks),
        paper_deca=M + 10 * M // B if (10 * M) % B == 0 else round(M + 10 * M / B),
        paper_dadam_9m=9 * M, paper_dadam_11m=11 * M,
        dadam_runtime=d * w + spec.decoder_params * (3 * mb + w),
        **setup_terms(spec, workload, offload=offload, eval_kv_cache=eval_kv_cache),
    )


def setup_terms(spec: ModelSpec, workload: Workload, *, offload: str, eval_kv_cache: bool) -> dict:
    """MemoryEstimate's setup fields (deca_ds.memory's docstring, setup phases)."""
    w, batch = workload.working_bytes, workload.eval_batch
    return {"init_transient": 0 if offload == "frozen" else spec.largest_param * w,
            "consensus_buffers": 2 * min(spec.largest_param, MIX_CHUNK) * max(w, 4),
            "eval_batch": batch,
            "eval_forward": eval_forward_bytes(spec, batch, workload.seq_len, w, positions=workload.eval_positions,
                                               kv_cache=eval_kv_cache) if batch else 0}


def _activation_terms(spec: ModelSpec, workload: Workload, first: int, in_block: int,
                      inputs_require_grad: bool, top: dict[str, bool]) -> dict[str, int]:
    """act_saved and act_recompute while layers [first, first + in_block) train (estimate_block)."""
    above = spec.num_layers - first - in_block
    below = first if inputs_require_grad else 0  # layers below the active block that build a graph
    b, s, h, w, attn = (workload.micro_batch, workload.seq_len, spec.hidden, workload.working_bytes,
                        workload.attn_implementation)
    full = layer_activation_bytes(spec, b, s, w, trainable=True, attn_implementation=attn)
    flow = layer_activation_bytes(spec, b, s, w, trainable=False, attn_implementation=attn)
    transient = layer_backward_transient_bytes(spec, b, s, w)
    final_norm = top_saved_bytes(workload, h, flows_down=bool(in_block + above), **top)
    if workload.checkpointing:
        return {"act_saved": (below + in_block + above) * b * s * h * w + final_norm,
                "act_recompute": full + transient}
    return {"act_saved": in_block * full + (above + below) * flow + final_norm, "act_recompute": transient}


def _offload_terms(spec: ModelSpec, workload: Workload, first: int, in_block: int, keep: int, steps_per_block: int,
                   grad_accum: int, inputs_require_grad: bool) -> dict[str, int]:
    """With frozen layers offloaded (--offload frozen): the device's weights (the active block's
    layers, the top `keep` and everything outside the layers), the stream buffers, the host's copy,
    the bytes streamed per block and FrozenPrefix's cache (estimate_block)."""
    w = workload.working_bytes
    resident = set(range(first, first + in_block)) | set(range(spec.num_layers - keep, spec.num_layers))
    streamed = [k for k in range(spec.num_layers) if k not in resident]
    prefix = not inputs_require_grad  # the runtime's FrozenPrefix caches what enters the block
    return {
        "weights": (spec.non_layer_params + sum(spec.layer_params[k] for k in resident)) * w,
        # the layer in use and the one prefetched; one when a single layer streams
        "offload_buffers": min(2, len(streamed)) * max(spec.layer_params[k] for k in streamed) * w if streamed else 0,
        "host_weights": spec.decoder_params * w,
        "offload_stream_block": offload_block_stream([spec.layer_params[k] * w for k in streamed if k < first],
                                                     [spec.layer_params[k] * w for k in streamed
                                                      if k >= first + in_block],
                                                     steps_per_block, prefix),
        "prefix_cache": (steps_per_block * grad_accum * workload.micro_batch * workload.seq_len * spec.hidden * w
                         if prefix and first else 0),
    }


def estimate_blocks(spec, layers_per_block: int = 1, workload: Workload = Workload(),
                    **options) -> list[MemoryEstimate]:
    """One estimate per block of the partition."""
    spec = ModelSpec.from_config(spec)
    trains = {k: v for k, v in options.items() if k.startswith("train_")}
    return [estimate_block(spec, layers_per_block, k, workload, **options)
            for k in range(spec.partition(layers_per_block, **trains).num_blocks)]


def estimate_memory(spec, layers_per_block: int = 1, workload: Workload = Workload(), **options) -> MemoryEstimate:
    """The estimate for the block with the largest peak (ties: the lowest index), i.e. the peak of
    a whole round. Options as estimate_block."""
    return max(estimate_blocks(spec, layers_per_block, workload, **options), key=lambda e: (e.peak, -e.block))


def communication(spec, layers_per_block: int = 1, workload: Workload = Workload(), *, master_dtype="fp32",
                  steps_per_block: int = PAPER_STEPS_PER_BLOCK, **trains: bool) -> dict:
    """Bytes one client sends: per inner step for each block, its maximum, and per round (trains:
    estimate_block's train_* flags)."""
    spec = ModelSpec.from_config(spec)
    master = check_master_dtype(master_dtype)
    tb = dtype_bytes(workload.transfer(master))
    per_block = [workload.n_neighbors * blk.numel * tb for blk in spec.partition(layers_per_block, **trains).blocks]
    return {"per_step": per_block, "max_per_step": max(per_block),
            "per_round": steps_per_block * sum(per_block)}


def to_json(estimates: list[MemoryEstimate]) -> str:
    return json.dumps([e.to_dict() for e in estimates], indent=2, allow_nan=False)
