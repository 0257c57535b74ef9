#!/usr/bin/env bash
# Serving benchmark of the sparse VAE (docs/performance.md, "Sparse VAE"): two daemons,
# [pipeline] sparse_vae = "auto" and "off", driven in turn by bench-serve above
# saturation (ROUNDS rounds, off then auto each round, the same arrivals and masks), so
# both see the same machine minutes.
#
# Usage: benches/serve_sparse_vae.sh [MODEL] [RPS] [REQUESTS] [ROUNDS]
# Defaults: builtin:flux-small at 512x512, 4 steps, 2 templates, mask ratios from the
# production face-swap/try-on trace. Results: one JSON line per run in
# target/bench-serve/sparse_vae.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-builtin:flux-small}
rps=${2:-0.5}
n=${3:-6}
rounds=${4:-2}
size=${SIZE:-512}
steps=${STEPS:-4}
trace=tests/fixtures/traces/production_faceswap_tryon.txt
bin=target/release/denoised
cargo build --release
out=target/bench-serve
mkdir -p "$out"
: >"$out/sparse_vae.jsonl"
cfg="$out/config.toml"
# The templates' VAE traces (3.5 GB each at 512x512 for the FLUX.1 VAE) are stored in
# the cache's memory beside their K/V and pass through the workers' arenas on capture.
printf '[workers]\ncache_arena_bytes = %s\narena_bytes = %s\n' \
    "${CACHE_ARENA:-8589934592}" "${ARENA:-2684354560}" >"$cfg"

declare -A url pid
start() {
    local name=$1; shift
    local log="$out/sparse_vae_$name.log"
    "$bin" serve --config "$cfg" --model "$model" --listen 127.0.0.1:0 "$@" >"$log" 2>&1 &
    pid[$name]=$!
    for _ in $(seq 1 1200); do
        url[$name]=$(grep -o 'http://[0-9.:]*' "$log" | head -1 || true)
        [ -n "${url[$name]}" ] && break
        sleep 0.1
    done
}
trap 'kill ${pid[off]:-} ${pid[auto]:-} 2>/dev/null || true' EXIT
start off --sparse-vae off
start auto --sparse-vae auto

for round in $(seq 1 "$rounds"); do
    for name in off auto; do
        echo "== sparse_vae $name, round $round: $n requests at $rps rps" >&2
        "$bin" bench-serve --url "${url[$name]}" --rps "$rps" --requests "$n" --width "$size" \
            --height "$size" --steps "$steps" --templates 2 --mask-trace "$trace" --json \
            | python3 -c "import sys, json; d = json.load(sys.stdin); d['sparse_vae'] = '$name'; d['round'] = $round; print(json.dumps(d))" \
            | tee -a "$out/sparse_vae.jsonl"
    done
done
kill -TERM "${pid[off]}" "${pid[auto]}"
wait "${pid[off]}" "${pid[auto]}" || true
