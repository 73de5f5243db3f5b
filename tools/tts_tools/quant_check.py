"""Accuracy and speed of weight-only quantized linear layers (`--weights fp8` / `int8`) against the
unquantized model, on fixed inputs.

    python -m tts_tools.quant_check --model s2-pro-shape --device cuda --weights fp8 --json out.json

Accuracy (`compare`): one teacher-forced forward of a fixed prompt (text tokens, then frames of semantic
tokens with their codes; every input drawn from a seeded CPU generator) through the model before and
after quantizing it in place, with dense causal attention (no cache, no sampling):

* per slow layer, the relative error of its output (the residual stream), ||h_q - h|| / ||h||;
* the main token's logits over [semantic ids..., end token] (what the frame step samples from): their
  relative error, and the top-1 agreement, the share of positions whose argmax is the same;
* the fast AR's codebook logits (codebooks 1..N-1 of the next frame, teacher-forced): relative error
  and top-1 agreement.

Speed (`kernel_bench`, CUDA only): the weight-only kernels at 1, 8 and 64 rows on each distinct linear
shape of the model against torch's bf16 `F.linear` of the same layers, in GB/s of weights read (CUDA
events around CUDA graph replays: device time; `--sweep` also times other tile choices).

Random weights give flatter logits than a trained model (smaller margins between the best two
tokens), so their top-1 agreement is a pessimistic stand-in for a real checkpoint's.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


def fixed_frames(config, length: int, seed: int = 0) -> Tensor:
    """`[1, length, 1 + N]` int64: the first quarter text tokens, then semantic frames (token and codes),
    drawn from a CPU generator seeded with `seed` (the same on every machine)."""
    g = torch.Generator().manual_seed(seed)
    n = config.num_codebooks
    frames = torch.zeros(1, length, 1 + n, dtype=torch.int64)
    text = max(1, length // 4)
    frames[0, :text, 0] = torch.randint(0, min(config.semantic_begin_id, 4096), (text,), generator=g)
    codes = torch.randint(0, config.codebook_size, (length - text, n), generator=g)
    frames[0, text:, 0] = config.semantic_begin_id + codes[:, 0]
    frames[0, text:, 1:] = codes
    return frames


def _relative_error(a: Tensor, ref: Tensor) -> float:
    a, ref = a.double(), ref.double()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


@torch.no_grad()
def _forward(model, frames: Tensor) -> dict[str, Any]:
    """Per-layer outputs, main-token logits `[T, n_sem + 1]`, fast logits `[T - 1, N - 1, codebook]`."""
    from tts.model.transformer import dense_causal_attend

    c = model.config
    T = frames.shape[1]
    x = model.embed(frames)
    hidden = []
    for layer in model.layers:
        x = layer(x, model.freqs_cis[:T], dense_causal_attend)
        hidden.append(x.float().cpu())
    head = model.lm_head_weight()
    rows = torch.cat(
        [head[c.semantic_begin_id : c.semantic_end_id + 1], head[c.eos_token_id : c.eos_token_id + 1]]
    )
    main = F.linear(model.norm(x), rows)[0].float().cpu()
    _, fast = model(frames)  # [1, T, N, codebook]: position t, fast position k predicts c_k of frame t+1
    fast = fast[0, :-1, 1:].float().cpu()  # the last position has no next frame; k = 0 is unused
    semantic_range = (c.semantic_begin_id, c.semantic_end_id)
    return {"hidden": hidden, "main": main, "fast": fast, "semantic_range": semantic_range}


def compare(model, fmt: str, frames: Tensor) -> dict[str, Any]:
    """Quantize `model` in place (`tts.model.quant.quantize_model`) and measure it against itself
    before; returns the metrics of this module's docstring (floats; `layers` a list, one per slow layer)
    and `weights`, the format used. `frames`: `[1, T, 1 + N]` int64 (see `fixed_frames`)."""
    from tts.model.quant import quantize_model

    frames = frames.to(model.embeddings.weight.device)
    ref = _forward(model, frames)
    used = quantize_model(model, fmt)
    return {"weights": used, **_metrics(_forward(model, frames), ref, frames)}


def rounding_baseline(model, frames: Tensor) -> dict[str, Any]:
    """The same metrics for a float32 `model` cast to bf16 (in place), against itself in float32: how
    far plain bf16 rounding already moves them, the scale to read `compare`'s numbers on."""
    frames = frames.to(model.embeddings.weight.device)
    ref = _forward(model, frames)
    model.to(torch.bfloat16)
    return {"weights": "bf16 vs float32", **_metrics(_forward(model, frames), ref, frames)}


def _metrics(out: dict[str, Any], ref: dict[str, Any], frames: Tensor) -> dict[str, Any]:
    """The metrics, the logits' scored at the positions whose next frame is audio (a semantic token):
    what the frame step predicts; every position where the prompt has none."""
    c_tokens = frames[0, 1:, 0].cpu()
    begin, end = ref["semantic_range"]
    audio_next = (c_tokens >= begin) & (c_tokens <= end)
    if not bool(audio_next.any()):
        audio_next = torch.ones_like(audio_next)
    main, main_ref = out["main"][:-1][audio_next], ref["main"][:-1][audio_next]
    fast, fast_ref = out["fast"][audio_next], ref["fast"][audio_next]
    return {
        "positions": int(frames.shape[1]),
        "scored_positions": int(audio_next.sum()),
        "layers": [_relative_error(a, b) for a, b in zip(out["hidden"], ref["hidden"], strict=True)],
        "main_logits_rel_error": _relative_error(main, main_ref),
        "main_logits_max_abs_error": float((main - main_ref).abs().max()),
        "main_top1_agreement": float((main.argmax(-1) == main_ref.argmax(-1)).double().mean()),
        "fast_logits_rel_error": _relative_error(fast, fast_ref),
        "fast_top1_agreement": float((fast.argmax(-1) == fast_ref.argmax(-1)).double().mean()),
    }


def voice_frames(bundle, names: tuple[str, ...] | None = None) -> Tensor:
    """`[1, T, 1 + N]`: an in-distribution prompt from a bundle's preset voices (real speech codes): the
    first voice as the reference, the second's transcript and codes as an earlier turn of the request
    (the frames the logits are scored on), the third's transcript as the text to speak. Raises
    ValueError for a bundle with fewer than 3 voices."""
    from tts.text.prompt import Turn

    voices = bundle.voices
    names = names or tuple(sorted(voices))[:3]
    if len(names) < 3:
        raise ValueError(f"{bundle.name} has {len(voices)} preset voices; --inputs voices needs 3")
    ref, turn, target = (voices[n] for n in names)
    prompt = bundle.prompt_format.build(target.text, [ref], [Turn(turn.text, turn.codes)])
    return prompt.unsqueeze(0)


def _median_ms(fn: Callable[[], object], repeats: int, inner: int = 1) -> float:
    """Median milliseconds of one call of `fn`, replayed from a CUDA graph (CUDA events around `inner`
    replays, `repeats` times, after 3 untimed eager calls that compile and warm up): device time,
    without Python's launch overhead of each kernel (tens of microseconds for a Triton kernel, more
    than a small layer's whole GEMV)."""
    side = torch.cuda.Stream()  # (warm up off the default stream before a capture, as torch documents)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / inner)
    return sorted(samples)[len(samples) // 2]


# Tile choices the sweep tries beside the default (tts.model.kernels.wquant's gemv_config / gemm_config
# tuples): the small-M kernel (one-row tiles; `_sweep` widens them to the rows timed), the tensor-core
# kernel at 8 rows and at 64 or more.
GEMV_SWEEP = [
    (1, 4, 1024, 4, 3),
    (1, 8, 512, 4, 3),
    (1, 2, 2048, 4, 3),
    (1, 4, 2048, 8, 3),
    (1, 8, 1024, 8, 3),
    (1, 16, 256, 4, 3),
    (1, 16, 1024, 8, 3),
    (1, 32, 512, 8, 3),
    (1, 4, 1024, 4, 1),
    (1, 8, 512, 4, 5),
    (1, 8, 1024, 8, 5),
    (1, 16, 512, 8, 4),
    (1, 16, 256, 4, 6),
]
GEMM_SWEEP_MANY = [
    (64, 16, 128, 4, 4),
    (64, 32, 128, 4, 4),
    (64, 64, 64, 4, 4),
    (64, 64, 128, 4, 3),
    (64, 128, 64, 8, 3),
    (32, 64, 128, 4, 4),
    (16, 32, 128, 4, 4),
    (64, 32, 256, 8, 3),
]
GEMM_SWEEP_FEW = [
    (16, 16, 256, 4, 4),
    (16, 32, 128, 4, 4),
    (16, 16, 512, 4, 3),
    (16, 64, 128, 4, 4),
    (16, 32, 256, 8, 3),
]
BENCH_ROWS = (1, 8, 64, 256)


def _sweep(rows: int, channels: int) -> list[tuple[int, int, int, int, int]]:
    """The tile choices the sweep times at this many rows and output channels (for the kernel that
    `quant_linear` picks). The small-M kernel computes BLOCK_M rows: its one-row choices are widened
    to span `rows`, their K step shrunk to keep the tile's size (at least 256, as `gemv_config`)."""
    import triton

    from tts.model.kernels.wquant import uses_small_m_kernel

    if uses_small_m_kernel(rows, channels):
        bm = triton.next_power_of_2(rows)
        return [(bm, bn, max(256, bk // bm), warps, stages) for _, bn, bk, warps, stages in GEMV_SWEEP]
    return GEMM_SWEEP_FEW if rows <= 16 else GEMM_SWEEP_MANY


def kernel_bench(
    model,
    repeats: int = 10,
    sweep: bool = False,
    rows: tuple[int, ...] = BENCH_ROWS,
    on_row: Callable[[dict[str, Any]], object] | None = None,
) -> list[dict[str, Any]]:
    """Per distinct (out, in) shape of the model's quantized layers, at each count of `rows` (batch 1
    and larger decode batches): the kernel's and bf16 `F.linear`'s median time per layer and the GB/s of
    weights each reads; with `sweep`, also the fastest of the tile choices above (`best_config`,
    `best_us`). Each timed call runs every layer of that shape in turn (36 slow, or 4 fast, ...), so that the
    weights come from device memory, not from the L2 cache (a single layer of S2-Pro fits in it).
    `on_row` sees each result as it is done (the sweep takes minutes). CUDA only."""
    from tts.model.kernels.wquant import quant_linear
    from tts.model.quant import QuantLinear

    shapes: dict[tuple[int, int], list[QuantLinear]] = {}
    for m in model.modules():
        if isinstance(m, QuantLinear):
            shapes.setdefault((m.out_features, m.in_features), []).append(m)

    def quant_all(x, quant, config=None):
        for q, scale in quant:
            quant_linear(x, q, scale, config=config)

    def bf16_all(x, weights):
        for w in weights:
            F.linear(x, w)

    results = []
    for (n, k), layers in shapes.items():
        w16 = [layer.dequantized(torch.bfloat16) for layer in layers]
        quant = [(layer.qweight, layer.scale) for layer in layers]
        for m in rows:
            x = torch.randn(m, k, device=layers[0].qweight.device, dtype=torch.bfloat16)
            quant_ms = _median_ms(functools.partial(quant_all, x, quant), repeats) / len(layers)
            bf16_ms = _median_ms(functools.partial(bf16_all, x, w16), repeats) / len(layers)
            row: dict[str, Any] = {
                "out": n,
                "in": k,
                "rows": m,
                "layers": len(layers),
                "quant_us": quant_ms * 1e3,
                "bf16_us": bf16_ms * 1e3,
                "quant_GBps": n * k * layers[0].qweight.element_size() / quant_ms / 1e6,
                "bf16_GBps": n * k * 2 / bf16_ms / 1e6,
            }
            if sweep:
                timed = [
                    (_median_ms(functools.partial(quant_all, x, quant, config=c), repeats) / len(layers), c)
                    for c in _sweep(m, n)
                ]
                best_ms, best = min(timed)
                row["best_us"], row["best_config"] = best_ms * 1e3, list(best)
            results.append(row)
            if on_row is not None:
                on_row(row)
        del w16
    return results


def _row_counts(text: str) -> tuple[int, ...]:
    """`--bench-rows`: comma-separated row counts, each >= 1 (argparse reports a bad one)."""
    try:
        rows = tuple(int(r) for r in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated row counts, got {text!r}") from None
    if not rows or min(rows) < 1:
        raise argparse.ArgumentTypeError(f"row counts must be >= 1, got {text!r}")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tts_tools.quant_check", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default="tiny", help="a random shape (s2-pro-shape, ...), a preset or a directory"
    )
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="the unquantized model's dtype, the activations' (default: bf16 for a random shape or on CUDA, "
        "else float32)",
    )
    p.add_argument("--weights", choices=["fp8", "int8"], default="fp8")
    p.add_argument(
        "--inputs",
        choices=["random", "voices"],
        default="random",
        help="random: a seeded prompt of --positions random frames; voices: a prompt built from the "
        "model's preset voices (real speech codes; a preset or directory with 3+ voices)",
    )
    p.add_argument("--positions", type=int, default=256, help="prompt length of the teacher-forced pass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--baseline",
        action="store_true",
        help="first measure bf16 against float32 the same way (loads the model in float32 too)",
    )
    p.add_argument("--kernel-bench", action="store_true", help="also time the kernel per layer shape (CUDA)")
    p.add_argument("--sweep", action="store_true", help="with --kernel-bench: also try other tile choices")
    p.add_argument(
        "--bench-rows",
        type=_row_counts,
        default=BENCH_ROWS,
        help="with --kernel-bench: the activation rows to time, comma-separated (default "
        + ",".join(map(str, BENCH_ROWS))
        + ")",
    )
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)

    from tts.cli.main import torch_dtype
    from tts_tools.bench import load_bench_model

    def inputs(model) -> Tensor:
        if args.inputs == "voices":
            from tts.checkpoints.load import load_bundle

            return voice_frames(load_bundle(args.model, device="cpu"))
        return fixed_frames(model.config, args.positions, args.seed)

    baseline = None
    if args.baseline:
        model = load_bench_model(args.model, args.device, torch.float32)
        baseline = rounding_baseline(model, inputs(model))
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    model = load_bench_model(args.model, args.device, torch_dtype(args.dtype))
    frames = inputs(model)
    result = compare(model, args.weights, frames)
    source = "preset voices" if args.inputs == "voices" else f"random, seed {args.seed}"
    print(
        f"{args.model} ({result['positions']} positions, {source}; logits scored at the "
        f"{result['scored_positions']} whose next frame is audio)"
    )
    for r in (baseline, result):
        if r is None:
            continue
        print(f"  {r['weights']}: slow layer output rel. error " + " ".join(f"{e:.4f}" for e in r["layers"]))
        print(
            f"    main-token logits: rel. error {r['main_logits_rel_error']:.4f}, top-1 agreement "
            f"{r['main_top1_agreement']:.2%}; fast logits: rel. error {r['fast_logits_rel_error']:.4f}, "
            f"top-1 agreement {r['fast_top1_agreement']:.2%}"
        )
    result["baseline"] = baseline
    if args.device.startswith("cuda"):
        from tts.model.quant import weight_bytes

        torch.cuda.synchronize()
        result["weight_bytes"] = weight_bytes(model)
        result["device_memory_allocated"] = torch.cuda.memory_allocated()
        print(
            f"  weights {result['weight_bytes'] / 2**30:.2f} GiB; allocated on the device "
            f"{result['device_memory_allocated'] / 2**30:.2f} GiB"
        )
        if args.kernel_bench:

            def show(r: dict[str, Any]) -> None:
                best = f" | best {r['best_us']:7.1f} us {r['best_config']}" if "best_us" in r else ""
                print(
                    f"  [{r['out']:>6} x {r['in']:>6}] x{r['layers']:<3} M={r['rows']}: {result['weights']} "
                    f"{r['quant_us']:7.1f} us {r['quant_GBps']:7.0f} GB/s | bf16 {r['bf16_us']:7.1f} us "
                    f"{r['bf16_GBps']:7.0f} GB/s{best}",
                    flush=True,
                )

            result["kernel_bench"] = kernel_bench(model, sweep=args.sweep, rows=args.bench_rows, on_row=show)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
