"""The end of a run on rank 0: every client's metrics gathered over the process group (no shared
file system needed), the summary (summary.json, summary.md, the loss curve) once x̄ is scored,
and --questions' answers."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from ..evaluation import answer_sets
from ..files import write_json, write_text
from .allocated import DeviceMemory
from .dist import ClientLayout
from .metrics import plot_losses, read_client_metrics, summarize, summary_table
from .options import RunOptions
from .task import Task


def gather_metrics(out: Path, layout: ClientLayout) -> list[list[dict]] | None:
    """Every client's metrics records, on rank 0 (None elsewhere): each client's first rank reads
    the file it wrote on its own node and sends it over the process group, so the summary needs no
    shared file system."""
    mine = read_client_metrics(out, layout.client) if layout.local_rank == 0 else None
    gathered = [None] * layout.world_size if layout.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    return gathered[::layout.ranks_per_client] if layout.rank == 0 else None


def answer_questions(out: Path, model, task: Task, opts: RunOptions, summary: dict) -> None:
    """--questions, on rank 0 once the process group is gone: x̄ answers each set into
    answers/NAME.jsonl, and summary.json gains the counts and ROUGE-L (`consensus_answers`)."""
    summary["consensus_answers"] = answer_sets(model, task.tokenizer, opts.question_sets(), out / "answers",
                                               max_new_tokens=opts.max_new_tokens)
    write_json(out / "summary.json", summary)
    for name, answered in summary["consensus_answers"].items():
        print(f"consensus model: answered {answered['questions']} questions ({answered['turns']} turns) of {name} "
              f"in {out / 'answers' / (name + '.jsonl')}"
              + (f", ROUGE-L {answered['rouge_l']:.3f}" if "rouge_l" in answered else ""))


def final_report(out: Path, model, task: Task, opts: RunOptions, records: list[list[dict]],
                 distances: list[float], placement: dict, end_peaks: list[int | None],
                 memory: DeviceMemory) -> dict:
    """The run's summary (summary.json, .md, the loss curve), after x̄'s evaluation. `end_peaks`:
    each client's tensor memory peak after its last step (None where not counted), rank 0's here
    with the evaluation it runs."""
    summary = summarize(records)
    evaluation = task.evaluate(model, opts.eval_limit or None)
    if memory.counted:
        end_peaks = [memory.peak(), *end_peaks[1:]]
    summary.update(consensus_eval=evaluation, final_consensus_distance=distances, mem_end_peak=end_peaks,
                   nonfinite_skipped=max((r.get("nonfinite_skipped", 0) for c in records for r in c), default=0),
                   bytes_sent_total=sum(c["bytes_sent"] for c in summary["clients"]), **placement)
    plot_losses(records, out / "loss_curve.png", title=opts.method)
    table = summary_table(summary)
    write_text(out / "summary.md", table)
    write_json(out / "summary.json", summary)
    c = summary["clients"]
    print("\n" + table)
    print(f"loss (mean over clients): start {sum(x['loss_start'] for x in c) / len(c):.4f} -> "
          f"end {sum(x['loss_end'] for x in c) / len(c):.4f}")
    if evaluation:
        print(f"consensus model: accuracy {evaluation['accuracy']:.3f} (chance {evaluation['chance']:.3f}), "
              f"macro-F1 {evaluation['macro_f1']:.3f} on {evaluation['n']} held-out examples")
    print("final consensus distance ||x_i - x̄|| per client: " + ", ".join(f"{d:.4g}" for d in distances))
    print(f"bytes sent (all clients): {summary['bytes_sent_total'] / 1e6:.2f} MB over {placement['transport']}"
          + (" (staged through host memory)" if placement["host_staging"] else ""))
    if any(k > 1 for k in placement["clients_per_gpu"].values()):
        print("clients per GPU: " + ", ".join(f"GPU {g}: {k}" for g, k in placement["clients_per_gpu"].items())
              + " (they time-share it: step times are not one-GPU-per-client figures)")
    print(f"step time split (mean over clients): forward {sum(x['forward_ms'] for x in c) / len(c):.1f} ms, "
          f"backward {sum(x['backward_ms'] for x in c) / len(c):.1f} ms, "
          f"mixing+update {sum(x['mix_update_ms'] for x in c) / len(c):.2f} ms")
    print(f"outputs: {out} (consensus/, metrics/, loss_curve.png, summary.json)")
    return summary
