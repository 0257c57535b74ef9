#!/usr/bin/env python3
"""PyTorch/diffusers baselines for the GPU benchmarks, one JSON line per figure.

    python3 benches/torch_reference.py step   # FluxTransformer2DModel full step, bf16, SDPA
    python3 benches/torch_reference.py attn   # SDPA on the gathered masked-attention problem,
                                              # by PyTorch's choice and each backend pinned
    python3 benches/torch_reference.py gemm   # FLUX.1's GEMM shapes: bf16 matmul against
                                              # torch._scaled_mm with per-tensor fp8 scales

Run it on the same GPU, in the same session, as

    denoised bench step --device cuda:0 --config flux1-dev --image-tokens 4096 \
        --text-tokens 512 --mask-ratio 0.1,0.2,0.4
    denoised bench attn --device cuda:0

so the ratios in docs/performance.md compare like with like. Weights are random (the
speed of a dense transformer does not depend on their values). `--tiny` shrinks the
model so the script itself can be checked on a CPU.
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F

FLUX_DEV = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
    attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
    pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56),
)
TINY = dict(FLUX_DEV, num_layers=1, num_single_layers=1, attention_head_dim=32,
            num_attention_heads=2, joint_attention_dim=64, pooled_projection_dim=32,
            axes_dims_rope=(8, 12, 12))


def timed(fn, device, warmup, iters):
    """Median and best of `iters` runs after `warmup`; on a GPU timed with CUDA events
    (the GPU's own clock, no host overhead), on the CPU with the wall clock."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ts.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2], ts[0]


def step(a, device, dtype):
    from diffusers import FluxTransformer2DModel

    cfg = TINY if a.tiny else FLUX_DEV
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in bf16: FLUX-dev in f32 would need 48 GB
    with torch.device(device):
        model = FluxTransformer2DModel(**cfg).eval()
    torch.set_default_dtype(prev)
    L, T = a.image_tokens, a.text_tokens
    side = int(L ** 0.5)
    img_ids = torch.zeros(L, 3, device=device)
    img_ids[:, 1] = torch.arange(L, device=device) // side
    img_ids[:, 2] = torch.arange(L, device=device) % side
    args = dict(
        hidden_states=torch.randn(1, L, cfg["in_channels"], device=device, dtype=dtype),
        encoder_hidden_states=torch.randn(1, T, cfg["joint_attention_dim"], device=device, dtype=dtype),
        pooled_projections=torch.randn(1, cfg["pooled_projection_dim"], device=device, dtype=dtype),
        timestep=torch.tensor([0.5], device=device, dtype=dtype),
        guidance=torch.tensor([3.5], device=device, dtype=dtype),
        img_ids=img_ids,
        txt_ids=torch.zeros(T, 3, device=device),
        return_dict=False,
    )
    with torch.inference_mode():
        median, best = timed(lambda: model(**args), device, a.warmup, a.iters)
    print(json.dumps(dict(
        what="torch_full_step", model="flux1-dev" if not a.tiny else "tiny", image_tokens=L,
        text_tokens=T, dtype=str(dtype), device=str(device), median_s=median, min_s=best,
        torch=torch.__version__, attention="sdpa",
    )))


def attn(a, device, dtype):
    H, D, T, L = a.heads, a.head_dim, a.text_tokens, a.image_tokens
    for m in a.mask_ratio:
        active = round(m * L)
        q_len, k_len = T + active, T + L
        # The gathered (contiguous) equivalent of denoised's indexed problem.
        q = torch.randn(1, H, q_len, D, device=device, dtype=dtype)
        k = torch.randn(1, H, k_len, D, device=device, dtype=dtype)
        v = torch.randn(1, H, k_len, D, device=device, dtype=dtype)
        with torch.inference_mode():
            median, best = timed(lambda: F.scaled_dot_product_attention(q, k, v), device, a.warmup, a.iters)
        flops = 4 * q_len * k_len * D * H
        print(json.dumps(dict(
            what="torch_sdpa", mask_ratio=m, queries=q_len, keys=k_len, heads=H, head_dim=D,
            median_s=median, min_s=best, tflops=flops / median / 1e12, dtype=str(dtype),
            device=str(device), torch=torch.__version__,
        )))
        # Each backend pinned: which one PyTorch picked, and what cuDNN's own does here.
        for name, backend in sdpa_backends():
            row = dict(what="torch_sdpa_backend", backend=name, mask_ratio=m, queries=q_len, keys=k_len)
            try:
                from torch.nn.attention import sdpa_kernel
                with torch.inference_mode(), sdpa_kernel([backend]):
                    median, best = timed(lambda: F.scaled_dot_product_attention(q, k, v), device, a.warmup, a.iters)
                row.update(median_s=median, min_s=best, tflops=flops / median / 1e12)
            except Exception as e:  # a backend that cannot run this shape or device says why
                row.update(median_s=None, tflops=None, error=str(e).splitlines()[0][:200])
            print(json.dumps(row))


def sdpa_backends():
    try:
        from torch.nn.attention import SDPBackend
    except ImportError:
        return []
    names = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"]
    return [(n.lower(), getattr(SDPBackend, n)) for n in names if hasattr(SDPBackend, n)]


# FLUX.1-dev's GEMMs at 4096 image + 512 text tokens, as (rows, out, in): a double
# block's QKV and MLP in and out, a single block's fused in and out projections.
FLUX_GEMMS = [(4608, 9216, 3072), (4608, 12288, 3072), (4608, 3072, 12288),
              (4608, 21504, 3072), (4608, 3072, 15360)]


def gemm(a, device, dtype):
    """bf16 `x @ w.T` against torch._scaled_mm on E4M3 operands with one scale per
    tensor (what denoised's per-tensor fp8 asks of cuBLASLt), bf16 out."""
    shapes = [(64, 96, 64), (64, 128, 96)] if a.tiny else FLUX_GEMMS
    fp8 = getattr(torch, "float8_e4m3fn", None)
    for n, m, k in shapes:
        x = torch.randn(n, k, device=device, dtype=dtype)
        w = torch.randn(m, k, device=device, dtype=dtype)
        flops = 2 * n * m * k
        with torch.inference_mode():
            median, best = timed(lambda: x @ w.t(), device, a.warmup, a.iters)
        row = dict(what="torch_gemm", rows=n, out=m, inner=k, bf16_median_s=median,
                   bf16_tflops=flops / median / 1e12, device=str(device), torch=torch.__version__)
        try:
            if fp8 is None or device.type != "cuda":
                raise RuntimeError("torch._scaled_mm needs fp8 tensor cores (a CUDA device)")
            sx, sw = x.abs().max().float() / 448, w.abs().max().float() / 448
            xq, wq = (x / sx).to(fp8), (w / sw).to(fp8)
            with torch.inference_mode():
                median, best = timed(lambda: torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw,
                                                              out_dtype=dtype), device, a.warmup, a.iters)
            row.update(fp8_median_s=median, fp8_tflops=flops / median / 1e12,
                       fp8_over_bf16=median / row["bf16_median_s"])
        except Exception as e:
            row.update(fp8_median_s=None, fp8_tflops=None, fp8_over_bf16=None,
                       fp8_error=str(e).splitlines()[0][:200])
        print(json.dumps(row))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["step", "attn", "gemm"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    p.add_argument("--image-tokens", type=int, default=4096)
    p.add_argument("--text-tokens", type=int, default=512)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--mask-ratio", type=lambda s: [float(x) for x in s.split(",")], default=[0.1, 0.2, 0.4, 1.0])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="a tiny model, to check the script on a CPU")
    a = p.parse_args()
    device = torch.device(a.device)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    {"step": step, "attn": attn, "gemm": gemm}[a.what](a, device, dtype)


if __name__ == "__main__":
    main()
