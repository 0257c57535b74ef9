#!/usr/bin/env bash
# Serving benchmark of the sparse VAE (docs/performance.md, "Sparse VAE"): a daemon with
# [pipeline] sparse_vae = "off", then one with "auto", driven by bench serve above
# saturation (ROUNDS rounds, off then auto each round, the same arrivals and masks), so
# both see the same machine minutes.
#
# Usage: benches/serve_sparse_vae.sh [MODEL] [RPS] [REQUESTS] [ROUNDS]
# Defaults: builtin:flux-small at 512x512, 4 steps, 1 template (TEMPLATES), mask ratios from the
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
# The "auto" daemon stores each template's VAE traces (3.5 GB at 512x512 for the FLUX.1
# VAE) in the cache's memory beside its K/V, and they pass through the workers' arenas
# on capture; arenas are reserved at start, so the "off" daemon gets the small ones.
printf '[workers]\ncache_arena_bytes = 1610612736\n' >"$out/off.toml"
printf '[workers]\ncache_arena_bytes = %s\narena_bytes = %s\n' \
    "${CACHE_ARENA:-5368709120}" "${ARENA:-2684354560}" >"$out/auto.toml"
templates=${TEMPLATES:-1}

# One daemon at a time (arenas are reserved at start: both at once do not fit a 24 GB
# machine), started for each run: every run captures its templates, then is measured.
trap 'kill ${pid:-} 2>/dev/null || true' EXIT
for round in $(seq 1 "$rounds"); do
    for name in off auto; do
        log="$out/sparse_vae_$name.log"
        "$bin" serve --config "$out/$name.toml" --model "$model" --listen 127.0.0.1:0 \
            --sparse-vae "$name" >"$log" 2>&1 &
        pid=$!
        url=
        for _ in $(seq 1 1200); do
            url=$(grep -o 'http://[0-9.:]*' "$log" | head -1 || true)
            [ -n "$url" ] && break
            sleep 0.1
        done
        echo "== sparse_vae $name, round $round: $n requests at $rps rps" >&2
        "$bin" bench serve --url "$url" --rps "$rps" --requests "$n" --width "$size" \
            --height "$size" --steps "$steps" --templates "$templates" --mask-trace "$trace" --json \
            | python3 -c "import sys, json; d = json.load(sys.stdin); d['sparse_vae'] = '$name'; d['round'] = $round; print(json.dumps(d))" \
            | tee -a "$out/sparse_vae.jsonl"
        kill -TERM "$pid"
        wait "$pid" || true
    done
done
