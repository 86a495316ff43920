"""A small Llama that is not random: trained briefly and centrally as a language model on the
unlabelled prompts of a task's training split (never its answers, never the test split), saved as a
normal Hugging Face checkpoint with its tokenizer, so the grid can fine-tune it like any local model.

The tokenizer is word-level (deca_ds.data.build_word_tokenizer) over the `vocab_size` most frequent
words of those prompts, plus the label words and the prompt template's words; anything else reads
as <unk>. The prompts are joined with eos and cut into `seq_len`-token rows (packing).

Words the text never shows (the label words of the synthetic task, 'Sci/Tech' of AG News) are left
out of the softmax, so their embedding and LM-head rows keep their initial values: otherwise every
step pushes their logits down along one shared direction and their head rows end up nearly parallel
(cosine 0.85 between the synthetic task's label rows), which a fine-tuning that keeps the head
frozen, as DECA's blocks do, cannot separate; every method's consensus model then stayed at chance
predicting one class. The initializer range is TINY_LLAMA's 0.1 for the same frozen head.

The checkpoint appears whole or not at all (written beside its directory, then renamed into place),
and never over files already there. Its pretrain.json records the options it was trained with (a
grid file's `pretrain` section, deca_ds.reproduce.grid, thereby tells its own checkpoint, made
earlier, from one made otherwise) and the sha256 of its weights.

Pretraining runs torch's deterministic kernels (a warning names any op that has none), so the same
options give the same weights again on the same device type and software: a grid split over
machines, or over days on a GPU lent for minutes, fine-tunes one base model. Where the weights do
differ, the grid's cells tell (each records the hash of the base it fine-tuned).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from ..data import PROMPT, SyntheticTask, build_word_tokenizer
from ..datasets import verbalize
from ..files import atomic_directory, remove_leftovers, sha256, vacant, write_json
from ..reporting import cpu_kernels, invocation, kernels_of
from ..runtime.options import KEY_PATH, PATH, RunOptions, expand_paths, per_client
from ..runtime.parsing import add_option
from ..runtime.rank import to_device
from ..runtime.task import DATASETS, load_records

SMALL_LLAMA = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                   initializer_range=0.1)
# The config keys the tokenizer decides (--vocab-size for the vocabulary), not --model
FROM_TOKENIZER = ("vocab_size", "pad_token_id", "eos_token_id", "bos_token_id")
SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
         "max_position_embeddings")


def check_model(model: dict) -> None:
    """`model` (SMALL_LLAMA with the --model overrides) as a Llama config takes it, refused before
    any text is read: a key LlamaConfig does not define (it would keep a misspelt one as an unused
    attribute), one the tokenizer decides, a size that is not a positive integer, or what
    LlamaConfig's own checks refuse (heads that do not divide the width)."""
    import difflib

    known = set(LlamaConfig().to_dict()) - set(FROM_TOKENIZER)
    for key in sorted(set(model) - known):
        if key in FROM_TOKENIZER:
            raise ValueError(f"model: {key} comes from the tokenizer (--vocab-size sets the vocabulary)")
        close = difflib.get_close_matches(key, known, n=1)
        raise ValueError(f"model: unknown Llama config key {key!r}{f' (did you mean {close[0]!r}?)' if close else ''}")
    for key in SIZES:
        if not isinstance(model[key], int) or isinstance(model[key], bool) or model[key] < 1:
            raise ValueError(f"model: {key} must be an integer >= 1, got {model[key]!r}")
    try:
        LlamaConfig(**model)
    except Exception as err:  # huggingface_hub's validation error, which holds LlamaConfig's own as its cause
        raise ValueError(f"model: {err.__cause__ or err}") from None


def _opt(default, help: str, **extra):
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class PretrainOptions:
    """deca-pretrain's options: its command line, and a grid file's `pretrain` section."""

    output_dir: str = field(metadata={"help": "where the checkpoint and its tokenizer go (a new directory)",
                                      "path": PATH})
    dataset: str = _opt("synthetic", "the task whose training prompts are read, as deca-train's --dataset",
                        choices=DATASETS)
    data_files: list[str] | None = _opt(None, "local data as train=PATH [test=PATH], as deca-train's (only the "
                                        "training split's prompts are read)", path=KEY_PATH)
    vocab_size: int = _opt(8000, "most frequent training words kept, besides the specials, the label words and the "
                           "prompt template's")
    seq_len: int = _opt(64, "tokens per row (the prompts are joined with eos and cut into rows)")
    batch: int = _opt(32, "rows per step")
    steps: int = _opt(300, "AdamW steps")
    lr: float = _opt(3e-3, "peak learning rate: linear warmup, then cosine to zero")
    warmup: int = _opt(20, "warmup steps")
    seed: int = _opt(0, "seed of the model's init and of the rows drawn")
    device: str = _opt("auto", "auto (the first GPU if one is visible, else the CPU), cpu, cuda or cuda:N")
    dtype: str = _opt("fp32", "bf16: forward and loss under bf16 autocast (the weights and AdamW stay fp32)",
                      choices=("fp32", "bf16"))
    model: dict = field(default_factory=dict, metadata={  # merged into SMALL_LLAMA when checked
        "help": f"overrides of the Llama config {json.dumps(SMALL_LLAMA, allow_nan=False)}, "
                "e.g. '{\"hidden_size\": 256}'"})

    def __post_init__(self) -> None:
        expand_paths(self)
        self.model = {**SMALL_LLAMA, **self.model}
        check_model(self.model)
        # a row's loss predicts each of its tokens from those before it: a row of one token predicts none
        for name, least in (("vocab_size", 1), ("seq_len", 2), ("batch", 1), ("steps", 1), ("seed", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}, got {getattr(self, name)}")
        if not 0 < self.lr < math.inf:
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.warmup > self.steps:
            raise ValueError(f"warmup ({self.warmup}) is longer than steps ({self.steps}): the learning rate would "
                             "never reach its peak; give a warmup of at most the steps")
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"dtype must be fp32 or bf16, got {self.dtype!r}")
        if self.seq_len > self.model["max_position_embeddings"]:
            raise ValueError(f"seq_len {self.seq_len} exceeds the model's max_position_embeddings")
        # the task options are deca-train's: RunOptions checks them (dataset name, data_files form)
        if any(per_client(item.split("=", 1)[-1]) for item in self.data_files or ()):
            raise ValueError("pretraining reads one training file: --data-files train=…{client}… names each "
                             "client's own")
        RunOptions(dataset=self.dataset, data_files=self.data_files)
        self.torch_device()

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(self.device)
        except RuntimeError:
            device = None
        if device is None or device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device}: no GPU is visible to torch")
        return device


WEIGHTS = "model.safetensors"  # save_pretrained's file for a model of this size (one shard)
# Where the model is written and which device trains it: not what it is.
NOT_RECIPE = ("output_dir", "device")


def recipe(options: dict) -> dict:
    """What decides a pretrained model, from PretrainOptions as a dict (or a pretrain.json's
    "options"), flat: the model's keys as model.<key>. An option a record predates reads as its
    default."""
    flat = {}
    for f in fields(PretrainOptions):
        if f.name in NOT_RECIPE:
            continue
        value = options.get(f.name, f.default if f.default is not MISSING else f.default_factory())
        if f.name == "model":
            flat |= {f"model.{k}": v for k, v in {**SMALL_LLAMA, **value}.items()}
        else:
            flat[f.name] = value
    return json.loads(json.dumps(flat, allow_nan=False))  # as a record reads back: lists, not tuples


def pretrained_state(opts: PretrainOptions) -> str:
    """'pretrained' when opts.output_dir holds the checkpoint pretrain() made with these options,
    'to pretrain' when it is absent or empty. ValueError for anything else, naming it: such a
    directory is neither fine-tuned in place of this recipe's model nor overwritten."""
    out = Path(opts.output_dir)
    if vacant(out):
        return "to pretrain"
    record = out / "pretrain.json"
    if not record.is_file():
        raise ValueError(f"{out} holds files but no pretrain.json: not a checkpoint deca-pretrain made, so it "
                         "is neither used as this pretraining's output nor overwritten; give the model another "
                         "directory, or drop `pretrain` to fine-tune that one as it is")
    old, new = recipe(json.loads(record.read_text())["options"]), recipe(asdict(opts))
    changed = [f"{k}: {old.get(k)!r} -> {new[k]!r}" for k in new if old.get(k) != new[k]]
    if changed:
        raise ValueError(f"{out} was pretrained with other settings ({'; '.join(changed)}); give the model another "
                         "directory, or remove that one to pretrain it again")
    return "pretrained"


def kernels_note(output_dir: str) -> str | None:
    """A note where the model in output_dir was pretrained on CPU with other vector kernels than
    this process runs (its pretrain.json's provenance names them since ccf8d7e), else None. Those
    kernels decide a CPU-pretrained base's bits (docs/reproduce.md): the cells fine-tune that base
    as it is, and do not repeat the results of a base these kernels pretrain."""
    device = json.loads((Path(output_dir) / "pretrain.json").read_text()).get("provenance", {}).get("device", "")
    made, here = kernels_of(device), cpu_kernels()
    if made in (None, here):
        return None
    return (f"note: {output_dir} was pretrained with {made} CPU kernels, not the {here} ones this process runs "
            "(ATEN_CPU_CAPABILITY): its cells fine-tune those weights as they are, which a base pretrained here "
            "would not repeat to the bit (docs/reproduce.md)")


def training_text(opts: PretrainOptions) -> tuple[list[str], list[str]]:
    """(the training split's prompts without answers, words the tokenizer must hold: labels and template)."""
    run = RunOptions(dataset=opts.dataset, data_files=opts.data_files, seed=opts.seed)
    if opts.dataset == "synthetic":
        task = SyntheticTask(seed=opts.seed, words_per_example=run.synthetic_words)
        train, _ = task.generate()
        return [PROMPT.format(text=ex.text) for ex in train], [*PROMPT.format(text="").split(), *task.label_words]
    loaded = load_records(run)
    names = loaded.spec.label_names or ()
    return [r.prompt for r in loaded.train], [w for name in names for w in verbalize(name).split()]


def build_tokenizer(prompts: list[str], keep: list[str], vocab_size: int):
    counts = Counter(word for p in prompts for word in p.split())
    words = [w for w, _ in counts.most_common(vocab_size)]
    return build_word_tokenizer([*words, *keep])


def packed_rows(tokenizer, prompts: list[str], seq_len: int) -> torch.Tensor:
    ids: list[int] = []
    for p in prompts:
        ids += tokenizer(p, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    n = len(ids) // seq_len
    if n < 1:
        raise ValueError(f"the training text holds {len(ids)} tokens, fewer than one row of {seq_len}")
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)


def pretrain(opts: PretrainOptions, *, log=print, command: list[str] | None = None) -> dict:
    """Train and save; returns what was written to pretrain.json (loss curve, sizes, wall time).
    Refuses, before training, an output directory that already holds files."""
    from .report import provenance  # report reads the grid, whose `pretrain` section is PretrainOptions

    out = Path(opts.output_dir)
    if not vacant(out):
        raise ValueError(f"{out} already holds files; pretraining writes a new checkpoint and never writes over "
                         "one: give another output directory")
    remove_leftovers(out, say=log)
    start = time.perf_counter()
    prompts, keep = training_text(opts)
    tokenizer = build_tokenizer(prompts, keep, opts.vocab_size)
    device = opts.torch_device()
    rows = packed_rows(tokenizer, prompts, opts.seq_len).to(device)
    torch.manual_seed(opts.seed)
    model = LlamaForCausalLM(LlamaConfig(**opts.model, vocab_size=len(tokenizer),
                                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                         bos_token_id=None)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=0.01)
    # linear warmup, then cosine to zero
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, opts.warmup)) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / opts.steps))))
    generator = torch.Generator().manual_seed(opts.seed)  # on the CPU: the same rows on any device
    losses = []
    model.train()
    unseen = torch.ones(len(tokenizer), dtype=torch.bool, device=device)
    unseen[rows.unique()] = False
    with _deterministic(device):
        for step in range(opts.steps):
            batch = rows[to_device(torch.randint(len(rows), (opts.batch,), generator=generator), device)]
            with torch.autocast(device.type, torch.bfloat16, enabled=opts.dtype == "bf16"):
                logits = model(input_ids=batch).logits[:, :-1].masked_fill(unseen, float("-inf"))
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())  # read at the end: .item() would wait for each step
            if step % 50 == 0 or step == opts.steps - 1:
                log(f"step {step}: loss {loss.item():.4f}")
    losses = torch.stack(losses).tolist()
    bad = next((step for step, loss in enumerate(losses) if not math.isfinite(loss)), None)
    if bad is not None:
        raise ValueError(f"pretraining diverged: loss {losses[bad]} at step {bad} of {opts.steps}; nothing was "
                         "written (a smaller lr, or a longer warmup)")
    report = {"options": asdict(opts), "vocab": len(tokenizer), "unseen_words": int(unseen.sum()),
              "rows": len(rows), "prompts": len(prompts),
              "params": sum(p.numel() for p in model.parameters()), "loss_first": losses[0],
              "loss_last10": sum(losses[-10:]) / len(losses[-10:]), "losses": losses,
              "wall_s": time.perf_counter() - start, "provenance": provenance(command)}
    _save(out, model, tokenizer, report)
    # The allocator would keep this memory cached while a grid's cells, other processes, use the GPU.
    del model, optimizer, schedule, rows, batch, logits, loss
    if device.type == "cuda":
        torch.cuda.empty_cache()
    log(f"wrote {out} ({report['params']:,} parameters, vocabulary {report['vocab']}, "
        f"loss {report['loss_first']:.3f} -> {report['loss_last10']:.3f}, {report['wall_s']:.0f} s)")
    return report


@contextmanager
def _deterministic(device: torch.device):
    """torch's deterministic kernels, warning for an op that has none; cuBLAS needs a fixed
    workspace for them (CUBLAS_WORKSPACE_CONFIG, read when this process first uses cuBLAS: a grid's
    pretraining comes before any other GPU work of its process). Both restored afterwards."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if device.type == "cuda" and workspace is None:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def _save(out: Path, model, tokenizer, report: dict) -> None:
    """The checkpoint, its tokenizer and pretrain.json (the report, plus the weights' sha256),
    whole or not at all (an empty `out` is replaced)."""
    with atomic_directory(out) as partial:
        model.save_pretrained(partial, safe_serialization=True)
        report["weights_sha256"] = sha256(partial / WEIGHTS)
        tokenizer.save_pretrained(partial)
        write_json(partial / "pretrain.json", report)


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="deca-pretrain", description=__doc__.split("\n\n")[0])
    for f in fields(PretrainOptions):
        add_option(p, f, cls=PretrainOptions)
    args = vars(p.parse_args(argv))
    command = invocation("deca-pretrain", argv)
    try:
        pretrain(PretrainOptions(**args), command=command)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
