#!/usr/bin/env bash
# Per-role memory of the daemon on a real diffusers directory (docs/operations.md).
#
# Starts `denoised serve` on MODEL_DIR (default: a flux-small FluxFillPipeline written by
# benches/make_flux_small_dir.py, made first if missing; needs torch + diffusers), waits
# for /readyz, then prints each worker's resident memory from /proc: weights and heap
# (RssAnon + RssFile, each also shown: RssFile is mapped checkpoint pages still resident,
# which a worker releases once its weights are loaded) and its shared-memory arena
# (RssShmem, reserved at start), and the compute workers' total against the directory's
# size. All figures in MB (10^6 bytes), as the weights in /readyz.
#
# With TRANSFORMER=FILE the transformer comes from that single file (`[model] transformer`:
# a BFL safetensors, fp8 or GGUF file; benches/make_flux_small_formats.py writes flux-small's).
#
# Usage: [TRANSFORMER=FILE] benches/role_memory.sh [MODEL_DIR] [DEVICE]     (DEVICE: cpu by default)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-target/flux-small-dir}
device=${2:-cpu}
if [ ! -d "$dir" ]; then
    python3 benches/make_flux_small_dir.py "$dir"
fi
cargo build --release
# Small arenas: they are reserved up front and would otherwise dominate the figure;
# they are listed separately below anyway.
cfg=$(mktemp)
cat >"$cfg" <<TOML
[model]
source = "$dir"
transformer = "${TRANSFORMER:-}"
[device]
device = "$device"
[workers]
arena_bytes = 67108864
denoise_arena_bytes = 134217728
cache_arena_bytes = 67108864
TOML
log=$(mktemp)
./target/release/denoised serve --config "$cfg" --listen 127.0.0.1:0 >"$log" 2>&1 &
sup=$!
trap 'kill $sup 2>/dev/null || true; wait $sup 2>/dev/null || true; rm -f "$cfg" "$log"' EXIT
url=""
for _ in $(seq 1 3000); do
    url=$(grep -o 'listening on http://[0-9.:]*' "$log" | head -1 | sed 's/listening on //') || true
    [ -n "$url" ] && curl -sf "$url/readyz" >/dev/null && break
    sleep 0.2
done
[ -n "$url" ] || { cat "$log"; exit 1; }
sleep 1
dir_bytes=$(du -sb "$dir" | cut -f1)
mb() { echo $((${1:-0} * 1024 / 1000000)); }
printf '%-14s %12s %12s %12s %12s %12s\n' process weights+heap '(anon' 'file)' arena total
compute=0
for pid in $(pgrep -P "$sup"); do
    role=$(tr '\0' ' ' </proc/$pid/cmdline | grep -o -- '--role [a-z]*' | cut -d' ' -f2)
    idx=$(tr '\0' ' ' </proc/$pid/cmdline | grep -o -- '--index [0-9]*' | cut -d' ' -f2)
    kb() { awk -v k="$1:" '$1 == k {print $2}' /proc/$pid/status; }
    anon=$(kb RssAnon)
    file=$(kb RssFile)
    own=$((anon + file))
    shm=$(kb RssShmem)
    printf '%-14s %9s MB %9s MB %9s MB %9s MB %9s MB\n' "$role$idx" "$(mb $own)" "$(mb $anon)" \
        "$(mb $file)" "$(mb $shm)" "$(mb $((own + shm)))"
    case $role in preprocess|denoise|postprocess) compute=$((compute + own + shm)) ;; esac
done
printf 'directory %s MB; compute workers together %s MB = %.2fx the directory\n' \
    $((dir_bytes / 1000000)) "$(mb $compute)" \
    "$(echo "scale=3; $compute * 1024 / $dir_bytes" | bc)"
curl -s "$url/readyz" | python3 -c 'import json,sys; [print(p["name"], p["device"], p["dtype"], p["threads"], [(c["name"], round(c["weight_bytes"]/1e6,1), {f: round(b/1e6,1) for f, b in c.get("forms", {}).items()}) for c in p["components"]]) for p in json.load(sys.stdin)["processes"]]'
