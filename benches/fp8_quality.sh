#!/usr/bin/env bash
# The quality of fp8 transformer weights (docs/performance.md, "fp8 weights"): a
# flux-small generation and edit with `--weight-dtype fp8` against the same with the
# weights unquantised, on the CPU, whose fp8 mode is the reference computation of the
# device's (weights and each linear's input rows rounded to E4M3 under their own
# scales, then the f32 GEMM; the emulator's fp8 GEMM equals it within 1.5e-7, see
# `cargo test -p denoised-cuda --test kernels`). Prints PSNR and the largest level
# difference of the 8-bit images. Seeded weights, not a trained model: the figures
# bound what fp8 rounding does to this network, not to FLUX.1-dev's.
#
#     benches/fp8_quality.sh [OUT_DIR]     (about 8 minutes on 2 cores)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${DENOISED_BIN:-$ROOT/target/release/denoised}
OUT=${1:-$(mktemp -d)}
SIZE=${FP8_QUALITY_SIZE:-256}
STEPS=${FP8_QUALITY_STEPS:-20}
mkdir -p "$OUT"
PROMPT="a red bicycle leaning on a stone wall"

# The edit's input: the e2e fixture scaled up, a centred square mask (a quarter).
python3 - "$ROOT" "$OUT" "$SIZE" <<'PY'
import sys
from PIL import Image
root, out, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
Image.open(f"{root}/tests/fixtures/cases/e2e_input.png").convert("RGB").resize((n, n), Image.BICUBIC).save(f"{out}/input.png")
m = Image.new("L", (n, n), 0)
m.paste(255, (n // 4, n // 4, 3 * n // 4, 3 * n // 4))
m.save(f"{out}/mask.png")
PY

# Unquantised, then fp8 with a scale per output channel and per token (`channel`) and
# with one per weight and per GEMM input (`tensor`, applied inside cuBLASLt's GEMM).
for run in bf16 fp8-channel fp8-tensor; do
    case $run in
        bf16) w=(--weight-dtype bf16) ;;
        *) w=(--weight-dtype fp8 --fp8-scaling "${run#fp8-}") ;;
    esac
    "$BIN" generate --model builtin:flux-small-t2i --device cpu "${w[@]}" \
        --prompt "$PROMPT" --steps "$STEPS" --height "$SIZE" --width "$SIZE" \
        --max-sequence-length 64 --seed 3 --out "$OUT/generate_$run.png"
    "$BIN" edit --model builtin:flux-small --device cpu "${w[@]}" \
        --image "$OUT/input.png" --mask "$OUT/mask.png" --prompt "$PROMPT" \
        --steps "$STEPS" --max-sequence-length 64 --seed 3 --no-paste-back \
        --out "$OUT/edit_$run.png"
done

python3 - "$OUT" <<'PY'
import sys, json, math
import numpy as np
from PIL import Image
out = sys.argv[1]
mask = np.asarray(Image.open(f"{out}/mask.png")) > 127
for scaling in ["channel", "tensor"]:
    for what in ["generate", "edit"]:
        a = np.asarray(Image.open(f"{out}/{what}_bf16.png").convert("RGB")).astype(np.float64)
        b = np.asarray(Image.open(f"{out}/{what}_fp8-{scaling}.png").convert("RGB")).astype(np.float64)
        d = a - b
        psnr = lambda e: math.inf if e == 0 else 10 * math.log10(255.0 ** 2 / e)
        r = {"what": what, "fp8_scaling": scaling, "psnr_db": psnr((d ** 2).mean()),
             "max_level_diff": int(np.abs(d).max()), "mean_abs_level_diff": float(np.abs(d).mean())}
        if what == "edit":
            r["psnr_in_mask_db"] = psnr((d[mask] ** 2).mean())
        print(json.dumps(r))
PY
