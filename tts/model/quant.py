"""Weight-only quantization of the dual-AR transformer's linear layers (`--weights fp8` / `int8`).

A batch-1 frame step reads every weight once per slow step and once per fast position (15.55 GB for
S2-Pro in bf16): it is bound by memory bandwidth, so storing a weight in 1 byte instead of 2 nearly
halves the step's traffic. Activations stay in the model's dtype; only the weights are quantized, at
load time, from the floating-point checkpoint.

* **fp8**: E4M3 (`torch.float8_e4m3fn`, max 448), one float32 scale per output channel,
  `scale = max|w_row| / 448`, `q = w / scale` rounded to nearest-even by the cast.
* **int8**: symmetric, one scale per output channel, `scale = max|w_row| / 127`, `q = round(w / scale)`.
  For CUDA devices without FP8 conversion instructions (compute capability < 8.9), where `--weights
  fp8` falls back to it.

One scale per output channel keeps a channel with an outlier from crushing the resolution of the
others. Quantized: every slow and fast layer's `wqkv`, `wo`, `w1`/`w3` (as one fused `w13`), `w2`, the
fast head `fast_output` and `fast_project_in` where it is a linear layer. Kept in the model's dtype: the
embeddings (a lookup, and S2's tied slow head) and an untied slow `output` head, whose semantic slice
(4,097 of its rows) is all a frame step reads of it.

`QuantLinear.forward` runs the Triton kernel (`tts.model.kernels.wquant`) where the fused kernels run
(CUDA, or the Triton interpreter in tests), else `reference_linear`: widen the stored weights to x's
dtype, multiply, then scale the output channels (the CPU path and the kernels' test reference).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tts.model.kernels import fused_kernels_enabled

log = logging.getLogger(__name__)

WEIGHT_FORMATS = ("fp8", "int8")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127.0


def _row_scale(w: Tensor, qmax: float) -> Tensor:
    """`[out]` float32: max |w| of each row over qmax (1 for an all-zero row, whose codes are all 0)."""
    amax = w.detach().float().abs().amax(dim=1)
    return torch.where(amax > 0, amax / qmax, torch.ones_like(amax))


def quantize_weight(w: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    """Quantize `w [out, in]` (any float dtype) per output channel.

    Returns `(q, scale)`: q `[out, in]` float8_e4m3fn (fmt "fp8") or int8 (fmt "int8"), contiguous,
    on w's device; scale `[out]` float32 with `w ~= q.float() * scale[:, None]`. The error of each weight
    is at most half a step of its row's grid: fp8 relative to the value (3 mantissa bits: <= 2^-4 of
    |w|, or 2^-10 * scale in the subnormal range), int8 absolute (<= scale / 2). Raises ValueError for
    an unknown fmt or a w that is not 2-D.
    """
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"weight format must be one of {WEIGHT_FORMATS}, got {fmt!r}")
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
    qmax = FP8_MAX if fmt == "fp8" else INT8_MAX
    scale = _row_scale(w, qmax)
    scaled = w.detach().float() / scale[:, None]
    if fmt == "fp8":
        q = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    else:
        q = scaled.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.contiguous(), scale


def dequantize_weight(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """`q.float() * scale[:, None]` as `dtype`: the weights a quantized layer stands for."""
    return (q.float() * scale[:, None]).to(dtype)


def reference_linear(x: Tensor, q: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """The torch path of `QuantLinear`: `F.linear(x, q as x's dtype)`, each output channel times its
    scale (then the bias), in x's dtype. Every fp8 and int8 code is exact in bf16 / fp16 / fp32, so the
    only roundings are the product's and the scaled result's. x: `[..., in]`; returns `[..., out]`."""
    y = F.linear(x, q.to(x.dtype))
    y = (y.float() * scale).to(x.dtype) if x.dtype != torch.float32 else y * scale
    return y + bias if bias is not None else y


class QuantLinear(nn.Module):
    """A linear layer with weight-only quantized weights: `qweight [out, in]` (fp8 E4M3 or int8) and
    `scale [out]` float32 as buffers, the bias (if any) in the model's dtype. Activations in, the same
    dtype out; inference only (no gradients reach the codes)."""

    def __init__(self, qweight: Tensor, scale: Tensor, bias: Tensor | None, fmt: str):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.fmt = fmt
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias.detach() if bias is not None else None)

    qweight: Tensor
    scale: Tensor
    bias: Tensor | None

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str) -> QuantLinear:
        """Quantize `linear`'s weight per output channel (see `quantize_weight`); the bias is kept."""
        q, scale = quantize_weight(linear.weight, fmt)
        return cls(q, scale, linear.bias, fmt)

    def forward(self, x: Tensor) -> Tensor:
        if fused_kernels_enabled(x):
            from tts.model.kernels import wquant

            return wquant.quant_linear(x, self.qweight, self.scale, self.bias)
        return reference_linear(x, self.qweight, self.scale, self.bias)

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        """`[out, in]` in `dtype`: the weight this layer stands for."""
        return dequantize_weight(self.qweight, self.scale, dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights={self.fmt}"


def fp8_supported(device: torch.device) -> bool:
    """FP8 weights need fp8->fp16/bf16 conversion in the kernel: CUDA compute capability 8.9 (Ada) or
    9.0+ (Hopper). A CPU runs fp8 through the torch reference (slow, for tests)."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


def resolve_weight_format(fmt: str, device: torch.device) -> str:
    """`fmt` as it will run on `device`: "fp8" becomes "int8" on a CUDA device without FP8 (logged)."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"--weights must be one of {WEIGHT_FORMATS}, got {fmt!r}")
    if fmt == "fp8" and not fp8_supported(device):
        log.warning("%s has no FP8 support (compute capability < 8.9): int8 weights instead", device)
        return "int8"
    return fmt


def _quantized_layers(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of every linear layer `quantize_model` quantizes, w1 and w3 apart."""
    from tts.model.transformer import DualARTransformer, TransformerBlock

    if not isinstance(model, DualARTransformer):
        raise ValueError(f"expected a DualARTransformer, got {type(model).__name__}")
    pairs: list[tuple[nn.Module, str]] = []
    for block in cast("list[TransformerBlock]", [*model.layers, *model.fast_layers]):
        att, ff = block.attention, block.feed_forward
        pairs += [(att, "wqkv"), (att, "wo"), (ff, "w1"), (ff, "w3"), (ff, "w2")]
    pairs += [(model, "fast_project_in"), (model, "fast_output")]
    return [(parent, name) for parent, name in pairs if isinstance(getattr(parent, name, None), nn.Linear)]


def weight_quantizer(model: nn.Module, fmt: str) -> Callable[[str, Tensor], bool]:
    """For a loader filling `model` (built on the meta device) one tensor at a time: returns
    `take(key, value) -> bool`, which, for the weight of a layer `quantize_model` quantizes (a
    state-dict key such as "layers.3.attention.wqkv.weight"), puts a `QuantLinear` of `value` (any float
    dtype, on the model's target device) in the layer's place and returns True; for any other key it
    does nothing and returns False (the loader assigns the tensor). So a device never holds the
    model's 16-bit weights whole: the load's peak is the quantized model plus one layer's weight. A bias
    loaded later lands on the `QuantLinear`. Call `quantize_model(model, fmt)` once every tensor is in:
    it fuses w1 and w3. `fmt` must already be resolved for the device (`resolve_weight_format`)."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"weight format must be one of {WEIGHT_FORMATS}, got {fmt!r}")
    names = {id(m): name for name, m in model.named_modules()}
    targets = {
        f"{names[id(getattr(parent, attr))]}.weight": (parent, attr)
        for parent, attr in _quantized_layers(model)
    }

    def take(key: str, value: Tensor) -> bool:
        target = targets.pop(key, None)
        if target is None:
            return False
        parent, attr = target
        # (a bias not loaded yet is still on the meta device: the loader's assignment replaces it)
        setattr(parent, attr, QuantLinear(*quantize_weight(value, fmt), getattr(parent, attr).bias, fmt))
        return True

    return take


def quantize_model(model: nn.Module, fmt: str) -> str:
    """Quantize a `DualARTransformer`'s linear layers in place (the list in this module's docstring);
    returns the format used (see `resolve_weight_format`). One layer at a time, so the device never
    holds more than one layer's weights twice; layers a loader already quantized in this format
    (`weight_quantizer`) are kept. w1 and w3 become one `FeedForward.w13_quant` (the fused GEMM of the
    serving path); `fuse_weights` is then a no-op. Raises ValueError for an unknown format, a model
    already quantized, or layers quantized in another format. Quantizing after an ordinary load, the
    device's peak is the unquantized model plus one layer; quantizing as it loads (`load_bundle(...,
    weights=)`), the quantized model plus one layer."""
    from tts.model.transformer import DualARTransformer, TransformerBlock

    layers = _quantized_layers(model)  # (raises for a model that is not a DualARTransformer)
    model = cast(DualARTransformer, model)
    blocks = cast("list[TransformerBlock]", [*model.layers, *model.fast_layers])
    if any(hasattr(b.feed_forward, "w13_quant") for b in blocks):
        raise ValueError("the model's weights are already quantized")
    fmt = resolve_weight_format(fmt, model.embeddings.weight.device)
    other = quantized_format(model)
    if other not in (None, fmt):
        raise ValueError(f"the model's layers are already quantized as {other}, not {fmt}")
    with torch.no_grad():
        for parent, name in layers:
            if name not in ("w1", "w3"):
                setattr(parent, name, QuantLinear.from_linear(getattr(parent, name), fmt))
        for block in blocks:
            ff = block.feed_forward
            w1, w3 = (
                m if isinstance(m, QuantLinear) else QuantLinear.from_linear(m, fmt) for m in (ff.w1, ff.w3)
            )
            ff.w13_quant = QuantLinear(
                torch.cat([w1.qweight, w3.qweight]), torch.cat([w1.scale, w3.scale]), None, fmt
            )
            del w1, w3
            del ff.w1, ff.w3  # their storage (or the fused w13's) is freed with them
            ff.__dict__.pop("w13", None)
    device = model.embeddings.weight.device
    if device.type == "cuda":
        # Hand the freed 16-bit weights back to the driver: the engine sizes its KV pool from the
        # device's free memory, which does not count torch's cached blocks.
        torch.cuda.empty_cache()
    return fmt


def is_quantized(model: nn.Module) -> bool:
    """True when any of the model's linear layers is a `QuantLinear`."""
    return quantized_format(model) is not None


def quantized_format(model: nn.Module) -> str | None:
    """The format of the model's quantized linear layers ("fp8", "int8"), or None if they are not."""
    return next((m.fmt for m in model.modules() if isinstance(m, QuantLinear)), None)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's state: parameters and persistent buffers (quantized codes and scales
    included; derived tables such as RoPE's left out), each storage counted once."""
    seen: set[int] = set()
    total = 0
    for t in model.state_dict().values():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
