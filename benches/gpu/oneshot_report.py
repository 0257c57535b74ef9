#!/usr/bin/env python3
"""Assembles benches/gpu/oneshot.sh's parts into OUT/oneshot.json and OUT/summary.txt.

    oneshot_report.py DEVICE WORK_DIR PARTS_TSV OUT_DIR

Every key is always present: a figure whose part did not run (or failed) is null, and
`parts` says why (exit status 124 is a timeout). The targets are issue 46's, checked
only on a GPU; on the emulator the figures mean nothing and `targets` says so.
"""
import json
import os
import sys


def json_lines(path):
    """The JSON objects a part printed, one per line; other lines are ignored."""
    out = []
    if not os.path.exists(path):
        return out
    with open(path, errors="replace") as f:
        for line in f:
            line = line.strip()
            if line.startswith("{") and line.endswith("}"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    return out


def main():
    device, work, parts_tsv, out = sys.argv[1:5]
    parts = {}
    with open(parts_tsv) as f:
        for row in f:
            name, rc, secs = row.rstrip("\n").split("\t")
            parts[name] = {"exit": int(rc), "seconds": float(secs),
                           "status": {"0": "ok", "124": "timeout", "137": "timeout", "125": "skipped (deadline)"}.get(rc, "failed")}

    def lines(name):
        return json_lines(os.path.join(work, name + ".out"))

    machine = ""
    mpath = os.path.join(work, "machine.out")
    if os.path.exists(mpath):
        machine = open(mpath, errors="replace").read()

    # 1. Self-test.
    selftest = {"passed": None, "failed": None, "failures": [], "parts": []}
    spath = os.path.join(out, "selftest.json")
    if os.path.exists(spath):
        rep = json.load(open(spath))
        checks = [c for p in rep["parts"] for c in p["checks"]]
        selftest.update(
            device=rep.get("device"), vae_convolutions=rep.get("vae_convolutions"),
            attention=rep.get("attention"),
            passed=sum(c["pass"] for c in checks), failed=sum(not c["pass"] for c in checks),
            failures=[{"name": c["name"], "measured": c["measured"], "bound": c["bound"]}
                      for c in checks if not c["pass"]],
            parts=[{"part": p["part"], "seconds": p["seconds"],
                    "failed": sum(not c["pass"] for c in p["checks"])} for p in rep["parts"]],
        )

    # 2. Attention, beside SDPA.
    ours = {round(l["mask_ratio"], 3): l for l in lines("attn") if "tflops" in l and l.get("kernel", "fa2") == "fa2"}
    first = {round(l["mask_ratio"], 3): l for l in lines("attn") if "tflops" in l and l.get("kernel") == "mma"}
    wide = {round(l["mask_ratio"], 3): l for l in lines("attn") if "tflops" in l and l.get("kernel") == "fa2w"}
    library = {round(l["mask_ratio"], 3): l for l in lines("attn") if "tflops" in l and l.get("kernel") == "cudnn"}
    torch_attn = {round(l["mask_ratio"], 3): l for l in lines("torch_attn") if l.get("what") == "torch_sdpa"}
    backends = {}
    for l in lines("torch_attn"):
        if l.get("what") == "torch_sdpa_backend":
            backends.setdefault(round(l["mask_ratio"], 3), {})[l["backend"]] = l.get("tflops")
    attention = []
    for m in sorted(set(ours) | set(torch_attn)):
        o, t, f, w, c = ours.get(m), torch_attn.get(m), first.get(m), wide.get(m), library.get(m)
        # cuDNN's figures only where it ran; else why not (absent, or refused the shape).
        c_ran = c and c.get("path") == "library"
        c_status = ("ran" if c_ran else "not run: " + c.get("attention", "our kernel ran")) if c else "part not run"
        attention.append({
            "mask_ratio": m,
            "queries": (o or t)["queries"], "keys": (o or t)["keys"],
            "denoised_ms": o and o["median_s"] * 1e3, "denoised_tflops": o and o["tflops"],
            "sdpa_ms": t and t["median_s"] * 1e3, "sdpa_tflops": t and t["tflops"],
            "sdpa_over_denoised": (o and t) and o["median_s"] / t["median_s"],
            "first_kernel_ms": f and f["median_s"] * 1e3, "first_kernel_tflops": f and f["tflops"],
            "wide_kernel_ms": w and w["median_s"] * 1e3, "wide_kernel_tflops": w and w["tflops"],
            "cudnn_ms": c["median_s"] * 1e3 if c_ran else None, "cudnn_tflops": c["tflops"] if c_ran else None,
            "cudnn_status": c_status,
            # PyTorch's SDPA with each backend pinned (TFLOP/s; None where it cannot run).
            "sdpa_backend_tflops": backends.get(m, {}),
            "clock": o and o.get("clock"),
        })

    # 3. Steps, beside diffusers.
    steps = lines("step")
    full = next((l for l in steps if l.get("mask_ratio") == 1.0), None)
    edit = next((l for l in steps if l.get("mask_ratio") not in (None, 1.0)), None)
    wide_step = next((l for l in lines("step_fa2w") if l.get("mask_ratio") == 1.0), None)
    fp8 = next((l for l in lines("step_fp8") if l.get("mask_ratio") == 1.0), None)
    torch_step = next((l for l in lines("torch_step") if l.get("what") == "torch_full_step"), None)
    full_s = (full and full["median_s"]) or (edit and edit.get("full_median_s"))
    step = {
        "config": (full or edit or {}).get("config"),
        "full_bf16_ms": full_s and full_s * 1e3,
        "edit_m02_bf16_ms": edit and edit["median_s"] * 1e3,
        "edit_m02_speedup": edit and edit.get("speedup"),
        "edit_m02_fraction_of_bound": edit and edit.get("fraction_of_bound"),
        "full_fp8_ms": fp8 and fp8["median_s"] * 1e3,
        "full_fp8_over_bf16": (fp8 and full_s) and fp8["median_s"] / full_s,
        "full_bf16_wide_kernel_ms": wide_step and wide_step["median_s"] * 1e3,
        "diffusers_full_bf16_ms": torch_step and torch_step["median_s"] * 1e3,
        "diffusers_over_denoised": (full_s and torch_step) and full_s / torch_step["median_s"],
    }

    # Where a step's time goes, kernel by kernel (every call timed with CUDA events).
    kernels = [{"mask_ratio": l["mask_ratio"], "kernels_ms": l["kernels_ms"], "calls": l["calls"],
                "distinct": l["distinct"], "top": l["kernels"]}
               for l in lines("kernels") if l.get("what") == "kernel_table"]
    # PyTorch's per-tensor fp8 GEMM against bf16 at FLUX.1's shapes.
    torch_gemm = [{k: l.get(k) for k in ("rows", "out", "inner", "bf16_tflops", "fp8_tflops", "fp8_over_bf16", "fp8_error")}
                  for l in lines("torch_gemm") if l.get("what") == "torch_gemm"]
    # Nsight Compute's reports are in oneshot.log; here, whether they ran.
    ncu = {"attention_default": parts.get("attn_ncu", {}).get("status", "not run (name it in ONESHOT_PARTS)"),
           "attention_fa2": parts.get("attn_ncu_fa2", {}).get("status", "not run (name it in ONESHOT_PARTS)")}

    # 4. One template edit end to end, by parts.
    e = next((l for l in lines("edit") if l.get("what") == "template_edit"), None)
    edit_report = {"total_s": e and e["total_s"], "parts": e and e["parts"],
                   "denoise_step_s": e and e["denoise_step_s"], "size": e and e["size"],
                   "steps": e and e["steps"], "mask_ratio": e and e["mask_ratio"],
                   "pipeline": e and e["pipeline"], "raw": e}

    # 5. Daemon load.
    serve = next((l for l in lines("daemon_load") if "errors" in l), None)
    daemon = {k: (serve or {}).get(k) for k in
              ("requests", "ok", "errors", "rejected", "throughput_rps", "p50_s", "p95_s", "denoise_mean_s")}
    daemon["raw"] = serve
    # The daemon at FLUX.1-Fill-dev size, past saturation (its own part).
    fill = next((l for l in lines("load_fill_dev") if "errors" in l), None)
    load_fill_dev = {k: (fill or {}).get(k) for k in
                     ("requests", "ok", "errors", "rejected", "throughput_rps", "p50_s", "p95_s", "denoise_mean_s")}
    load_fill_dev["edits_per_s"] = load_fill_dev["throughput_rps"]
    load_fill_dev["status"] = parts.get("load_fill_dev", {}).get("status", "not run (name it in ONESHOT_PARTS)")
    load_fill_dev["raw"] = fill

    on_gpu = device != "emu"

    def target(value, bound, higher=False):
        if not on_gpu or value is None:
            return None
        return value >= bound if higher else value <= bound

    full_attn = next((a for a in attention if a["mask_ratio"] == 1.0), None)
    # Issue 46's targets.
    targets = {
        "checked": on_gpu,
        "cudnn_attention_tflops_at_least_550": target(full_attn and full_attn["cudnn_tflops"], 550, True),
        # The better of our FA2 kernels.
        "own_attention_tflops_at_least_300": target(
            full_attn and max(full_attn["denoised_tflops"] or 0, full_attn["wide_kernel_tflops"] or 0), 300, True),
        "full_step_bf16_at_most_125_ms": target(step["full_bf16_ms"], 125),
        "full_step_fp8_at_most_075x_bf16": target(step["full_fp8_over_bf16"], 0.75),
        "edit_step_m02_at_most_40_ms": target(step["edit_m02_bf16_ms"], 40),
        "edit_1024_m01_28_steps_at_most_1_5_s": target(edit_report["total_s"], 1.5),
    }
    report = {"device": device, "machine": machine, "parts": parts, "selftest": selftest,
              "attention": attention, "step": step, "kernels": kernels, "torch_gemm": torch_gemm, "ncu": ncu,
              "edit": edit_report, "daemon": daemon, "load_fill_dev": load_fill_dev, "targets": targets}
    with open(os.path.join(out, "oneshot.json"), "w") as f:
        json.dump(report, f, indent=1)

    def fmt(v, spec=".1f"):
        return "-" if v is None else format(v, spec)

    s = [f"denoised one-shot GPU run on {device}", ""]
    s.append("parts: " + ", ".join(f"{k} {v['status']} ({v['seconds']:.0f} s)" for k, v in parts.items()))
    s.append(f"selftest: {selftest['passed']} passed, {selftest['failed']} failed")
    s.append(f"attention: {selftest.get('attention')}")
    for c in selftest["failures"]:
        s.append(f"  FAILED {c['name']}: {c['measured']} (bound {c['bound']})")
    s.append("")
    s.append("attention     m   fa2 ms  TFLOP/s   SDPA ms  TFLOP/s   SDPA/fa2   fa2w TFLOP/s   mma TFLOP/s   cuDNN ms  TFLOP/s")
    for a in attention:
        s.append(f"          {a['mask_ratio']:5.2f}  {fmt(a['denoised_ms'], '7.3f')}  {fmt(a['denoised_tflops'], '7.1f')}"
                 f"  {fmt(a['sdpa_ms'], '8.3f')}  {fmt(a['sdpa_tflops'], '7.1f')}   {fmt(a['sdpa_over_denoised'], '.2f')}"
                 f"       {fmt(a['wide_kernel_tflops'], '7.1f')}       {fmt(a['first_kernel_tflops'], '7.1f')}"
                 f"   {fmt(a['cudnn_ms'], '8.3f')}  {fmt(a['cudnn_tflops'], '7.1f')}"
                 + ("" if a["cudnn_status"] == "ran" else f"  (cuDNN {a['cudnn_status']})"))
    s.append("")
    s.append(f"step ({step['config']}): full bf16 {fmt(step['full_bf16_ms'])} ms, m=0.2 edit {fmt(step['edit_m02_bf16_ms'])} ms"
             f" (speedup {fmt(step['edit_m02_speedup'], '.2f')}), diffusers full {fmt(step['diffusers_full_bf16_ms'])} ms"
             f" (diffusers/denoised {fmt(step['diffusers_over_denoised'], '.2f')}); full with the fa2w attention kernel"
             f" {fmt(step['full_bf16_wide_kernel_ms'])} ms; full with fp8 weights {fmt(step['full_fp8_ms'])} ms")
    s.append(f"edit ({edit_report['pipeline']}, {edit_report['size']}², m={edit_report['mask_ratio']}, {edit_report['steps']} steps):"
             f" {fmt(edit_report['total_s'], '.3f')} s end to end; parts {json.dumps(edit_report['parts'])}")
    for k in kernels:
        s.append(f"kernels at m={k['mask_ratio']}: {fmt(k['kernels_ms'], '.2f')} ms in {k['calls']} calls; top: "
                 + ", ".join(f"{t['name']} {100 * t['share']:.0f}%" for t in k["top"][:6]))
    for g in torch_gemm:
        s.append(f"torch gemm {g['rows']}x{g['out']}x{g['inner']}: bf16 {fmt(g['bf16_tflops'])} TFLOP/s,"
                 f" fp8 per-tensor {fmt(g['fp8_tflops'])} TFLOP/s ({fmt(g['fp8_over_bf16'], '.2f')}x the time)")
    s.append(f"ncu: {json.dumps(ncu)}")
    s.append(f"daemon: {daemon['requests']} requests, {daemon['errors']} errors, {fmt(daemon['throughput_rps'], '.2f')} RPS,"
             f" p50 {fmt(daemon['p50_s'], '.2f')} s, p95 {fmt(daemon['p95_s'], '.2f')} s")
    s.append(f"load at Fill-dev size ({load_fill_dev['status']}): {load_fill_dev['requests']} requests,"
             f" {load_fill_dev['errors']} errors, {fmt(load_fill_dev['edits_per_s'], '.2f')} edits/s,"
             f" p95 {fmt(load_fill_dev['p95_s'], '.2f')} s")
    s.append("targets: " + (json.dumps(targets) if on_gpu else "not checked on the emulator"))
    text = "\n".join(s) + "\n"
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write(text)
    print(text, end="")


if __name__ == "__main__":
    main()
