"""Analytic GPU memory and communication of one DECA client, from a model config alone.

Nothing is downloaded and nothing is allocated: the architecture is built on the meta device and
cut into blocks by the same `partition_model` the trainer uses, so block sizes are exact. Every
term below is in bytes and mirrors what the implementation holds (DecaOptimizer, DistributedMixer,
the DeepSpeed stage-0 engine); only `activations` is an approximation, and is labelled so.

    spec = ModelSpec.from_config("profiling/configs/llama-3.1-8b-instruct.json")
    est = estimate_memory(spec, layers_per_block=1, workload=Workload(micro_batch=4), offload="frozen")
    est.peak, est.peak_phase, est.optimizer_state, est.fits("RTX 5090")

Modules: `spec` (ModelSpec: the model, its blocks and sizes), `activations` (the approximate
terms), `phases` (MemoryEstimate: what is alive in each phase below, the cards), `estimator`
(Workload, estimate_block, estimate_memory, communication).

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

from .activations import (
    ATTN_IMPLEMENTATIONS,
    attention_saved_bytes,
    eval_forward_bytes,
    layer_activation_bytes,
    layer_backward_transient_bytes,
    logits_bytes,
    top_saved_bytes,
)
from .estimator import (
    DEEPSPEED_ALLREDUCE_BUCKET,
    PAPER_STEPS_PER_BLOCK,
    TRANSFER_DTYPES,
    Workload,
    communication,
    estimate_block,
    estimate_blocks,
    estimate_memory,
    largest_bucket,
    offload_block_stream,
    setup_terms,
    to_json,
)
from .phases import DEFAULT_RESERVE, GPUS, MB, GiB, MemoryEstimate, MiB
from .spec import ModelSpec, load_config, meta_model

__all__ = [
    "ATTN_IMPLEMENTATIONS", "DEEPSPEED_ALLREDUCE_BUCKET", "DEFAULT_RESERVE", "GPUS", "MB", "PAPER_STEPS_PER_BLOCK",
    "TRANSFER_DTYPES", "GiB", "MemoryEstimate", "MiB", "ModelSpec", "Workload", "attention_saved_bytes",
    "communication", "estimate_block", "estimate_blocks", "estimate_memory", "eval_forward_bytes", "largest_bucket",
    "layer_activation_bytes", "layer_backward_transient_bytes", "load_config", "logits_bytes", "meta_model",
    "offload_block_stream", "setup_terms", "to_json", "top_saved_bytes",
]
