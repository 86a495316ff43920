"""The APPROXIMATE terms: what autograd saves in a Llama-style decoder layer, its backward's
temporaries, the loss's logits, a no-grad scoring forward and what the top of the model keeps
(counted from transformers' LlamaDecoderLayer; the estimate's other terms are exact)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .spec import ModelSpec

if TYPE_CHECKING:
    from .estimator import Workload

ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


def layer_activation_bytes(spec: ModelSpec, micro_batch: int, seq_len: int, working_bytes: int, *,
                           trainable: bool, attn_implementation: str = "sdpa") -> int:
    """APPROXIMATE bytes autograd saves for one Llama-style decoder layer (Llama, Qwen2, Mistral).

    Counted from transformers' LlamaDecoderLayer, per token, w = working-dtype bytes, h hidden,
    i intermediate, a heads, q = a·head_dim. PyTorch saves an operand only if the gradient that
    needs it is required, so a layer whose parameters are frozen but through which the gradient
    flows (a layer above the active block) saves less than a trainable one.

      RMSNorm ×2      fp32 copy of the input (pow, mul): 4h; trainable also the normalised
                      working-dtype value (for ∂weight) and the output, the next linears' input: 2·w·h
      attention       q, k, v after RoPE and repeat_kv (k, v at a heads: deca-ds batches carry a
                      padding mask, which makes transformers expand GQA keys/values) and the output:
                      4·w·q, + fp32 logsumexp 4a (SDPA/flash: no s² term);
                      eager instead: q, k (2·w·q), fp32 softmax output and its working-dtype cast
                      a·s·(4 + w) per token, v (w·q); trainable also the o_proj input w·q
      MLP             SiLU input (gate output), SiLU output and up output: 3·w·i;
                      trainable also the down_proj input: w·i
    Ignored: RoPE cos/sin, the attention mask, dropout (p = 0), small per-token scalars.
    """
    h, i, w = spec.hidden, spec.intermediate, working_bytes
    norms = 2 * (4 * h + (2 * w * h if trainable else 0))
    attn = attention_saved_bytes(spec, seq_len, w, attn_implementation)
    if trainable:
        attn += w * spec.heads * spec.head_dim
    mlp = (4 if trainable else 3) * w * i
    return micro_batch * seq_len * (norms + attn + mlp)


def attention_saved_bytes(spec: ModelSpec, seq_len: int, working_bytes: int, attn_implementation: str = "sdpa") -> int:
    """APPROXIMATE bytes per token a frozen layer's attention saves when its inputs require grad
    (layer_activation_bytes)."""
    a, q, w = spec.heads, spec.heads * spec.head_dim, working_bytes
    if attn_implementation == "sdpa":
        return 4 * w * q + 4 * a
    if attn_implementation == "eager":
        return 3 * w * q + a * seq_len * (4 + (w if w != 4 else 0))
    raise ValueError(f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, got {attn_implementation!r}")


def layer_backward_transient_bytes(spec: ModelSpec, micro_batch: int, seq_len: int, working_bytes: int) -> int:
    """APPROXIMATE gradient temporaries alive inside one layer's backward: the gradients of the
    layer output and of the residual stream (2·w·h), of the MLP intermediates at once (3·w·i),
    and the fp32 RMSNorm backward temporaries (2·4h), per token."""
    h, i, w = spec.hidden, spec.intermediate, working_bytes
    return micro_batch * seq_len * (2 * w * h + 3 * w * i + 8 * h)


def logits_bytes(spec: ModelSpec, micro_batch: int, positions: int, working_bytes: int) -> int:
    """APPROXIMATE peak of the loss: b·k·V·max(w + 8, 12), k the positions the LM head runs at
    (models.causal_lm_loss: those predicting a labelled token). Forward: the working-dtype logits,
    their fp32 upcast and the fp32 log-softmax output saved by cross_entropy; start of backward:
    that output, the fp32 gradient from nll_loss and log-softmax's fp32 input gradient."""
    return micro_batch * positions * spec.vocab * max(working_bytes + 8, 12)


def eval_forward_bytes(spec: ModelSpec, batch: int, seq_len: int, working_bytes: int, *, positions: int = 2,
                       kv_cache: bool = False) -> int:
    """APPROXIMATE peak of one no-grad scoring forward (evaluation.score_answers through
    models.labelled_logits) of `batch` sequences of `seq_len` tokens, above the weights.

    Inside one layer, per token, w working bytes: the residual stream, the normalised input and
    the fp32 RMSNorm temporary (2·w·h + 4h), plus the larger of attention's q, the keys and values
    repeated to every head (the padding mask makes transformers expand GQA) and its output
    (4·w·q), and the MLP's SiLU output, up output and their product (3·w·i). Nothing else
    survives a layer without autograd. Then the LM head at `positions` positions: the logits,
    their fp32 copy and log-softmax, b·k·V·(w + 8). kv_cache: the KV cache an eval-mode forward
    keeps when use_cache is on (every layer's keys and values, GQA-sized; labelled_logits turns
    it off): the old path, for comparison."""
    h, i, q, w = spec.hidden, spec.intermediate, spec.heads * spec.head_dim, working_bytes
    tokens = batch * seq_len
    layer = tokens * (2 * w * h + 4 * h + max(4 * w * q, 3 * w * i))
    head = batch * positions * spec.vocab * (w + 8) + tokens * w * h
    cache = spec.num_layers * 2 * tokens * spec.kv_heads * spec.head_dim * w if kv_cache else 0
    return cache + max(layer, head)


def top_saved_bytes(workload: Workload, h: int, *, flows_down: bool, norm_trained: bool, head_trained: bool) -> int:
    """What the top of the model keeps for backward besides the logits: the final norm's fp32 input,
    for the gradient that flows down through it to a trained layer (or the embeddings); with the
    norm's weight trained, its normalized input in the working dtype, at every position; with the LM
    head trained (a tied one: with the embeddings), its input, at the positions it runs at."""
    b, s, w = workload.micro_batch, workload.seq_len, workload.working_bytes
    positions = min(s, workload.loss_positions or s)
    return b * h * (s * (4 if flows_down else 0) + s * w * norm_trained + positions * w * head_trained)
