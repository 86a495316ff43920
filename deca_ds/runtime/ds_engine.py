"""The one place that touches DeepSpeed: preset validation, the per-client mpu, initialize.

DeepSpeed gets DecaOptimizer as its client optimizer and, through `mpu`, the client's own ranks
as its data-parallel group, so it averages gradients inside a client and never across clients.
Keys that would make DeepSpeed keep FP32 copies of every parameter, or shard across clients,
are refused with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

HONORED = {
    "train_micro_batch_size_per_gpu": "micro-batch per rank",
    "gradient_accumulation_steps": "micro-batches per optimizer step (g is their mean)",
    "train_batch_size": "must equal micro-batch × accumulation × ranks per client",
    "gradient_clipping": "global-norm clipping of the active block's gradient (default 0 = off, unlike DeepSpeed's 1.0)",
    "activation_checkpointing": "turns on non-reentrant activation checkpointing of the decoder layers",
    "scheduler": "DeepSpeed LR schedule, applied to the active block's lr",
    "steps_per_print": "DeepSpeed's own log interval",
    "wall_clock_breakdown": "DeepSpeed's own timers",
    "zero_optimization": "stage 0 only",
    "bf16": "\"enabled\": false only",
    "fp16": "\"enabled\": false only",
    "deca": "deca-ds run options (any --option of launch/train.py, with _ for -)",
}

_REFUSED = {
    "bf16": "DeepSpeed's bf16 wrapper keeps FP32 master copies of every parameter; "
            "set \"deca\": {\"working_dtype\": \"bf16\"} instead",
    "fp16": "DeepSpeed's fp16 wrapper keeps FP32 master copies of every parameter; "
            "set \"deca\": {\"working_dtype\": ...} instead",
    "zero_optimization": "ZeRO stages above 0 shard optimizer state across ranks and wrap the optimizer; "
                         "DECA keeps state for the active block only and must not shard across clients",
    "optimizer": "DECA supplies the optimizer; set lr, betas and eps with deca-ds options",
}


def load_ds_config(path: str | Path) -> tuple[dict, dict]:
    """Read a preset and split it into (DeepSpeed config, deca-ds run options)."""
    path = Path(path)
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"DeepSpeed config {path} does not exist") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"DeepSpeed config {path} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"DeepSpeed config {path} must hold a JSON object")
    unknown = sorted(set(config) - set(HONORED) - set(_REFUSED))
    if unknown:
        raise ValueError(f"DeepSpeed config {path}: unknown key(s) {unknown}; deca-ds honors {sorted(HONORED)}")
    for key, why in _REFUSED.items():
        if key not in config:
            continue
        value = config[key]
        allowed = (key in ("bf16", "fp16") and isinstance(value, dict) and not value.get("enabled", False)
                   or key == "zero_optimization" and isinstance(value, dict)
                   and value.get("stage", 0) == 0 and set(value) <= {"stage"})
        if not allowed:
            raise ValueError(f"DeepSpeed config {path}: key {key!r} = {value!r} is not supported: {why}")
    deca = config.pop("deca", {})
    if not isinstance(deca, dict):
        raise ValueError(f"DeepSpeed config {path}: \"deca\" must be an object of run options")
    return config, deca


class ClientMPU:
    """DeepSpeed's view of the parallel layout: data parallel = this client's ranks; no model parallel."""

    def __init__(self, client_group, client_ranks: list[int], single_group) -> None:
        self.client_group, self.client_ranks, self.single_group = client_group, client_ranks, single_group

    def get_data_parallel_group(self):
        return self.client_group

    def get_data_parallel_world_size(self) -> int:
        return len(self.client_ranks)

    def get_data_parallel_rank(self) -> int:
        return self.client_ranks.index(dist.get_rank())

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.client_ranks)

    def get_model_parallel_group(self):
        return self.single_group

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0


def initialize(model, optimizer, ds_config: dict, mpu: ClientMPU):
    """deepspeed.initialize with DECA's optimizer; returns the engine (the optimizer is not wrapped)."""
    import deepspeed

    engine, engine_optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=ds_config, mpu=mpu)
    # With one rank per client the all-reduce is an identity that still copies the active
    # block's gradient into flat bf16 and fp32 buffers; skip it.
    engine.enable_backward_allreduce = mpu.get_data_parallel_world_size() > 1
    if engine_optimizer is not optimizer:
        raise RuntimeError("DeepSpeed wrapped the DECA optimizer; check the config for precision/ZeRO keys")
    return engine
