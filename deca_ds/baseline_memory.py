"""deca_ds.memory's estimate for the baselines (D-Adam, Dec-LoRA, Dec-Adapter, DeCAF): one client's
GPU memory when a method trains one fixed set of tensors at every step (methods.adam.MixedAdam).

The method is applied to the meta model and its optimizer built there (nothing is allocated), so
the weights, the trainable tensors and their dtypes are exact: D-Adam trains every decoder layer in
the working dtype, Dec-LoRA and DeCAF add peft's LoRA factors (fp32: peft upcasts the adapters of a
bf16 base), Dec-Adapter its bottlenecks in the working dtype. The result is a MemoryEstimate whose
one block is that trainable set, with DECA's phase model (deca_ds.memory's docstring):

    backward   weights + master, m, v + .grad of the trainable tensors + activations
    update     kernels.half_step: the eager path frees each gradient before x½ exists, the fused
               one holds both
    mixing     x½ and DistributedMixer.mix's chunk buffers (x⁺ is summed into x½); DeCAF exchanges
               the whole vector at once (mixer.exchange) and writes the re-factorized pairs into a
               new one: a receive buffer of the whole vector per neighbour, and x_plus; and the
               re-factorization's (refactor_elements): every pair's small core, the factors of one
               chunk of pairs of one shape at a time

Activations: the gradient flows from the loss down to the lowest layer holding a trainable tensor
(layer 0 in every baseline). With checkpointing each of those layers keeps its input and backward
recomputes one layer at a time; without it each keeps what autograd saves: a trainable layer's
(D-Adam) or a frozen layer's plus what its adapters save (adapter_saved_bytes). In the lowest
layer the graph starts at the first tensor that trains: its input norm keeps no fp32 copy of the
embeddings' output, and under Dec-Adapter its attention keeps nothing (the first adapter follows it).
"""

from __future__ import annotations

import copy

from torch import nn

from .blocks import find_decoder_layers
from .config import dtype_name
from .memory import (
    MemoryEstimate,
    ModelSpec,
    Workload,
    attention_saved_bytes,
    largest_bucket,
    layer_activation_bytes,
    layer_backward_transient_bytes,
    setup_terms,
    top_saved_bytes,
)
from .methods import Method
from .methods.adapter import ATTENTION, Bottleneck
from .methods.lora import refactor_chunks
from .mixing import MIX_CHUNK


def adapter_saved_bytes(layer: nn.Module) -> int:
    """APPROXIMATE bytes per token autograd saves for the adapters inside one decoder layer.

    peft's LoRA (per adapted linear, d_in inputs, rank r, adapter dtype a bytes): lora_A keeps its
    input, the layer's input cast to the adapter's dtype or its dropout output (a·d_in, a new
    tensor per adapter), dropout its mask (d_in: a GPU's fused dropout keeps a bool mask, the
    CPU's one in the input's dtype), lora_B the rank-r product (a·r). A Houlsby bottleneck
    (methods.adapter.Bottleneck, h → size → h): down keeps its input (w·h), GELU its input and up
    GELU's output (2·w·size). Counted as if no two adapters shared their input: with no dropout and
    adapters in the working dtype q, k and v would share one (an over-count)."""
    saved = 0
    for module in layer.modules():
        if isinstance(module, Bottleneck):
            saved += module.down.weight.element_size() * (module.down.in_features + 2 * module.down.out_features)
        for name, A in getattr(module, "lora_A", {}).items():
            dropout = module.lora_dropout[name]
            mask = A.in_features if isinstance(dropout, nn.Dropout) and dropout.p > 0 else 0
            saved += A.weight.element_size() * (A.in_features + A.out_features) + mask
    return saved


def refactor_elements(pairs: list[tuple[int, int]], rank: int, terms: int, *, host_is_device: bool = False) -> int:
    """Elements methods.lora.refactor_pairs holds at its peak for LoRA pairs of (fan_in, fan_out)
    (A: rank × fan_in, B: fan_out × rank) combined over `terms` clients, kr = terms · rank wide.

    Pass 1: every pair's core R_b·R_aᵀ (qb × qa, in one buffer per shape) beside one chunk's
    (methods.lora.refactor_chunks: pairs of one shape) concatenations B_cat (fan_out × kr) and
    A_cat (kr × fan_in) and their reduced QR factors. The SVDs run on the host, whose U_k, √S_k and
    Vh_k of every pair come back in one buffer. Pass 2, beside that buffer, one chunk at a time: the
    same QRs, or after them Q_b, Q_a, the new B and A and the two products that fill the wider of
    them (a matmul, then its scaling). On CPU ranks
    (`host_is_device`) the host's tensors count too: its buffer from the end of pass 1 on, and
    during each shape's SVD the cores not yet taken and that SVD's U, S and Vh (full matrices)."""
    r, kr = rank, terms * rank
    qrs, after, groups = [], [], {}  # groups: core shape -> [its cores, its SVD's outputs]
    kept = 0  # U_k, √S_k and Vh_k of every pair
    for i, o in pairs:
        qb, qa = min(o, kr), min(i, kr)  # reduced QR: Q_b is o × qb, R_b qb × kr; Q_a i × qa, R_a qa × kr
        k = min(r, qb, qa)  # the singular values kept
        qrs.append(kr * (o + i) + o * qb + qb * kr + i * qa + qa * kr)
        after.append(o * qb + i * qa + o * r + r * i + 2 * k * max(o, i))
        kept += k * (qb + 1 + qa)
        group = groups.setdefault((qb, qa), [0, 0])
        group[0] += qb * qa
        group[1] += qb * qb + min(qb, qa) + qa * qa
    chunks = refactor_chunks([(i, o, ()) for i, o in pairs], kr)  # a client's pairs share its weights
    qrs = [sum(qrs[p] for p in chunk) for chunk in chunks]
    after = [sum(after[p] for p in chunk) for chunk in chunks]
    cores = sum(core for core, _ in groups.values())
    peak = max(cores + max(qrs), kept + max(max(qrs), max(after)))
    if host_is_device:
        waiting = cores  # the SVDs shape by shape: each frees its cores once done
        for core, outputs in groups.values():
            peak = max(peak, waiting + kept + outputs)
            waiting -= core
    return peak


def _trains_in_attention(layer: nn.Module, trainable: set[int]) -> bool:
    """Whether a tensor inside the layer's attention (not an adapter on its output) trains."""
    attention = next(getattr(layer, name) for name in ATTENTION if hasattr(layer, name))
    return any(id(p) in trainable for name, p in attention.named_parameters() if not name.startswith("adapter."))


def estimate_method(spec, method: Method, workload: Workload = Workload()) -> MemoryEstimate:
    """One client's estimate for baseline `method` (its AdamConfig gives the master dtype and the
    update path) running `workload`."""
    if method.name == "deca":
        raise ValueError("DECA's estimate is deca_ds.memory.estimate_memory's")
    spec = ModelSpec.from_config(spec)
    # a copy of its own, which prepare adds to (and no second run of a model's own code)
    model = method.prepare(copy.deepcopy(spec.model).to(workload.working_dtype))
    optimizer = method.optimizer(model)
    trainable = {id(p) for p in optimizer.params}
    n, mb = optimizer.master.numel(), optimizer.master.element_size()
    w, n_neighbors = workload.working_bytes, workload.n_neighbors
    cast = workload.transfer(optimizer.master.dtype) != optimizer.master.dtype
    tb = w if cast else mb
    grad = sum(p.numel() * p.element_size() for p in optimizer.params)
    gb = optimizer.params[0].element_size()  # DeepSpeed's all-reduce bucket: flat copy, then an fp32 one
    bucket = largest_bucket([p.numel() for p in optimizer.params]) * (gb + (4 if gb != 4 else 0))

    b, s, h, attn = workload.micro_batch, workload.seq_len, spec.hidden, workload.attn_implementation
    full = layer_activation_bytes(spec, b, s, w, trainable=True, attn_implementation=attn)
    flow = layer_activation_bytes(spec, b, s, w, trainable=False, attn_implementation=attn)
    layers = find_decoder_layers(model)[1]
    layer_ids = {id(p) for p in layers.parameters()}
    embedding_ids = {id(p) for p in model.get_input_embeddings().parameters()}
    head_ids = {id(p) for p in model.get_output_embeddings().parameters()}
    # D-Adam with --train-embeddings: the embeddings' output needs a gradient, so every layer keeps a
    # graph; with --train-lm-head, --train-final-norm the top keeps what their gradients read
    inputs_train, head_trained = bool(embedding_ids & trainable), bool(head_ids & trainable)
    norm_trained = bool(trainable - layer_ids - embedding_ids - head_ids)
    saved = []  # per layer from the lowest that trains up: what it saves without checkpointing
    for layer in layers:
        trains = any(id(p) in trainable for p in layer.parameters())
        if not (saved or trains or inputs_train):
            continue  # below the lowest layer that trains: no graph
        adapters = adapter_saved_bytes(layer)
        layer_saved = flow + b * s * adapters if adapters else full if trains else flow
        if not (saved or inputs_train):  # the lowest: its input, the embeddings' output, needs no gradient
            layer_saved -= b * s * 4 * h  # so its input norm keeps no fp32 copy of it
            if not _trains_in_attention(layer, trainable):  # Dec-Adapter: the graph starts after attention
                layer_saved -= b * s * attention_saved_bytes(spec, s, w, attn)
        saved.append(layer_saved)
    transient = layer_backward_transient_bytes(spec, b, s, w)
    final_norm = top_saved_bytes(workload, h, flows_down=bool(saved), norm_trained=norm_trained,
                                 head_trained=head_trained)
    if workload.checkpointing:
        act_saved, act_recompute = len(saved) * b * s * h * w + final_norm, max(saved, default=0) + transient
    else:
        act_saved, act_recompute = sum(saved) + final_norm, transient

    if optimizer.linear:  # DistributedMixer.mix: chunk by chunk, x⁺ summed into x½ (a new chunk when cast)
        chunk, refactor = min(n, MIX_CHUNK), 0
        x_plus = chunk * mb if cast and n_neighbors else 0
    else:  # DeCAF: whole vectors exchanged (mixer.exchange), combined into a new one a chunk of pairs at a time
        chunk, x_plus = n, n * mb
        pairs = optimizer.params  # A (rank × in), B (out × rank) of each LoRA pair
        refactor = refactor_elements([(A.shape[1], B.shape[0]) for A, B in zip(pairs[::2], pairs[1::2])],
                                     pairs[0].shape[0], n_neighbors + 1) * mb
    d, M = spec.total_params, 2 * spec.total_params
    return MemoryEstimate(
        model=spec.name, total_params=d, decoder_params=spec.decoder_params, non_layer_params=spec.non_layer_params,
        num_layers=spec.num_layers, layers_per_block=spec.num_layers, num_blocks=1, block=0, block_params=n,
        **workload.recorded(), master_dtype=dtype_name(optimizer.master.dtype), offload="none", variant="n/a",
        state_bits=32, fused_update=optimizer.config.fused_update, inputs_require_grad=False, steps_per_block=1,
        weights=sum(p.numel() * p.element_size() for p in model.parameters()),
        master=n * mb, m=n * mb, v=n * mb, grad=grad,
        grad_allreduce=bucket if workload.deepspeed_allreduce else 0,
        x_half=n * mb, send_copy=chunk * tb if cast and n_neighbors else 0, recv=n_neighbors * chunk * tb,
        x_plus=x_plus,
        grad_kept=0, trivial_bma_extra=0, quant_transient=0, offload_buffers=0, offload_keep=0,
        offload_stream_block=0, offload_stream=0, prefix_cache=0, host_weights=0,
        act_saved=act_saved, act_recompute=act_recompute,
        act_logits=workload.logits_bytes(spec),
        comm_per_step=n_neighbors * n * tb, comm_per_round=n_neighbors * n * tb,
        paper_deca=0, paper_dadam_9m=9 * M, paper_dadam_11m=11 * M,
        dadam_runtime=d * w + spec.decoder_params * (3 * mb + w),
        refactor=refactor,
        method=method.name,
        **setup_terms(spec, workload, offload="none", eval_kv_cache=False),
    )
