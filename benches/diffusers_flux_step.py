#!/usr/bin/env python3
"""Benchmark one FLUX transformer forward step (diffusers, CPU, float32, random weights).

The baseline for `denoised bench step --config flux-small`: the same config, the same
token counts, in the same session, alternating the two (docs/performance.md). Setup:

    python3 -m venv venv && venv/bin/pip install torch==2.15.0 diffusers==0.42.1
    venv/bin/python benches/diffusers_flux_step.py --threads 2 --iters 5

Builds a small FluxTransformer2DModel from a config (nothing is fetched from the
HuggingFace hub), runs 1 warm-up forward and --iters timed forwards under
torch.inference_mode(), and prints ONE JSON line to stdout.

Example:
    venv/bin/python benches/diffusers_flux_step.py --threads 2 --iters 3
"""
import os

# Never touch the network / hub; keep diffusers quiet.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import argparse
import json
import math
import statistics
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--image-tokens", type=int, default=1024,
                   help="number of image tokens; must be a perfect square (1024 = 32x32, 4096 = 64x64)")
    p.add_argument("--text-tokens", type=int, default=128, help="number of text tokens (default 128)")
    p.add_argument("--iters", type=int, default=5, help="timed forward passes after 1 warm-up (default 5)")
    p.add_argument("--seed", type=int, default=0, help="RNG seed for weights and inputs (default 0)")
    return p.parse_args()


def main():
    args = parse_args()
    side = math.isqrt(args.image_tokens)
    if side * side != args.image_tokens or side == 0:
        sys.exit(f"--image-tokens must be a positive perfect square, got {args.image_tokens}")
    if args.text_tokens < 1 or args.iters < 1 or args.threads < 1:
        sys.exit("--text-tokens, --iters and --threads must be >= 1")

    import torch
    import diffusers
    from diffusers import FluxTransformer2DModel

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=384,
        out_channels=64,
        num_layers=4,
        num_single_layers=8,
        attention_head_dim=64,
        num_attention_heads=12,
        joint_attention_dim=768,
        pooled_projection_dim=768,
        guidance_embeds=True,
        axes_dims_rope=(16, 24, 24),
    ).to(dtype=torch.float32).eval()

    n, t = args.image_tokens, args.text_tokens
    # img_ids: (0, row, col) for a side x side grid, row-major; txt_ids: zeros.
    rows = torch.arange(side, dtype=torch.float32).repeat_interleave(side)
    cols = torch.arange(side, dtype=torch.float32).repeat(side)
    img_ids = torch.stack([torch.zeros(n), rows, cols], dim=-1)  # [N, 3]
    txt_ids = torch.zeros(t, 3, dtype=torch.float32)  # [T, 3]

    inputs = dict(
        hidden_states=torch.randn(1, n, 384, dtype=torch.float32),
        encoder_hidden_states=torch.randn(1, t, 768, dtype=torch.float32),
        pooled_projections=torch.randn(1, 768, dtype=torch.float32),
        # NB: diffusers multiplies timestep and guidance by 1000 inside forward().
        timestep=torch.tensor([0.75], dtype=torch.float32),
        guidance=torch.tensor([30.0], dtype=torch.float32),
        img_ids=img_ids,
        txt_ids=txt_ids,
        return_dict=False,
    )

    times = []
    with torch.inference_mode():
        out = model(**inputs)[0]  # warm-up
        assert out.shape == (1, n, 64), out.shape
        for _ in range(args.iters):
            t0 = time.perf_counter()
            out = model(**inputs)[0]
            times.append(time.perf_counter() - t0)
    if not torch.isfinite(out).all():
        sys.exit("non-finite output")

    print(json.dumps({
        "impl": "diffusers",
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "threads": torch.get_num_threads(),
        "image_tokens": n,
        "text_tokens": t,
        "min_s": round(min(times), 6),
        "median_s": round(statistics.median(times), 6),
    }), flush=True)


if __name__ == "__main__":
    main()
