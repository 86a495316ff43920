"""The one place that touches DeepSpeed: the per-client mpu and initialize (presets are validated
in presets.py, before anything starts).

DeepSpeed gets DecaOptimizer as its client optimizer and, through `mpu`, the client's own ranks
as its data-parallel group, so it averages gradients inside a client and never across clients.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist


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


def initialize(model, optimizer, ds_config: dict, mpu: ClientMPU, device: torch.device):
    """deepspeed.initialize with DECA's optimizer on this rank's `device`; returns the engine (the
    optimizer is not wrapped)."""
    import deepspeed

    if device.type == "cpu":
        from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

        # DeepSpeed's CPU communication backend builds a C++ op of its own at its first use on a
        # machine (some 40 s, with a compiler) and maps a 66 MB /dev/shm buffer per rank, for an
        # inference all-reduce deca-ds never calls (every collective of ours is torch.distributed's).
        # Marked incompatible (DeepSpeed keeps this dict for such edits), it builds and maps nothing.
        deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
    # DeepSpeed selects GPU LOCAL_RANK unless told the device: with several ranks per GPU
    # (transport.gpu_of) local rank 1 is not GPU 1.
    args = SimpleNamespace(device_rank=device.index) if device.type == "cuda" else None
    # DeepSpeed's throughput timer synchronizes the device as each forward starts and each step
    # ends, for a samples/s line the trainer's own records replace; off, the host can run ahead
    # (--phase-timing events).
    config = {**ds_config, "timers": {"throughput": {"enabled": False}}}
    engine, engine_optimizer, _, _ = deepspeed.initialize(
        args=args, model=model, optimizer=optimizer, config=config, mpu=mpu)
    # With one rank per client the all-reduce is an identity that still copies the active
    # block's gradient into flat bf16 and fp32 buffers; skip it.
    engine.enable_backward_allreduce = mpu.get_data_parallel_world_size() > 1
    # After each step the engine clears gradients by walking every parameter of every module
    # (DeepSpeedEngine.zero_grad), host time that grows with the model's modules and counts in Agg &
    # Up beside an update that takes milliseconds; only the optimizer's parameters can have one.
    engine.zero_grad = lambda: optimizer.zero_grad(set_to_none=True)
    if engine_optimizer is not optimizer:
        raise RuntimeError("DeepSpeed wrapped the DECA optimizer; check the config for precision/ZeRO keys")
    return engine
