#!/usr/bin/env bash
# Serving benchmark for docs/performance.md: bench serve against the daemon in three
# configurations, each at one rate below and one above saturation.
#
#   continuous + disaggregated   (the default)
#   static                       ([denoise] batching = "static")
#   continuous, not disaggregated ([denoise] disaggregate = false)
#
# Usage: benches/serve_compare.sh [MODEL] [LOW_RPS] [HIGH_RPS] [REQUESTS_LOW] [REQUESTS_HIGH]
# Defaults: builtin:flux-small at 512x512 (1024 image tokens), 8 steps, 2 templates,
# mask ratios from the production face-swap/try-on trace. Results: one JSON line per
# run in target/bench-serve/results.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-builtin:flux-small}
low=${2:-0.03}
high=${3:-0.3}
n_low=${4:-8}
n_high=${5:-12}
size=${SIZE:-512}
steps=${STEPS:-8}
trace=tests/fixtures/traces/production_faceswap_tryon.txt
bin=target/release/denoised
cargo build --release
out=target/bench-serve
mkdir -p "$out"
: >"$out/results.jsonl"
# A flux-small template at 512x512 and 8 steps is ~600 MB of f32 cache: the cache
# arena holds two. (Arenas are reserved up front and count as memory.)
cfg="$out/config.toml"
printf '[workers]\ncache_arena_bytes = 1610612736\n' >"$cfg"

run_config() {
    local name=$1; shift
    local log="$out/$name.log"
    "$bin" serve --config "$cfg" --model "$model" --listen 127.0.0.1:0 "$@" >"$log" 2>&1 &
    local daemon=$!
    trap "kill $daemon 2>/dev/null || true" EXIT
    local url=""
    for _ in $(seq 1 1200); do
        url=$(grep -o 'http://[0-9.:]*' "$log" | head -1 || true)
        [ -n "$url" ] && break
        sleep 0.1
    done
    for rate in "$low:$n_low" "$high:$n_high"; do
        local rps=${rate%%:*} n=${rate##*:}
        echo "== $name at $rps rps, $n requests" >&2
        "$bin" bench serve --url "$url" --rps "$rps" --requests "$n" --width "$size" \
            --height "$size" --steps "$steps" --templates 2 --mask-trace "$trace" --json \
            | python3 -c "import sys, json; d = json.load(sys.stdin); d['config'] = '$name'; print(json.dumps(d))" \
            | tee -a "$out/results.jsonl"
    done
    kill -TERM $daemon
    wait $daemon || true
}

run_config continuous-disaggregated
run_config static --batching static
run_config continuous-inline --disaggregate false

python3 - "$out/results.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"{'config':28} {'offered':>8} {'thru rps':>9} {'mean s':>8} {'p50 s':>8} {'p95 s':>8} {'p99 s':>8} {'queue s':>8} {'batch':>6}")
for r in rows:
    print(f"{r['config']:28} {r['offered_rps']:8.3f} {r['throughput_rps']:9.4f} {r['mean_s']:8.1f} {r['p50_s']:8.1f} {r['p95_s']:8.1f} {r['p99_s']:8.1f} {r['queue_mean_s']:8.2f} {r['batch_mean']:6.2f}")
PY
