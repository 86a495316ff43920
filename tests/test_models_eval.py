"""Model loading (tiny, local checkpoint, bare config), compiled decoder layers and likelihood-based
classification."""

import os

import numpy as np
import pytest
import torch
from sklearn.metrics import accuracy_score, f1_score
from transformers import LlamaConfig, LlamaForCausalLM

from deca_ds.data import PROMPT, ClientStream, SyntheticTask, build_word_tokenizer, encode_examples
from deca_ds.evaluation import classification_metrics, evaluate_classification, score_labels
from deca_ds.models import load_model, load_tokenizer, tiny_llama

TASK = SyntheticTask()


@pytest.fixture(scope="module")
def tokenizer():
    return build_word_tokenizer(TASK.vocabulary())


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_tiny_llama_is_deterministic_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a, b = tiny_llama(50, seed=3), tiny_llama(50, seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    assert _same_weights(a, b)
    assert not _same_weights(a, tiny_llama(50, seed=4))
    assert a.config.vocab_size == 50 and a.config._attn_implementation == "eager"
    assert a.lm_head.weight is not a.model.embed_tokens.weight
    bf16 = tiny_llama(50, dtype=torch.bfloat16, num_hidden_layers=2)
    assert bf16.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16


def test_load_tiny(tokenizer):
    model = load_model("tiny", dtype=torch.float32, vocab_size=len(tokenizer), seed=1)
    assert _same_weights(model, tiny_llama(len(tokenizer), seed=1))
    with pytest.raises(ValueError, match="vocab_size"):
        load_model("tiny", dtype=torch.float32)


def test_local_checkpoint_round_trips(tmp_path, tokenizer):
    model = tiny_llama(len(tokenizer), seed=5, num_hidden_layers=2)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = load_model(str(tmp_path), dtype=torch.float32)
    assert isinstance(loaded, LlamaForCausalLM) and _same_weights(model, loaded)
    # in the attention it was saved with (a config.json does not record it), it computes as the saved model
    eager = load_model(str(tmp_path), dtype=torch.float32, attention="eager").eval()
    ids = torch.tensor([[3, 5, 7, 9, 11, 2], [4, 6, 8, 2, 2, 2]])
    with torch.no_grad():
        logits = [m(input_ids=ids, attention_mask=(ids != 2).long()).logits for m in (model.eval(), eager)]
    assert torch.equal(*logits)
    assert load_tokenizer(str(tmp_path)).pad_token_id == tokenizer.pad_token_id


def test_load_tokenizer_pads_with_eos(tmp_path, tokenizer):
    tokenizer.save_pretrained(tmp_path)
    config = tmp_path / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"pad_token": "<pad>"', '"pad_token": null'))
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token == loaded.eos_token == "<eos>"


def test_from_config_builds_the_architecture(tmp_path):
    LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=40).to_json_file(tmp_path / "config.json")
    for path in (tmp_path / "config.json", tmp_path):
        model = load_model(str(path), dtype=torch.bfloat16, from_config=True, seed=2)
        assert isinstance(model, LlamaForCausalLM)
        assert len(model.model.layers) == 3 and model.lm_head.weight.shape == (40, 48)
        assert model.lm_head.weight.dtype == torch.bfloat16
    assert _same_weights(model, load_model(str(tmp_path), dtype=torch.bfloat16, from_config=True, seed=2))


def test_a_drawn_model_is_transformers_initialisation_in_one_pass(tmp_path):
    """draw_from_config (every --from-config run): transformers' own initialisation, each module
    drawn in turn, in one pass: the norms and rotary frequencies equal to transformers' own start,
    every weight of its shape, dtype and spread, the LM head tied where the config ties it. Built
    in host memory (--offload frozen) it draws the weights a model built on the device draws, and
    the caller's random numbers are left alone."""
    from deca_ds.models import _from_config, draw_from_config

    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True)
    state = torch.get_rng_state()
    drawn = draw_from_config(config, dtype=torch.bfloat16, seed=5, device="cpu")
    assert torch.equal(torch.get_rng_state(), state)
    theirs = _from_config(config, dtype=torch.bfloat16, seed=5).state_dict()
    ours, other = drawn.state_dict(), draw_from_config(config, dtype=torch.bfloat16, seed=6, device="cpu").state_dict()
    assert ours.keys() == theirs.keys() and drawn.lm_head.weight is drawn.model.embed_tokens.weight
    for name, t in ours.items():
        assert t.shape == theirs[name].shape and t.dtype == theirs[name].dtype, name
        if name.endswith("norm.weight"):
            assert torch.equal(t, torch.ones_like(t)), name
        else:
            assert t.float().std().item() == pytest.approx(config.initializer_range, rel=0.1), name
            assert not torch.equal(t, other[name]), name
    theirs_buffers = dict(_from_config(config, dtype=torch.bfloat16, seed=5).named_buffers())
    assert all(torch.equal(b, theirs_buffers[name]) for name, b in drawn.named_buffers())  # the rotary frequencies

    config.tie_word_embeddings = False
    config.to_json_file(tmp_path / "config.json")
    resident = load_model(str(tmp_path), dtype=torch.bfloat16, from_config=True, seed=5)
    assert _same_weights(resident, load_model(str(tmp_path), dtype=torch.bfloat16, from_config=True, seed=5,
                                              host_memory=True))
    assert resident.lm_head.weight is not resident.model.embed_tokens.weight


def test_a_local_models_own_code_runs_only_when_trusted(tmp_path):
    """deca-train, deca-eval and --estimate read a model's config before its weights load: a local
    model directory with code of its own (auto_map, a model_type transformers does not know) is read
    with --trust-remote-code, and without it refused without running the code. Its --estimate is
    that of the same architecture without code of its own. It trains: the consensus export carries
    the model's code, and deca-eval runs it only when asked to, scoring what the run scored. In a
    process of its own, whose Hugging Face module cache (where transformers copies the code) is the
    test's."""
    import json
    import subprocess
    import sys

    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "max_position_embeddings": 96, "vocab_size": 80}
    custom, plain = tmp_path / "custom", tmp_path / "plain"
    for d in (custom, plain):
        d.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "llama", **shape}))
    (custom / "configuration_custom.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass CustomConfig(LlamaConfig):\n    model_type = 'custom'\n")
    (custom / "modeling_custom.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_custom import CustomConfig\n\n\n"
        "class CustomForCausalLM(LlamaForCausalLM):\n    config_class = CustomConfig\n")
    code = {"AutoConfig": "configuration_custom.CustomConfig",
            "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (custom / "config.json").write_text(json.dumps({"model_type": "custom", **shape, "auto_map": code}))
    build_word_tokenizer(SyntheticTask().vocabulary()).save_pretrained(custom)
    script = """if True:  # refused first: once trusted, the class is registered in the process
        import sys
        from deca_ds.eval import main as evaluate
        from deca_ds.runtime.footprint import model_config
        from deca_ds.runtime.options import RunOptions
        from deca_ds.train import main
        custom, plain, out = sys.argv[1:]
        try:
            model_config(RunOptions(model=custom), 64)
        except ValueError as refused:
            print("refused:", "trust_remote_code=True" in str(refused))
        print("positions:", model_config(RunOptions(model=custom, trust_remote_code=True), 64).max_position_embeddings)
        for method in ("deca", "dec_lora"):
            for model in (custom, plain):
                print("=== estimate", flush=True)
                main(["--model", model, "--from-config", "--trust-remote-code", "--method", method, "--clients", "2",
                      "--max-seq-len", "32", "--output-dir", out, "--estimate"])
        print("=== train", flush=True)
        main(["--model", custom, "--from-config", "--trust-remote-code", "--layers-per-block", "1",
              "--steps-per-block", "1", "--rounds", "1", "--micro-batch", "2", "--max-seq-len", "32",
              "--eval-limit", "8", "--output-dir", out])
        for trust in ([], ["--trust-remote-code"]):
            try:
                evaluate(["--run", out, *trust, "--eval-limit", "8", "--out", out + "/eval.json"])
            except SystemExit as refused:
                print("eval refused:", refused.code, flush=True)"""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", script, str(custom), str(plain), str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
    assert done.returncode == 0, done.stderr
    estimated, trained = done.stdout.split("=== train\n")
    checks, *estimates = estimated.split("=== estimate\n")
    assert checks.splitlines() == ["refused: True", "positions: 96"], done.stdout
    same = [e.replace(str(custom), "MODEL").replace(str(plain), "MODEL") for e in estimates]
    assert "peak of the process" in same[0] and same[0] == same[1] and same[2] == same[3] != same[0], estimates
    out = tmp_path / "out"
    assert {"modeling_custom.py", "configuration_custom.py"} <= {p.name for p in (out / "consensus").iterdir()}
    assert "eval refused: 1" in trained and "trust_remote_code=True" in done.stderr, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert json.loads((out / "eval.json").read_text())["classification"] == summary["consensus_eval"]


@pytest.mark.parametrize("load", [load_model, load_tokenizer])
def test_missing_path_is_a_clear_error(tmp_path, load):
    kwargs = {"dtype": torch.float32} if load is load_model else {}
    with pytest.raises(ValueError, match=r"no such file or directory.*'tiny'"):
        load(str(tmp_path / "missing"), **kwargs)
    with pytest.raises(ValueError, match=r"could not load .*'tiny'"):
        load(str(tmp_path), **kwargs)  # exists, but holds no checkpoint


def test_compiled_layers_train_as_the_eager_ones_and_evaluate_eagerly():
    """--compile-layers with activation checkpointing, block by block as DECA trains: the losses and
    the active layer's gradients are the eager ones to fp32 rounding; one compiled forward serves
    every layer (a version per gradient situation, not per layer); under no_grad the eager forward
    runs, so an evaluation is the eager one bit for bit."""
    from torch._dynamo.utils import counters

    from deca_ds.models import causal_lm_loss, compile_layers, enable_activation_checkpointing
    from helpers import client_batches
    from helpers import tiny_llama as llama

    batches = client_batches(1, steps=2)[0]

    def train(compiled: bool):
        model = llama(layers=4, dtype=torch.float32)
        enable_activation_checkpointing(model)
        if compiled:
            compile_layers(model)
        model.requires_grad_(False)
        losses, grads = [], []
        for active in (0, 3, 1):  # below, at and above the active layer, in turn
            layer = model.model.layers[active]
            layer.requires_grad_(True)
            for batch in batches:
                loss = causal_lm_loss(model, batch)
                loss.backward()
                losses.append(loss.detach())
                grads += [p.grad for p in layer.parameters()]
                layer.zero_grad(set_to_none=True)
            layer.requires_grad_(False)
        with torch.no_grad():
            evaluated = causal_lm_loss(model.eval(), batches[0])
        return losses, grads, evaluated

    eager = train(False)
    counters.clear()
    compiled = train(True)
    assert 3 <= counters["stats"]["unique_graphs"] <= 5, dict(counters["stats"])  # 4 layers x 3 situations: 12
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(compiled[1], eager[1], rtol=1e-4, atol=1e-6)
    assert torch.equal(compiled[2], eager[2])


def test_classification_metrics_match_sklearn():
    y_true = [0, 1, 2, 2, 1, 0, 3, 3, 0, 1]
    y_pred = [0, 2, 2, 2, 1, 1, 0, 0, 0, 1]  # label 3 is never predicted
    got = classification_metrics(y_true, y_pred, num_labels=5)  # label 4 never occurs at all
    assert got["accuracy"] == pytest.approx(accuracy_score(y_true, y_pred), abs=1e-12)
    assert got["macro_f1"] == pytest.approx(f1_score(y_true, y_pred, average="macro"), abs=1e-12)
    perfect = classification_metrics([1, 0, 1], np.array([1, 0, 1]), num_labels=2)
    assert perfect == {"accuracy": 1.0, "macro_f1": 1.0}


def test_score_labels_is_the_answer_log_likelihood(tokenizer):
    model = tiny_llama(len(tokenizer), seed=0).train()
    texts = ["w1 k0.1 w2 k0.3", "k2.0 w5 w5 k2.1 w9 k1.0 w7", "w3"]  # different lengths: padding
    prompts = [PROMPT.format(text=t) for t in texts]
    scores = score_labels(model, tokenizer, prompts, TASK.label_words, max_length=32, batch_size=5)
    assert model.training  # mode restored

    assert scores.shape == (len(prompts), TASK.num_labels)
    for i, prompt in enumerate(prompts):
        for k, word in enumerate(TASK.label_words):
            tokens = prompt.split() + [word, "<eos>"]
            ids = torch.tensor([tokenizer.convert_tokens_to_ids(tokens)])
            log_probs = model(input_ids=ids).logits.log_softmax(-1)[0]
            n = len(prompt.split())
            expected = log_probs[n - 1, ids[0, n]] + log_probs[n, ids[0, n + 1]]
            torch.testing.assert_close(scores[i, k], expected.detach(), rtol=1e-5, atol=1e-5)


def test_evaluation_after_brief_training():
    task = SyntheticTask(num_labels=2, distractors_per_example=1, train_size=400, test_size=200, seed=1)
    train, test = task.generate()
    tok = build_word_tokenizer(task.vocabulary())
    model = tiny_llama(len(tok), seed=0, num_hidden_layers=2)
    for name, p in model.named_parameters():
        p.requires_grad_(".layers." in name)  # as in the demo: embeddings and head stay frozen
    features = encode_examples(tok, train, task.label_words, max_length=32)
    stream = ClientStream(features, list(range(len(train))), 16, pad_id=tok.pad_token_id, seed=0, client=0)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for _ in range(80):
        optimizer.zero_grad()
        model(**next(stream)).loss.backward()
        optimizer.step()

    result = evaluate_classification(model, tok, test, task.label_words, max_length=32, limit=150)
    assert result["n"] == 150 and result["chance"] == 0.5
    assert result["accuracy"] > 0.8


def test_deca_on_non_iid_clients_beats_chance():
    """Four clients on a Dirichlet(0.25) split of the synthetic task, DECA in the simulator: the
    consensus model x̄ classifies held-out examples well above chance."""
    import deca_ds
    from deca_ds.data import dirichlet_partition

    task = SyntheticTask(train_size=800, test_size=200, seed=2)
    train, test = task.generate()
    tok = build_word_tokenizer(task.vocabulary())
    model = tiny_llama(len(tok), seed=0, num_hidden_layers=2)
    features = encode_examples(tok, train, task.label_words, max_length=32)
    parts = dirichlet_partition([ex.label for ex in train], 4, 0.25, seed=0, min_size=16)
    streams = [ClientStream(features, ix, 16, pad_id=tok.pad_token_id, seed=0, client=c) for c, ix in enumerate(parts)]
    config = deca_ds.DecaConfig(lr=1e-3, steps_per_block=40, rounds=2, layers_per_block=1)
    clients = deca_ds.simulate(model, streams, deca_ds.make_topology("ring", 4).W, config)
    before = evaluate_classification(model, tok, test, task.label_words, max_length=32)
    consensus = {n: sum(c[n] for c in clients) / 4 for n in clients[0]}
    assert consensus.keys() == dict(model.named_parameters()).keys()
    model.load_state_dict(consensus, strict=False)  # every parameter; buffers (rotary tables) stay
    after = evaluate_classification(model, tok, test, task.label_words, max_length=32)
    assert after["accuracy"] > 0.6 > before["accuracy"] + 0.2, (before, after)


def test_causal_lm_loss_is_the_transformers_loss_with_the_head_at_labelled_positions_only():
    from deca_ds.models import causal_lm_loss
    from helpers import tiny_llama as tiny64

    model = tiny64(layers=2)  # float64: the two losses agree to rounding
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # right padding
    labels = torch.full_like(ids, -100)
    labels[0, 10:12] = ids[0, 10:12]  # answers end at different positions
    labels[1, 7:9] = ids[1, 7:9]
    labels[2, 5] = ids[2, 5]
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[1]))
    ours = causal_lm_loss(model, batch)
    hook.remove()
    assert seen == [5], "the LM head runs at the union of labelled positions only (4, 6, 7, 9, 10)"
    ours.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    reference = model(**batch).loss
    reference.backward()
    torch.testing.assert_close(ours, reference, rtol=1e-12, atol=0)
    for a, p in zip(grads, model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-10, atol=1e-14)


def _labelled_batch(vocab: int, rows: int = 3, length: int = 12) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    labels = ids.clone()
    labels[:, :3] = -100  # a prompt
    labels[1, 9:] = -100  # padding
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("chunk", [1, 4, 8, 100])
def test_chunked_loss_equals_the_whole_loss(chunk):
    """loss_chunk: the head and the loss over a few positions at a time, each chunk's logits
    recomputed in backward; same loss and gradients (float64: to rounding), the head put back."""
    from deca_ds.models import causal_lm_loss
    from helpers import tiny_llama as tiny64

    model = tiny64(layers=2)
    batch = _labelled_batch(64)
    whole = causal_lm_loss(model, batch)
    whole.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    head = model.lm_head
    widths = []
    hook = head.register_forward_hook(lambda m, i, o: widths.append(i[0].shape[1]))
    chunked = causal_lm_loss(model, batch, loss_chunk=chunk)
    chunked.backward()
    hook.remove()
    assert model.lm_head is head
    k = int((batch["labels"][:, 1:] != -100).any(0).sum())
    forward = [min(chunk, k - i) for i in range(0, k, chunk)]
    assert widths == forward + forward[::-1], "each chunk once forward, once recomputed in backward"
    torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=0)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-14)


def test_chunked_loss_never_holds_the_whole_logits():
    """What autograd keeps after the forward: the whole loss keeps (rows, positions, vocab) fp32
    log-probabilities; the chunked one keeps no tensor with a vocabulary dimension at all."""
    from deca_ds.models import causal_lm_loss

    vocab = 5000  # the logits outweigh every other activation
    model = tiny_llama(vocab).train()
    batch = _labelled_batch(vocab)

    def largest_saved(chunk: int) -> int:
        sizes = []

        def pack(t):
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            causal_lm_loss(model, batch, loss_chunk=chunk)
        weights = {p.numel() for p in model.parameters()}
        return max(s for s in sizes if s not in weights)

    k = int((batch["labels"][:, 1:] != -100).any(0).sum())
    assert largest_saved(0) == 3 * k * vocab
    assert largest_saved(4) < vocab


def test_chunked_loss_refuses_models_that_rescale_their_logits():
    from deca_ds.models import causal_lm_loss, check_plain_logits

    model = tiny_llama(64)
    head = model.lm_head
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="rescales its logits after the LM head .*final_logit_softcapping"):
        causal_lm_loss(model, _labelled_batch(64), loss_chunk=4)
    assert model.lm_head is head
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        check_plain_logits(model.config)
