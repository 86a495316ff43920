"""Dec-LoRA and DeCAF: peft LoRA factors on a frozen base, trained with local Adam, combined with W.

Dec-LoRA (Ghiasvand et al., 2025) mixes A and B separately: A_i = Σ_j w_ij A_j, B_i = Σ_j w_ij B_j.

DeCAF (Saadati et al., 2026) mixes the update each pair stands for: client i receives every
neighbor's (A_j, B_j), forms M_i = Σ_j w_ij B_j A_j and re-factorizes it to rank r by truncated SVD,
M_i ≈ U_r S_r V_rᵀ, with the singular values split evenly between the factors:

    B_i = U_r · S_r^½        A_i = S_r^½ · V_rᵀ

so both factors have the same scale (‖B_i‖ = ‖A_i‖) and neither shrinks over rounds. M_i is never
formed: it is B_cat A_cat with B_cat = [w_1 B_1 … w_k B_k] and A_cat = [A_1; …; A_k], so with thin
QRs B_cat = Q_b R_b, A_catᵀ = Q_a R_a the SVD of the small (kr × kr) core R_b R_aᵀ = U_c S V_cᵀ gives
M's exactly: U = Q_b U_c, V = Q_a V_c. Adam moments stay with the factors, as in Dec-LoRA.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from ..kernels import flat_segments
from ..mixing import Mixer
from .adam import AdamConfig, AdamMethod, MixedAdam
from .base import seeded

# "all-linear": every linear layer of the decoder (attention and MLP), not the LM head.
DEFAULT_TARGETS = "all-linear"
# Elements of the concatenations DeCAF's re-factorization forms at once (16 MiB in fp32; about as much
# again for their QR factors): with 5 clients' factors, all pairs of a shape of the GPU grid's 88M model, 5
# of Llama-3.1-8B's MLP.
REFACTOR_CHUNK = 2**22


class DecLoRA(AdamMethod):
    name = "dec_lora"

    def __init__(self, config: AdamConfig, *, rank: int = 8, alpha: float = 16.0, dropout: float = 0.05,
                 targets: str | list[str] = DEFAULT_TARGETS, seed: int = 0) -> None:
        if rank < 1:
            raise ValueError(f"lora rank must be >= 1, got {rank}")
        if not alpha > 0:  # the adapters' scale alpha / r: at 0 they add nothing and get no gradient
            raise ValueError(f"lora alpha must be > 0, got {alpha}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"lora dropout must be in [0, 1), got {dropout}")
        self.config, self.rank, self.alpha, self.dropout = config, rank, alpha, dropout
        self.targets, self.seed = targets, seed

    def prepare(self, model: nn.Module) -> nn.Module:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=self.targets, bias="none", task_type="CAUSAL_LM")
        try:
            with seeded(self.seed):
                return get_peft_model(model, lora)
        except ValueError as err:  # peft names target modules the model does not have
            raise ValueError(f"LoRA targets {self.targets!r} do not fit the model: {err}") from None

    @staticmethod
    def lora_pairs(model: nn.Module) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """(A, B) of every adapted layer: A is r × d_in, B is d_out × r."""
        return [(m.lora_A[name].weight, m.lora_B[name].weight)
                for m in model.modules() if hasattr(m, "lora_A") for name in m.lora_A]

    def trainable(self, model: nn.Module) -> list[nn.Parameter]:
        return [p for pair in self.lora_pairs(model) for p in pair]

    def plain_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """W + (α/r)·BA for every adapted layer, as merge_and_unload computes it, without touching
        the model (training goes on after a client export)."""
        state = {}
        deltas = {f"{name}.base_layer.weight": sum(module.get_delta_weight(a) for a in module.active_adapters)
                  for name, module in model.get_base_model().named_modules() if hasattr(module, "lora_A")}
        for name, tensor in model.get_base_model().state_dict().items():
            if "lora_" in name:
                continue
            if name in deltas:
                tensor = tensor + deltas[name].to(tensor.device, tensor.dtype)
            state[name.replace(".base_layer.", ".")] = tensor
        return state

    def save_consensus(self, model: nn.Module, directory: Path, tokenizer) -> nn.Module:
        """The merged model W + (α/r)·B̄Ā and, in its adapter/ folder, the adapter in peft format: the
        export is one directory, wherever it is written. Merged in place (training is over), so the
        device never holds a second model."""
        model.save_pretrained(directory / "adapter", safe_serialization=True)
        merged = model.merge_and_unload()
        merged.save_pretrained(directory, safe_serialization=True)
        tokenizer.save_pretrained(directory)
        return merged


def truncated_factors(B_cat: torch.Tensor, A_cat: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, A) with B·A the best rank-`rank` approximation of B_cat·A_cat, singular values split
    evenly; zero-padded when the product's rank is below `rank`. Taken as a batch of one pair, as
    refactor_pairs takes its pairs (on CPU a batched product with a transposed operand rounds
    otherwise than a plain one), so that the two agree to the bit."""
    Q_b, R_b = torch.linalg.qr(B_cat[None])
    Q_a, R_a = torch.linalg.qr(A_cat.T[None])
    U, S, Vh = torch.linalg.svd(R_b @ R_a.mT)
    k = min(rank, S.shape[-1])
    B, A = _split(Q_b, Q_a, U[..., :k], S[..., :k].sqrt(), Vh[..., :k, :], rank)
    return B[0], A[0]


def _split(Q_b: torch.Tensor, Q_a: torch.Tensor, U_k: torch.Tensor, root: torch.Tensor, Vh_k: torch.Tensor,
           rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """B = Q_b·U_k·√S and A = √S·Vh_k·Q_aᵀ, zero-padded to `rank` columns and rows (of each pair,
    where leading dimensions stack pairs)."""
    k = root.shape[-1]
    B = Q_b.new_zeros(*Q_b.shape[:-1], rank)
    A = Q_a.new_zeros(*Q_a.shape[:-2], rank, Q_a.shape[-2])
    B[..., :k] = (Q_b @ U_k) * root[..., None, :]
    A[..., :k, :] = root[..., :, None] * (Vh_k @ Q_a.mT)
    return B, A


def refactor_chunks(pairs: list[tuple[int, int, tuple[float, ...]]], kr: int,
                    limit: int = REFACTOR_CHUNK) -> list[list[int]]:
    """The pairs refactor_pairs takes together, given each pair's (fan_in, fan_out, weights of its
    terms): pairs alike in all three, in order of their first, cut where a chunk's concatenations
    would hold more than `limit` elements (a pair at least); kr wide."""
    alike: dict[tuple, list[int]] = {}
    for i, key in enumerate(pairs):
        alike.setdefault(key, []).append(i)
    chunks = []
    for (fan_in, fan_out, _), idx in alike.items():
        n = max(1, limit // (kr * (fan_in + fan_out)))
        chunks += [idx[s:s + n] for s in range(0, len(idx), n)]
    return chunks


class LoRAPair(NamedTuple):
    """A LoRA pair for refactor_pairs: its shape, where its new factors go, and the factors
    (w_j, A_j, B_j) of the clients it combines. A is rank × fan_in and B fan_out × rank, each
    shaped so or flat, row by row (a view of a mixed vector, as DeCAF's are: one split a vector,
    not a view a tensor)."""

    fan_in: int
    fan_out: int
    A_out: torch.Tensor
    B_out: torch.Tensor
    factors: list[tuple[float, torch.Tensor, torch.Tensor]]


def _thin_qrs(pairs: list[LoRAPair], chunk: list[int], rank: int):
    """Q_b R_b = B_cat = [w_1 B_1 … w_k B_k] and Q_a R_a = A_catᵀ, A_cat = [A_1; …; A_k], of each
    pair of `chunk` (stacked along a leading dimension): one stack of the chunk's A_j, one of its
    B_j, whose weighted transposes, a block of rows each, form B_catᵀ."""
    first = pairs[chunk[0]]
    G, k = len(chunk), len(first.factors)
    A_cat = torch.stack([A_j for i in chunk for _, A_j, _ in pairs[i].factors]).view(G, k * rank, first.fan_in)
    Bs = torch.stack([B_j for i in chunk for _, _, B_j in pairs[i].factors]).view(G, k, first.fan_out, rank)
    for j, (w, _, _) in enumerate(first.factors):
        Bs[:, j].mul_(w)
    B_catT = Bs.mT.reshape(G, k * rank, first.fan_out)
    del Bs
    Q_b, R_b = torch.linalg.qr(B_catT.mT)
    Q_a, R_a = torch.linalg.qr(A_cat.mT)
    return Q_b, R_b, Q_a, R_a


def refactor_pairs(pairs: list[LoRAPair]) -> None:
    """For each pair: A_out, B_out = the truncated factors of Σ_j w_j B_j A_j (truncated_factors),
    in two passes over the pairs, the pairs of one shape and weights together (refactor_chunks: a
    chunk's temporaries at a time).

    The first pass writes each pair's small core R_b·R_aᵀ into one buffer per core shape; the host
    takes their SVDs, a batch per shape, and sends every pair's U_k, √S_k and Vh_k back in one
    copy; the second pass forms the QRs again and the new factors from them. On a GPU an SVD of a
    small matrix is a slow kernel followed by a wait for its convergence flag, and a copy from the
    host waits too: one per pair, 84 per client step in the GPU accuracy grid's 12-layer model,
    where a DeCAF step took 3.4 times a Dec-LoRA one (the same step but for the re-factorization).
    There, too, every operation costs the host about as much as a kernel does (profiling/op_counts.py):
    a chunk's QRs, products and copies are one operation each, not one per pair. Forming the QRs
    again costs less memory than holding every pair's Q_b and Q_a until the SVDs are done
    (baseline_memory.refactor_elements)."""
    first = pairs[0]
    rank, device, dtype = first.A_out.numel() // first.fan_in, first.A_out.device, first.A_out.dtype
    kr = len(first.factors) * rank
    chunks = refactor_chunks([(p.fan_in, p.fan_out, tuple(w for w, _, _ in p.factors)) for p in pairs], kr)
    groups: dict[tuple[int, int], list[list[int]]] = {}  # core shape -> its chunks, in order
    for chunk in chunks:
        pair = pairs[chunk[0]]
        groups.setdefault((min(pair.fan_out, kr), min(pair.fan_in, kr)), []).append(chunk)
    counts = {shape: sum(map(len, cs)) for shape, cs in groups.items()}
    cores = {shape: torch.empty(n, *shape, dtype=dtype, device=device) for shape, n in counts.items()}
    for shape, shape_chunks in groups.items():
        for s, chunk in _offsets(shape_chunks):
            _core_into(cores[shape][s:s + len(chunk)], pairs, chunk, rank)
    host = torch.empty(sum(n * min(rank, qb, qa) * (qb + 1 + qa) for (qb, qa), n in counts.items()), dtype=dtype)
    for shape, (U_k, root, Vh_k) in _layout(host, counts, rank).items():
        U, S, Vh = torch.linalg.svd(cores.pop(shape).cpu())  # the cores freed on the device once copied
        k = root.shape[1]
        U_k.copy_(U[..., :k])
        torch.sqrt(S[..., :k], out=root)
        Vh_k.copy_(Vh[..., :k, :])
        del U, S, Vh
    on_device = host.to(device)  # one copy, one wait (on CPU the same tensor)
    del host
    for shape, (U_k, root, Vh_k) in _layout(on_device, counts, rank).items():
        for s, chunk in _offsets(groups[shape]):
            rows = slice(s, s + len(chunk))
            _refactor_into(pairs, chunk, rank, (U_k[rows], root[rows], Vh_k[rows]))


def _offsets(chunks: list[list[int]]):
    """(first row in the core shape's buffers, chunk) for each chunk of one core shape."""
    s = 0
    for chunk in chunks:
        yield s, chunk
        s += len(chunk)


# One chunk at a time: each pass's temporaries are freed when its function returns.
def _core_into(core: torch.Tensor, pairs: list[LoRAPair], chunk: list[int], rank: int) -> None:
    _, R_b, _, R_a = _thin_qrs(pairs, chunk, rank)
    torch.matmul(R_b, R_a.mT, out=core)


def _refactor_into(pairs: list[LoRAPair], chunk: list[int], rank: int, split) -> None:
    Q_b, R_b, Q_a, R_a = _thin_qrs(pairs, chunk, rank)
    del R_b, R_a
    B, A = _split(Q_b, Q_a, *split, rank=rank)
    first = pairs[chunk[0]]
    torch._foreach_copy_([pairs[i].A_out for i in chunk], list(A.view(len(chunk), *first.A_out.shape).unbind(0)))
    torch._foreach_copy_([pairs[i].B_out for i in chunk], list(B.view(len(chunk), *first.B_out.shape).unbind(0)))


def _layout(flat: torch.Tensor, counts: dict[tuple[int, int], int], rank: int) -> dict:
    """Each core shape's (U_k, √S_k, Vh_k) of its pairs as views of `flat`, one shape after the other."""
    views, offset = {}, 0
    for (qb, qa), g in counts.items():
        k = min(rank, qb, qa)
        sizes = (g * qb * k, g * k, g * k * qa)
        U_k, root, Vh_k = flat[offset:offset + sum(sizes)].split(sizes)
        views[(qb, qa)] = U_k.view(g, qb, k), root.view(g, k), Vh_k.view(g, k, qa)
        offset += sum(sizes)
    return views


class DeCAFAdam(MixedAdam):
    """MixedAdam whose combination is DeCAF's truncated SVD of Σ_j w_ij B_j A_j per LoRA pair.

    Its consensus is TSVD_r(1/N Σ_i B_i A_i) per pair, not the mean of the factors: factors of
    different clients need not share a basis, so their mean can stand for no client's update."""

    linear = False

    def __init__(self, model: nn.Module, pairs, config: AdamConfig, *, mixer: Mixer | None = None):
        super().__init__(model, [p for pair in pairs for p in pair], config, mixer=mixer)

    def aggregate(self, mixer: Mixer, x_half: torch.Tensor) -> torch.Tensor:
        terms = mixer.exchange(x_half)
        out = torch.empty_like(x_half)
        mine = flat_segments(self.params, out)  # flat: one split a vector
        views = [flat_segments(self.params, x) for _, x in terms]
        refactor_pairs([LoRAPair(self.params[k].shape[1], self.params[k + 1].shape[0], mine[k], mine[k + 1],
                                 [(w, v[k], v[k + 1]) for (w, _), v in zip(terms, views)])
                        for k in range(0, len(self.params), 2)])
        return out


class DeCAF(DecLoRA):
    name = "decaf"
    linear = DeCAFAdam.linear

    def adam(self, model: nn.Module, mixer: Mixer | None) -> DeCAFAdam:
        return DeCAFAdam(model, self.lora_pairs(model), self.config, mixer=mixer)
