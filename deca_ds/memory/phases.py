"""What one client's device holds, term by term and phase by phase (MemoryEstimate; the phase
model is deca_ds.memory's docstring), and the cards it is held against."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

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


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one DECA client holds on its GPU during an inner step on block `block` (see the
    phase model in deca_ds.memory's docstring). Every term is in bytes. A baseline's estimate
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
        """What the device holds before the first step (deca_ds.memory's docstring), per setup phase."""
        base = self.weights + self.offload_buffers
        return {"init": base + self.init_transient,
                "evaluate": base + self.eval_forward,
                "optimizer": base + self.optimizer_state}

    @property
    def setup_peak(self) -> int:
        return max(self.setup_phases.values())

    @property
    def end(self) -> int:
        """What the device holds after the last step, forming x̄ (deca_ds.memory's docstring)."""
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
