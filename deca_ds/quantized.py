"""8-bit moments for the active block (DecaConfig(state_bits=8)): bitsandbytes block-wise quantization.

A moment vector (m or v, flattened over the block's tensors) is held as one uint8 code per element
and one fp32 absmax per QUANT_BLOCK elements: 1 + 4/256 bytes per element instead of 4. Each of the
block's tensors (a segment) is quantized on its own, so the optimizer can dequantize, update and
requantize one tensor's moments at a time and never holds a block-sized fp32 m or v.

The codes index bitsandbytes' dynamic map (sign, exponent, fraction in 8 bits): signed for m,
unsigned for v, which is never negative, so the sign bit buys precision instead - the choice of
bitsandbytes' own 8-bit Adam.
"""

from __future__ import annotations

from functools import lru_cache

import torch

QUANT_BLOCK = 256  # elements per absmax: bitsandbytes' block size for 8-bit optimizer states


def bitsandbytes_functional():
    """bitsandbytes.functional, or a ValueError naming the extra that installs it."""
    try:
        import bitsandbytes.functional as bnbf
    except ImportError as e:
        raise ValueError(f"state_bits=8 needs bitsandbytes, which cannot be imported ({e}); "
                         "install it with the extra: pip install 'deca-ds[bnb]'") from e
    return bnbf


@lru_cache(maxsize=None)
def dynamic_map(signed: bool, device: torch.device) -> torch.Tensor:
    """The 256 values a code stands for (times its block's absmax); one shared copy per device."""
    return bitsandbytes_functional().create_dynamic_map(signed=signed).to(device)


def num_absmax(sizes: list[int]) -> int:
    """Absmax values for segments of `sizes` elements: every segment starts a new quantization block."""
    return sum(-(-n // QUANT_BLOCK) for n in sizes)


class QuantizedVector:
    """A flat fp32 vector, cut into segments of `sizes` elements, held as 8-bit block-wise codes.

    get(i) dequantizes segment i into a new flat fp32 tensor; put(i, x) quantizes x into it. Every
    segment starts a new quantization block, so segments are read and written independently.
    """

    def __init__(self, sizes: list[int], codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> None:
        self.sizes, self.codes, self.absmax, self.signed = list(sizes), codes, absmax, signed
        self._map = dynamic_map(signed, codes.device)
        self._spans, start, block = [], 0, 0
        for n in self.sizes:
            blocks = num_absmax([n])
            self._spans.append((slice(start, start + n), slice(block, block + blocks)))
            start, block = start + n, block + blocks

    @classmethod
    def zeros(cls, sizes: list[int], signed: bool, device: torch.device) -> "QuantizedVector":
        # absmax 0 decodes every code to 0.0
        return cls(sizes, torch.zeros(sum(sizes), dtype=torch.uint8, device=device),
                   torch.zeros(num_absmax(sizes), dtype=torch.float32, device=device), signed)

    @property
    def nbytes(self) -> int:
        """Bytes held: codes and absmax (the 1 KiB code map is a shared constant)."""
        return self.codes.nbytes + self.absmax.nbytes

    def get(self, i: int) -> torch.Tensor:
        codes, absmax = self._spans[i]
        return bitsandbytes_functional().dequantize_blockwise(
            self.codes[codes], absmax=self.absmax[absmax], code=self._map, blocksize=QUANT_BLOCK)

    def put(self, i: int, x: torch.Tensor) -> None:
        codes, absmax = self._spans[i]
        bitsandbytes_functional().quantize_blockwise(
            x.reshape(-1), code=self._map, blocksize=QUANT_BLOCK, out=self.codes[codes], absmax=self.absmax[absmax])

    def clone(self) -> "QuantizedVector":
        return QuantizedVector(self.sizes, self.codes.clone(), self.absmax.clone(), self.signed)

    def state_dict(self) -> dict:
        """A copy in plain tensors and numbers (loadable with torch.load(weights_only=True))."""
        return {"sizes": self.sizes, "signed": self.signed, "codes": self.codes.clone(), "absmax": self.absmax.clone()}

    @classmethod
    def from_state_dict(cls, state: dict, device: torch.device) -> "QuantizedVector":
        return cls(state["sizes"], state["codes"].to(device, copy=True), state["absmax"].to(device, copy=True),
                   state["signed"])
