"""Analytic GPU memory and communication of one DECA client, from a model config alone.

Nothing is downloaded and nothing is allocated: the architecture is built on the meta device and
cut into blocks by the same `partition_model` the trainer uses, so block sizes are exact. Every
term below is in bytes and mirrors what the implementation holds (DecaOptimizer, DistributedMixer,
the DeepSpeed stage-0 engine); only `activations` is an approximation, and is labelled so.

    spec = ModelSpec.from_config("profiling/configs/llama-3.1-8b-instruct.json")
    est = estimate_memory(spec, layers_per_block=1, workload=Workload(micro_batch=4), offload="frozen")
    est.peak, est.peak_phase, est.optimizer_state, est.fits("RTX 5090")

Units: functions return bytes. Reports use GiB (2^30 B) for memory, because NVIDIA's "32 GB",
"80 GB", "96 GB" cards carry 32, 80, 96 GiB of physical memory and nvidia-smi / torch report in
MiB / GiB; communication is reported in MB (10^6 B), as network volumes usually are.

Phase model of one inner step (what is alive at once; the peak is the largest phase):

    backward       weights + optimizer_state + grad + activations
                   (conservative: the active block's full .grad is counted together with the
                   activation peak, although the gradient of the lowest block only appears at
                   the very end of backward, when most activations are already freed)
    grad_allreduce weights + optimizer_state + grad + grad_allreduce
                   (with G > 1 ranks per client, DeepSpeed stage 0 flattens the .grad tensors into
                   buckets of up to 5e8 elements and casts the bucket to its communication dtype,
                   fp32 unless DeepSpeed's own bf16/fp16 mode is on - which deca-ds refuses; with
                   one rank per client the runtime switches that all-reduce off; activations are
                   gone: autograd freed the graph at the end of backward)
    update         weights + optimizer_state + max(grad, x_half) + trivial_bma_extra
                   (adam_half_step folds .grad into m, v tensor by tensor and frees it, then
                   allocates x_half; it never holds a full master-dtype gradient). The fused
                   update (fused_update) folds and steps in one call, so it holds both:
                   grad + x_half. With 8-bit moments (state_bits=8) x_half comes first, the
                   gradient is freed tensor by tensor, and one tensor's fp32 m, v and Adam result
                   exist at a time: grad + x_half + quant_transient
    mixing         weights + optimizer_state + x_half + grad_kept + send_copy + recv + x_plus
                   + trivial_bma_extra (+ refactor: DeCAF's, deca_ds.baseline_memory)
                   (DistributedMixer.mix exchanges the block MIX_CHUNK elements at a time: per
                   chunk one receive buffer per neighbor, a cast send copy if the transfer dtype
                   is not the master's, and x⁺ summed into the first term's buffer (a new
                   master-dtype chunk when cast), then written over x½; the cast copy and x⁺'s
                   chunk are counted together, as the staged path (gloo on a GPU) may hold them,
                   casting chunk k+1 before it sums chunk k, where the direct path frees the copy
                   first; bma_correct works in
                   place. A client without neighbors exchanges nothing, and with the fused update
                   it stores no x½ at all: x_half = 0, and the gradient is kept until
                   bma_correct writes x⁺ over x: grad_kept = grad)

With offload "frozen", `weights` counts only the resident layers and every phase also holds two
streaming buffers; `offload_stream` is what a step copies from host memory. One more phase:

    prefix         weights + offload_buffers + optimizer_state + prefix_cache + act_recompute
                   (at a block's first step FrozenPrefix runs the layers below it for all R · grad_accum
                   micro-batches of the block, layer by layer, with their hidden states on the device,
                   then keeps them in host memory; one layer's recomputation bounds a no-grad forward)

Setup, before the first step (`setup_phases`; the process's peak is `process_peak`, the largest of
`setup_peak`, the training `peak` and `end`), in the runtime's order (deca_ds.runtime.trainer.start_job):

    init           weights + offload_buffers + init_transient
                   (the model drawn in the working dtype on the device - kept in host memory with
                   offload "frozen", whose frozen layers the device never holds all of, each module
                   visiting the device for its draw - or a checkpoint copied in one tensor at a
                   time: one extra tensor the size of the largest, the embedding)
    evaluate       weights + offload_buffers + eval_forward
                   (the evaluation before training, eval_batch sequences per no-grad forward,
                   before the optimizer exists; eval_batch 0: none)
    optimizer      weights + offload_buffers + optimizer_state
                   (the first block's master, m, v; DeepSpeed's stage-0 engine adds no copy)

After the last step (`end`; the state is freed): weights + offload_buffers + consensus_buffers,
x̄ formed MIX_CHUNK elements at a time through a mean and a difference buffer in at least fp32
(runtime.consensus.to_consensus_); rank 0's evaluation of x̄ is the setup's `evaluate` again.

Not modelled: the CUDA context, cuBLAS workspaces and NCCL buffers (covered by the `reserve` of
`fits`), allocator fragmentation, per-tensor temporaries (a single parameter tensor's worth,
e.g. p.grad * clip_scale), the model's non-parameter buffers (rotary tables), the batch itself.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .blocks import Partition, block_layers, find_decoder_layers, partition_model
from .config import check_master_dtype, check_state_bits, check_variant, dtype_name, parse_dtype
from .mixing import MIX_CHUNK
from .offload import OFFLOAD_MODES, check_keep
from .quantized import num_absmax

GiB = 2**30
MiB = 2**20
MB = 10**6

# Total memory of each card as nvidia-smi reports it (MiB × 2^20 bytes). NVIDIA markets the
# cards as 32 GB / 96 GB / 80 GB; the physical memory is that many GiB (binary-sized GDDR7 / HBM3
# chips), of which the driver reports slightly less. Choice: these reported totals, in bytes, and
# every size in the reports in GiB. RTX 5090: 32607 MiB (31.8 GiB) and H100 80GB HBM3: 81559 MiB
# (79.6 GiB) are the totals nvidia-smi prints on those cards in public logs; RTX PRO 6000 Blackwell
# (96 GiB physical): 97887 MiB (95.6 GiB), the commonly reported total, not verified here.
GPUS: dict[str, int] = {
    "RTX 5090": 32607 * MiB,
    "RTX PRO 6000": 97887 * MiB,
    "H100 80GB": 81559 * MiB,
}
# Memory a process needs on the card besides what this model counts: CUDA context (~0.3-0.6 GiB
# with torch), cuBLAS workspace, NCCL communicator buffers, allocator slack. `fits` requires
# peak + reserve <= capacity.
DEFAULT_RESERVE = 1 * GiB

# DeepSpeed's stage-0 gradient all-reduce bucket (engine.allreduce_gradients -> allreduce_no_retain,
# MEMORY_OPT_ALLREDUCE_SIZE): tensors are appended until the bucket holds more than this many elements.
DEEPSPEED_ALLREDUCE_BUCKET = 500_000_000

PAPER_STEPS_PER_BLOCK = 48  # R, the paper's default; used for the per-round communication

ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
TRANSFER_DTYPES = ("master", "working")


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---- the architecture, on the meta device ---------------------------------------------------------

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


# ---- activations (approximate) --------------------------------------------------------------------

def layer_activation_bytes(spec: ModelSpec, micro_batch: int, seq_len: int, working_bytes: int, *,
                           trainable: bool, attn_implementation: str = "sdpa") -> int:
    """APPROXIMATE bytes autograd saves for one Llama-style decoder layer (Llama, Qwen2, Mistral).

    Counted from transformers' LlamaDecoderLayer, per token, w = working-dtype bytes, h hidden,
    i intermediate, a heads, q = a·head_dim. PyTorch saves an operand only if the gradient that
    needs it is required, so a layer whose parameters are frozen but through which the gradient
    flows (a layer above the active block) saves less than a trainable one.

      RMSNorm ×2      fp32 copy of the input (pow, mul): 4h; trainable also the normalised
                      working-dtype value (for ∂weight) and the output, the next linears' input: 2·w·h
      attention       q, k, v after RoPE and repeat_kv (k, v at a heads: deca-ds batches carry a
                      padding mask, which makes transformers expand GQA keys/values) and the output:
                      4·w·q, + fp32 logsumexp 4a (SDPA/flash: no s² term);
                      eager instead: q, k (2·w·q), fp32 softmax output and its working-dtype cast
                      a·s·(4 + w) per token, v (w·q); trainable also the o_proj input w·q
      MLP             SiLU input (gate output), SiLU output and up output: 3·w·i;
                      trainable also the down_proj input: w·i
    Ignored: RoPE cos/sin, the attention mask, dropout (p = 0), small per-token scalars.
    """
    h, i, w = spec.hidden, spec.intermediate, working_bytes
    norms = 2 * (4 * h + (2 * w * h if trainable else 0))
    attn = attention_saved_bytes(spec, seq_len, w, attn_implementation)
    if trainable:
        attn += w * spec.heads * spec.head_dim
    mlp = (4 if trainable else 3) * w * i
    return micro_batch * seq_len * (norms + attn + mlp)


def attention_saved_bytes(spec: ModelSpec, seq_len: int, working_bytes: int, attn_implementation: str = "sdpa") -> int:
    """APPROXIMATE bytes per token a frozen layer's attention saves when its inputs require grad
    (layer_activation_bytes)."""
    a, q, w = spec.heads, spec.heads * spec.head_dim, working_bytes
    if attn_implementation == "sdpa":
        return 4 * w * q + 4 * a
    if attn_implementation == "eager":
        return 3 * w * q + a * seq_len * (4 + (w if w != 4 else 0))
    raise ValueError(f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, got {attn_implementation!r}")


def layer_backward_transient_bytes(spec: ModelSpec, micro_batch: int, seq_len: int, working_bytes: int) -> int:
    """APPROXIMATE gradient temporaries alive inside one layer's backward: the gradients of the
    layer output and of the residual stream (2·w·h), of the MLP intermediates at once (3·w·i),
    and the fp32 RMSNorm backward temporaries (2·4h), per token."""
    h, i, w = spec.hidden, spec.intermediate, working_bytes
    return micro_batch * seq_len * (2 * w * h + 3 * w * i + 8 * h)


def logits_bytes(spec: ModelSpec, micro_batch: int, positions: int, working_bytes: int) -> int:
    """APPROXIMATE peak of the loss: b·k·V·max(w + 8, 12), k the positions the LM head runs at
    (models.causal_lm_loss: those predicting a labelled token). Forward: the working-dtype logits,
    their fp32 upcast and the fp32 log-softmax output saved by cross_entropy; start of backward:
    that output, the fp32 gradient from nll_loss and log-softmax's fp32 input gradient."""
    return micro_batch * positions * spec.vocab * max(working_bytes + 8, 12)


def eval_forward_bytes(spec: ModelSpec, batch: int, seq_len: int, working_bytes: int, *, positions: int = 2,
                       kv_cache: bool = False) -> int:
    """APPROXIMATE peak of one no-grad scoring forward (evaluation.score_answers through
    models.labelled_logits) of `batch` sequences of `seq_len` tokens, above the weights.

    Inside one layer, per token, w working bytes: the residual stream, the normalised input and
    the fp32 RMSNorm temporary (2·w·h + 4h), plus the larger of attention's q, the keys and values
    repeated to every head (the padding mask makes transformers expand GQA) and its output
    (4·w·q), and the MLP's SiLU output, up output and their product (3·w·i). Nothing else
    survives a layer without autograd. Then the LM head at `positions` positions: the logits,
    their fp32 copy and log-softmax, b·k·V·(w + 8). kv_cache: the KV cache an eval-mode forward
    keeps when use_cache is on (every layer's keys and values, GQA-sized; labelled_logits turns
    it off): the old path, for comparison."""
    h, i, q, w = spec.hidden, spec.intermediate, spec.heads * spec.head_dim, working_bytes
    tokens = batch * seq_len
    layer = tokens * (2 * w * h + 4 * h + max(4 * w * q, 3 * w * i))
    head = batch * positions * spec.vocab * (w + 8) + tokens * w * h
    cache = spec.num_layers * 2 * tokens * spec.kv_heads * spec.head_dim * w if kv_cache else 0
    return cache + max(layer, head)


def setup_terms(spec: ModelSpec, workload: Workload, *, offload: str, eval_kv_cache: bool) -> dict:
    """MemoryEstimate's setup fields (module docstring, setup phases)."""
    w, batch = workload.working_bytes, workload.eval_batch
    return {"init_transient": 0 if offload == "frozen" else spec.largest_param * w,
            "consensus_buffers": 2 * min(spec.largest_param, MIX_CHUNK) * max(w, 4),
            "eval_batch": batch,
            "eval_forward": eval_forward_bytes(spec, batch, workload.seq_len, w, positions=workload.eval_positions,
                                               kv_cache=eval_kv_cache) if batch else 0}


# ---- the estimate ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one DECA client holds on its GPU during an inner step on block `block` (see the
    module docstring for the phase model). Every term is in bytes. A baseline's estimate
    (deca_ds.baseline_memory, `method` not "deca") has one block, the method's trainable set,
    trained at every step: its round is one step, and the DECA-only terms are 0."""

    # ---- what was estimated
    model: str
    total_params: int  # d, every parameter once
    decoder_params: int  # the trainable space: all decoder layers
    non_layer_params: int  # embeddings, final norm, LM head (frozen)
    num_layers: int
    layers_per_block: int
    num_blocks: int  # B
    block: int  # index of the active block this estimate is for
    block_params: int  # its numel
    working_dtype: str
    master_dtype: str
    transfer_dtype: str  # "master" (exact) or "working"
    n_neighbors: int  # neighbors a client exchanges with, itself excluded
    micro_batch: int
    seq_len: int
    checkpointing: bool
    offload: str  # "none" or "frozen"
    variant: str
    state_bits: int  # 32: fp32/fp64 m, v; 8: bitsandbytes block-wise codes (DecaConfig.state_bits)
    fused_update: bool  # DecaConfig.fused_update: the gradient and x½ are held together
    attn_implementation: str
    inputs_require_grad: bool  # embedding output requires grad: layers below the active block keep a graph
    steps_per_block: int  # R, for the per-round communication

    # ---- exact terms (bytes)
    weights: int  # working-dtype parameters on the device: all of them (offload "none"), or
    #               embeddings + final norm + LM head + the active block + the kept layers
    #               (offload "frozen")
    master: int  # active block × master bytes (DecaOptimizer ActiveBlock.master)
    m: int  # active block × master bytes (first moment)
    v: int  # active block × master bytes (second moment)
    grad: int  # active block × working bytes: the .grad tensors, from backward until adam_half_step
    grad_allreduce: int  # DeepSpeed stage-0 all-reduce: largest bucket × (working + 4 if the
    #                      working dtype is not fp32: flat copy, then its fp32 communication copy)
    x_half: int  # active block × master bytes: x½, allocated by adam_half_step, the send buffer
    #              (0 in place: fused_update without neighbors)
    send_copy: int  # one mixing chunk × transfer bytes when the transfer dtype differs from the master's
    recv: int  # n_neighbors × one mixing chunk (min(block, MIX_CHUNK)) × transfer bytes
    x_plus: int  # x⁺ chunk = Σ w_ij x½_j: 0 when summed into an existing master-dtype buffer, else chunk × master bytes
    grad_kept: int  # fused, no neighbors: the .grad tensors until bma_correct, which updates in place
    trivial_bma_extra: int  # variant trivial_bma: m_prev, v_prev (2 × the bytes of m), except in place
    quant_transient: int  # state_bits=8: fp32 m, v and Adam result of the block's largest tensor
    offload_buffers: int  # offload "frozen": two streaming buffers of the largest streamed layer (one if only
    #                       one layer streams), working dtype
    offload_keep: int  # offload "frozen": top decoder layers kept resident (FrozenLayerOffload keep)
    offload_stream_block: int  # offload "frozen": bytes of frozen layers copied host -> device over
    #                            the block's R steps (offload_block_stream)
    offload_stream: int  # offload "frozen": the same per inner step, the mean over the block's R steps
    prefix_cache: int  # offload "frozen": the hidden states entering the active block, one per micro-batch
    #                    of its R steps (deca_ds.prefix.FrozenPrefix), on the device while they are computed;
    #                    host memory afterwards
    host_weights: int  # offload "frozen": decoder layers kept in (pinned) host memory, not on the GPU

    # ---- approximate terms (bytes)
    act_saved: int  # APPROXIMATE: checkpointed layer inputs (b·s·h·w per layer from the active block
    #                 up - every layer when the embedding output requires grad - + the fp32
    #                 final-norm input) or, without checkpointing, every saved tensor of those layers
    act_recompute: int  # APPROXIMATE: one trainable layer's saved tensors during its recomputation
    #                     (checkpointing only) + its backward gradient temporaries
    act_logits: int  # APPROXIMATE: the loss's logits peak, b·s·V·max(w + 8, 12)

    # ---- communication, exact (bytes)
    comm_per_step: int  # sent by this client per inner step: n_neighbors × block × transfer bytes
    comm_per_round: int  # Σ over all B blocks of R × n_neighbors × block × transfer bytes (a baseline: one step's)

    # ---- comparisons (bytes)
    paper_deca: int  # paper Appendix B.2: M + 10M/B, M = 2d (0 for a baseline)
    paper_dadam_9m: int  # paper: decentralized full-parameter Adam, 9M
    paper_dadam_11m: int  # paper: decentralized Adam with the extra fp32 h vector, 11M
    dadam_runtime: int  # full-parameter Adam as this runtime would hold it: all weights (working)
    #                     + master, m, v (master dtype) + .grad (working) of every decoder-layer param

    # ---- setup, before the first step (bytes; see setup_phases)
    init_transient: int = 0  # APPROXIMATE: the largest tensor once more while the model is drawn or loaded
    eval_batch: int = 0  # sequences per forward of the evaluation before training (0: none)
    eval_forward: int = 0  # APPROXIMATE: eval_forward_bytes at eval_batch × seq_len
    consensus_buffers: int = 0  # after the last step: x̄'s mean and difference chunks (fp32 at least)

    # ---- DeCAF (deca_ds.baseline_memory), exact (bytes)
    refactor: int = 0  # the re-factorization's peak (methods.lora.refactor_pairs; baseline_memory.refactor_elements)

    method: str = "deca"  # or the baseline estimated (deca_ds.baseline_memory)

    # ---- derived -----------------------------------------------------------------------------
    @property
    def optimizer_state(self) -> int:
        """master + m + v: exactly DecaOptimizer.state_bytes() while this block is active."""
        return self.master + self.m + self.v

    @property
    def activations(self) -> int:
        """APPROXIMATE activation peak: the saved tensors held throughout backward, plus the larger
        of the loss's logits peak and one layer's recomputation (they happen at different times)."""
        return self.act_saved + max(self.act_logits, self.act_recompute)

    @property
    def phases(self) -> dict[str, int]:
        base = self.weights + self.offload_buffers + self.optimizer_state
        return {
            "prefix": base + self.prefix_cache + self.act_recompute,
            "backward": base + self.grad + self.activations,
            "grad_allreduce": base + self.grad + self.grad_allreduce,
            "update": base + (self.grad + self.x_half if self.state_bits == 8 or self.fused_update
                              else max(self.grad, self.x_half))
                      + self.quant_transient + self.trivial_bma_extra,
            "mixing": base + self.x_half + self.grad_kept + self.send_copy + self.recv + self.x_plus
                      + self.trivial_bma_extra + self.refactor,
        }

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def setup_phases(self) -> dict[str, int]:
        """What the device holds before the first step (module docstring), per setup phase."""
        base = self.weights + self.offload_buffers
        return {"init": base + self.init_transient,
                "evaluate": base + self.eval_forward,
                "optimizer": base + self.optimizer_state}

    @property
    def setup_peak(self) -> int:
        return max(self.setup_phases.values())

    @property
    def end(self) -> int:
        """What the device holds after the last step, forming x̄ (module docstring)."""
        return self.weights + self.offload_buffers + self.consensus_buffers

    @property
    def process_peak(self) -> int:
        """The whole process's peak: setup, training or after it, whichever is largest."""
        return max(self.setup_peak, self.peak, self.end)

    @property
    def peak_phase(self) -> str:
        phases = self.phases
        return max(phases, key=phases.get)

    def headroom(self, gpu: str | int, reserve: int = DEFAULT_RESERVE, clients: int = 1) -> int:
        """Bytes left on `gpu` (a GPUS name or a capacity in bytes) after the peak and `reserve` of
        each of `clients` clients sharing it (each is its own process with its own CUDA context, and
        their peaks can coincide: nothing synchronises the phases of clients on one GPU)."""
        if clients < 1:
            raise ValueError(f"clients per GPU must be >= 1, got {clients}")
        capacity = GPUS[gpu] if isinstance(gpu, str) else int(gpu)
        return capacity - clients * (reserve + self.peak)

    def fits(self, gpu: str | int, reserve: int = DEFAULT_RESERVE, clients: int = 1) -> bool:
        return self.headroom(gpu, reserve, clients) >= 0

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(optimizer_state=self.optimizer_state, activations=self.activations,
                   peak=self.peak, peak_phase=self.peak_phase,
                   **{f"phase_{k}": v for k, v in self.phases.items()},
                   setup_peak=self.setup_peak, end=self.end, process_peak=self.process_peak,
                   **{f"setup_{k}": v for k, v in self.setup_phases.items()})
        return out

    def describe(self) -> str:
        rows = [(f.name, getattr(self, f.name)) for f in fields(self) if isinstance(getattr(self, f.name), int)
                and not isinstance(getattr(self, f.name), bool) and f.name not in _COUNTS]
        rows += [("optimizer_state", self.optimizer_state), ("activations (approx.)", self.activations)]
        rows += [(f"phase {k}", v) for k, v in self.phases.items()]
        rows.append((f"peak ({self.peak_phase})", self.peak))
        head = (f"{self.model}: block {self.block} of {self.num_blocks} ({self.block_params:,} params), "
                f"{self.working_dtype} working, {self.master_dtype} master, offload {self.offload}")
        return "\n".join([head] + [f"  {k:<24} {v / GiB:10.3f} GiB" for k, v in rows])


_COUNTS = {"total_params", "decoder_params", "non_layer_params", "num_layers", "layers_per_block", "num_blocks",
           "block", "block_params", "n_neighbors", "micro_batch", "seq_len", "steps_per_block", "eval_batch",
           "state_bits", "offload_keep"}


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
        return _size(self.working_dtype)

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
    w, mb = workload.working_bytes, _size(master)
    transfer = workload.transfer(master)
    tb, cast = _size(transfer), transfer != master
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


def top_saved_bytes(workload: Workload, h: int, *, flows_down: bool, norm_trained: bool, head_trained: bool) -> int:
    """What the top of the model keeps for backward besides the logits: the final norm's fp32 input,
    for the gradient that flows down through it to a trained layer (or the embeddings); with the
    norm's weight trained, its normalized input in the working dtype, at every position; with the LM
    head trained (a tied one: with the embeddings), its input, at the positions it runs at."""
    b, s, w = workload.micro_batch, workload.seq_len, workload.working_bytes
    positions = min(s, workload.loss_positions or s)
    return b * h * (s * (4 if flows_down else 0) + s * w * norm_trained + positions * w * head_trained)


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
    tb = _size(workload.transfer(master))
    per_block = [workload.n_neighbors * blk.numel * tb for blk in spec.partition(layers_per_block, **trains).blocks]
    return {"per_step": per_block, "max_per_step": max(per_block),
            "per_round": steps_per_block * sum(per_block)}


def to_json(estimates: list[MemoryEstimate]) -> str:
    return json.dumps([e.to_dict() for e in estimates], indent=2, allow_nan=False)


__all__ = [
    "DEFAULT_RESERVE", "GPUS", "MB", "GiB", "MemoryEstimate", "ModelSpec", "Workload", "attention_saved_bytes",
    "communication", "estimate_block", "estimate_blocks", "estimate_memory", "eval_forward_bytes", "largest_bucket",
    "layer_activation_bytes", "layer_backward_transient_bytes", "load_config", "logits_bytes", "meta_model",
    "offload_block_stream", "setup_terms", "top_saved_bytes",
]
