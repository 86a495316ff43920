"""Tiny models and data shared by the tests (no network: everything is built from configs)."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import runpy
import sys
import threading
import weakref
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from deca_ds.data import token_range_batches
from deca_ds.files import current_umask
from deca_ds.runtime.outputs import RUN_OUTPUTS

# 8-bit moments (state_bits 8) need the optional bnb extra; CI installs it, a plain install does not
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
needs_bnb = pytest.mark.skipif(not HAS_BNB, reason="the optional bnb extra is not installed")

VOCAB = 64


def assert_umask_modes(directory: Path) -> None:
    """Every file under `directory` has the mode this process's umask gives a new file (the ranks a
    test starts inherit it): a model or checkpoint a run writes is as readable as its other files."""
    mask = current_umask()
    modes = {str(p.relative_to(directory)): oct(p.stat().st_mode & 0o777) for p in directory.rglob("*") if p.is_file()}
    assert modes and set(modes.values()) == {oct(0o666 & ~mask)}, modes


def assert_only_run_outputs(out: Path) -> None:
    """What a run wrote into its output directory is all in RUN_OUTPUTS, the entries --overwrite
    removes and refuses to write over in a directory that holds no run (a user's files)."""
    written = sorted(p.name for p in out.iterdir())
    assert set(written) <= set(RUN_OUTPUTS), sorted(set(written) - set(RUN_OUTPUTS))

# Torch threads of every rank a test starts (DECA_RANK_THREADS) and of the simulator it is compared
# with: CPU matmuls round differently at another count, and Adam amplifies that past the 1e-6 bounds.
RANK_THREADS = 1


@contextlib.contextmanager
def torch_threads(n: int = RANK_THREADS):
    """Run the body at `n` torch threads, then restore the count."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tiny_llama(layers: int = 3, hidden: int = 32, dtype: torch.dtype = torch.float64, seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
        max_position_embeddings=64, tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(dtype)


def saved_bytes(model, batch, forward=lambda model, batch: model(**batch)) -> int:
    """Bytes of the distinct non-parameter storages autograd still holds after `forward` (default:
    the model's own, its loss over every labelled position)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    refs = []

    def pack(t):
        refs.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward(model, batch)
    alive = {}
    for r in refs:
        t = r()
        if t is not None and t.untyped_storage().data_ptr() not in params:
            alive[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    del out
    return sum(alive.values())


def client_batches(n_clients: int, steps: int, batch: int = 2, seq: int = 8, seed: int = 1) -> list[list[dict]]:
    """deca_ds.data.token_range_batches over the tiny Llama's vocabulary."""
    return token_range_batches(n_clients, steps, VOCAB, batch=batch, seq=seq, seed=seed)


def assert_resume_mid_block_is_bit_identical(base, cfg, checkpoint) -> None:
    """12 steps of a DecaOptimizer straight, against 6 steps, a checkpoint (`checkpoint` takes and
    returns the model's and the optimizer's state dicts), a rebuilt model and optimizer that load
    it, and the 6 steps left: the same bits. Block 1, step 2 of 4 at the cut (steps_per_block 4)."""
    from deca_ds import DecaOptimizer

    batches = client_batches(1, steps=12)[0]

    def run(model, opt, steps):
        for batch in steps:
            model(**batch).loss.backward()
            opt.step()

    straight = copy.deepcopy(base)
    run(straight, DecaOptimizer(straight, cfg), batches)
    first = copy.deepcopy(base)
    opt = DecaOptimizer(first, cfg)
    run(first, opt, batches[:6])
    model_state, opt_state = checkpoint(first.state_dict(), opt.state_dict())
    resumed = copy.deepcopy(base)
    resumed.load_state_dict(model_state)
    opt2 = DecaOptimizer(resumed, cfg)
    opt2.load_state_dict(opt_state)
    assert (opt2.active.index, opt2.step_in_block) == (1, 2)
    assert opt2.state_bytes() == opt.state_bytes()
    run(resumed, opt2, batches[6:])
    for (n, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), n


def exit_status(done: SystemExit) -> int:
    """The status the interpreter exits with on `done`: None is 0, a message is printed and is 1."""
    if done.code is None or isinstance(done.code, int):
        return done.code or 0
    print(done.code, file=sys.stderr)
    return 1


def run_script(path: Path, *args: str) -> int:
    """`python path args` in this process (the script's __main__ block, its folder first on the
    path), without a new interpreter's imports; its exit status."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", [str(path), *args])
        mp.syspath_prepend(str(path.parent))
        try:
            runpy.run_path(str(path), run_name="__main__")
        except SystemExit as done:
            return exit_status(done)
    return 0


def run_script_in_fork(rank: int, path: Path, *args: str) -> int:
    """run_script in a forked process (ranks.run_on_ranks), for a script that changes process-wide state."""
    return run_script(path, *args)


def descendants(pid: int, marker: str, *, recursive: bool = True) -> list:
    """The processes below `pid` (psutil; its children only unless `recursive`) whose command line
    holds `marker`. A short-lived helper (lscpu, say) may end between the listing and the read of
    its command line: it is passed over."""
    import psutil

    found = []
    for p in psutil.Process(pid).children(recursive=recursive):
        try:
            if marker in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            pass
    return found


# ---- each client's own data file (--data-files train=…{client}…) ------------------------------

SITE_LABELS = ("Business", "Sports", "Tech", "World")  # sorted: string labels are named in sorted order


def client_rows(client: int, n: int) -> list[dict]:
    """`n` labelled rows for `client`, skewed: three in four carry label `client` mod 4, the rest the next label."""
    rows = []
    for i in range(n):
        k = (client + (i % 4 == 3)) % len(SITE_LABELS)
        rows.append({"text": " ".join(f"w{k}_{(i * 7 + j) % 5}" for j in range(4)), "label": SITE_LABELS[k]})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_site(root: Path, clients: list[int], sizes: dict[int, int]) -> Path:
    """A site's folder as a user would lay it out: data/client_<c>.jsonl for its own clients only,
    data/test.jsonl (every label, the same at every site) and model/, a tiny Llama whose
    word-level tokenizer knows every word of the task (the same at every site)."""
    from deca_ds.data import build_word_tokenizer
    from deca_ds.datasets import load_task, vocabulary
    from deca_ds.models import tiny_llama as deca_tiny_llama

    for c in clients:
        write_jsonl(root / "data" / f"client_{c}.jsonl", client_rows(c, sizes[c]))
    test = write_jsonl(root / "data" / "test.jsonl", [r for c in range(4) for r in client_rows(c, 4)])
    loaded = load_task(data_files={"train": str(test), "test": str(test)})  # the test rows hold every word
    tokenizer = build_word_tokenizer(vocabulary(loaded.test, loaded.spec.label_names))
    deca_tiny_llama(len(tokenizer), seed=0).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return root


JUDGE_KEY = "sk-test-SECRET-1234567890"  # conftest's `judges` sets JUDGE_KEY to it


class Judge:
    """A server on 127.0.0.1 that answers each request with the next of `script`: an int is that
    HTTP status (an error), a (code, location) pair a redirect, a str a judgment."""

    def __init__(self, script=()):
        self.script, self.seen = list(script), []
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def handle_any(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                judge.seen.append({"method": self.command, "path": self.path,
                                   "auth": self.headers.get("Authorization"), "body": body})
                step = judge.script.pop(0) if judge.script else "Fine. Rating: [[7]]"
                if isinstance(step, tuple):
                    self.send_response(step[0])
                    self.send_header("Location", step[1])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if isinstance(step, int):
                    reply, code = b'{"error": "busy"}', step
                else:
                    code = 200
                    reply = json.dumps({"choices": [{"message": {"role": "assistant", "content": step}}]}).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            do_POST = do_GET = handle_any

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
