"""deca-train: decentralized fine-tuning with DECA, one client per rank group.

    deepspeed --num_gpus 8 --module deca_ds.train --config run.yaml
    torchrun --nproc-per-node 4 -m deca_ds.train --preset cpu_demo      # or: torchrun --no-python deca-train
    deca-train --preset cpu_demo                                        # no launcher: one rank, one client
    deca-train --config run.yaml --print-config                         # the resolved config, as a run file
    deca-train --config run.yaml --clients 8 --estimate                 # one client's estimated GPU memory
    deca-train --config run.yaml --fetch                                # its hub model and task, for offline runs

The command line is parsed (and `--help` / `--print-config` answered) before torch, transformers
or deepspeed are imported; the trainer loads only when there is something to train.
"""

from __future__ import annotations

import os
import sys
import traceback

from .runtime import cleanup
from .runtime.parsing import build_parser, dump_config, resolve

# How long at most rank 0, failing because of a peer, keeps the rendezvous store up for the others
# to read the heartbeat board (they post their own failure within a few step times).
STORE_LINGER_S = 10.0


def _fail(err: Exception, *, peer: bool = False) -> None:
    rank = os.environ.get("RANK", "0")
    # on a line of its own: the progress bar leaves its line open
    print(f"\n[rank {rank}] error: {err}", file=sys.stderr, flush=True)
    if cleanup.installed():  # a rank process: exit now, whatever a destructor would wait for
        if rank == "0" and peer:
            cleanup.linger(STORE_LINGER_S)  # the rendezvous store lives here: the others read the board from it
        cleanup.exit_now(1)
    sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    """The command (argv None: this process is a rank, reading sys.argv) or an in-process call
    with `argv` (tests), which leaves signals and the process's exit to the caller."""
    if argv is None:
        # first: resolving the options imports torch, which starts threads, and every thread must
        # inherit the blocked SIGTERM (runtime/cleanup.py) or the launcher's SIGTERM kills unheard
        cleanup.install()
    args = build_parser().parse_args(argv)
    try:
        opts, ds_config = resolve(args)
    except ValueError as err:
        _fail(err)
    if args.print_config:
        print(dump_config(opts, ds_config), end="")
        return
    if args.estimate or args.fetch:
        from dataclasses import asdict

        from .runtime import fetch, footprint

        try:
            if args.estimate:
                footprint.main(opts, ds_config)
            else:
                fetch.fetch_hub([asdict(opts)])
        except ValueError as err:
            _fail(err)
        return
    import torch

    from .runtime.dist import PeerError
    from .runtime.trainer import train

    try:
        train(opts, ds_config)
    except (ValueError, PeerError) as err:
        _fail(err, peer=isinstance(err, PeerError))
    except torch.OutOfMemoryError as err:  # the answer --gpu-memory-gb asks for, or a card too small
        where = (f"within --gpu-memory-gb {opts.gpu_memory_gb:g}: it does not fit a card with that much room"
                 if opts.gpu_memory_gb else "on this GPU")
        lower = ("--offload frozen, --loss-chunk or a smaller micro-batch lower it" if opts.method == "deca" else
                 "--loss-chunk or a smaller micro-batch lower it; only DECA offloads frozen layers")
        _fail(RuntimeError(f"out of GPU memory {where} (--estimate gives this run's estimated peak; {lower}). "
                           f"{str(err).splitlines()[0]}"))
    except KeyboardInterrupt:  # Ctrl-C, which a terminal sends every rank of the job
        if not cleanup.installed():
            raise
        note = cleanup.resume_note()
        print(f"\n[rank {os.environ.get('RANK', '0')}] interrupted (Ctrl-C)" + (f": {note}" if note else ""),
              file=sys.stderr, flush=True)
        cleanup.exit_now(130)
    except Exception:  # a traceback, then out at once (the expected errors are reported above)
        if not cleanup.installed():
            raise
        traceback.print_exc()
        cleanup.exit_now(1)
    if cleanup.installed():
        # Finished: every output closed and the process groups destroyed (Job.finish). Out without the
        # interpreter's teardown, in which a native thread left joinable aborted a finished CPU rank once
        # ("terminate called without an active exception", SIGABRT), and the launcher failed the run.
        cleanup.exit_now(0)


if __name__ == "__main__":
    main()
