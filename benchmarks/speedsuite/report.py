"""``result.md`` and ``speed.png`` for a GPU speed-suite folder (the JSON files of ``gpu_suite``
and ``gpu_worker``)."""

from __future__ import annotations

import json
from pathlib import Path


def _load(folder: Path, name: str) -> dict | None:
    p = folder / name
    return json.loads(p.read_text()) if p.is_file() else None


def _s(v, fmt="{:.3f}") -> str:
    return "-" if v is None else fmt.format(v)


def _part(row: dict, part: str) -> float | None:
    p = (row.get("parts") or {}).get(part)
    return p["median"] if p else None


def speed_rows(folder: Path) -> list[dict]:
    """One row per measured configuration: name, family, seconds, speedup, where it came from."""
    folder = Path(folder)
    rows = []
    cache = _load(folder, "cache.json")
    for fname in ("cache.json", "compile.json", "baseline.json"):
        data = _load(folder, fname)
        if not data:
            continue
        # ratios against the eager baseline measured in the same process
        base = data["eager"][0]["end_to_end"]["median"]
        for r in data.get("eager", []) + data.get("compiled", []):
            rows.append({"name": r["name"], "family": r["family"], "gpus": 1, "seconds": r["end_to_end"]["median"],
                         "speedup": round(base / r["end_to_end"]["median"], 3), "shape": data["shape"],
                         "step": _part(r, "transformer_step"), "vae": _part(r, "vae_decode"),
                         "denoise": _part(r, "denoising"), "mask": (r.get("params") or {}).get("mask"),
                         "run": fname.split(".")[0]})
    uly = _load(folder, "parallel_ulysses.json")
    single = cache or _load(folder, "baseline.json") or _load(folder, "compile.json")
    if uly and single:
        # the single-GPU eager baseline measured by the same command on the same host
        base = single["eager"][0]["end_to_end"]["median"]
        for r in uly["rows"]:
            if "end_to_end" not in r:
                rows.append({"name": r["name"], "family": "parallel", "gpus": r["world_size"], "seconds": None,
                             "speedup": None, "shape": single["shape"], "step": None, "vae": None,
                             "denoise": None, "error": r.get("error")})
                continue
            rows.append({"name": r["name"], "family": "parallel", "gpus": r["world_size"],
                         "seconds": r["end_to_end"]["median"], "speedup": round(base / r["end_to_end"]["median"], 3),
                         "shape": single["shape"], "step": _part(r, "transformer_step"), "vae": _part(r, "vae_decode"),
                         "denoise": _part(r, "denoising"), "parity": r.get("parity")})
    cfgb, cfgp = _load(folder, "cfg_baseline.json"), _load(folder, "parallel_cfg.json")
    if cfgb:
        base = cfgb["baseline"]["end_to_end"]["median"]
        rows.append({"name": "qwen-baseline", "family": "baseline", "gpus": 1, "seconds": base, "speedup": 1.0,
                     "shape": cfgb["shape"], "step": _part(cfgb["baseline"], "transformer_step"),
                     "vae": _part(cfgb["baseline"], "vae_decode"), "denoise": _part(cfgb["baseline"], "denoising")})
        for r in (cfgp or {}).get("rows", []):
            rows.append({"name": r["name"], "family": "parallel", "gpus": r["world_size"],
                         "seconds": r["end_to_end"]["median"], "speedup": round(base / r["end_to_end"]["median"], 3),
                         "shape": cfgb["shape"], "step": _part(r, "transformer_step"), "vae": _part(r, "vae_decode"),
                         "denoise": _part(r, "denoising"), "parity": r.get("parity")})
    return rows


def write_speed_report(folder: Path) -> Path:
    folder = Path(folder)
    info = _load(folder, "run_info.json") or {}
    rows = speed_rows(folder)
    lines = ["# GPU speed suite", ""]
    env = info.get("env") or {}
    lines += [f"- command: `{info.get('command', '?')}`", f"- date: {info.get('date', '?')}",
              f"- GPUs: {', '.join(env.get('gpus', []) or ['none'])}; CUDA {env.get('cuda')}",
              f"- versions: {json.dumps(env.get('versions', {}))}", ""]
    if info.get("failures"):
        lines += ["**Failed parts:**", ""] + [f"- {f}" for f in info["failures"]] + [""]
    lines += ["Speedups are against the eager single-GPU baseline measured in the same process "
              "(the `run` column: `cache` and `compile` are separate processes, each with its own baseline).", "",
              "| run | configuration | shape | GPUs | end to end (s) | speedup | step (s) | denoise (s) | VAE (s) | parity PSNR / SSIM | mask |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        par = r.get("parity")
        ptxt = f"{_s(par.get('psnr'), '{:.1f}')} / {_s(par.get('ssim'), '{:.4f}')}" if par else "-"
        lines.append(f"| {r.get('run', '-')} | {r['name']} | {r['shape']} | {r['gpus']} | {_s(r['seconds'])} | {_s(r['speedup'], '{:.2f}x')} | "
                     f"{_s(r['step'], '{:.4f}')} | {_s(r['denoise'])} | {_s(r['vae'])} | {ptxt} | {r.get('mask') or '-'} |")
    cache = _load(folder, "compile.json") or _load(folder, "cache.json")
    if cache:
        lines += ["", f"FLOPs per transformer call: {cache['flops']['gflops_per_step']} GFLOP (torch FlopCounterMode)."]
        for k in ("efficiency_eager", "efficiency_compiled"):
            if cache.get(k):
                e = cache[k]
                lines.append(f"- {k.split('_')[1]}: {e['tflops']} TFLOP/s achieved per transformer call, "
                             f"{_s(e['share'], '{:.1%}')} of {e['peak_tflops']} TFLOP/s")
    gqa = _load(folder, "gqa.json")
    if gqa:
        lines += ["", "## GQA attention path", "",
                  f"Shape {gqa['shape']}. Selection run picked **{gqa['picked']}**; confirmation run (ms per call):", ""]
        for k, v in gqa["confirmation"]["seconds"].items():
            lines.append(f"- {k}: {v * 1e3:.3f} ms")
        lines.append(f"- picked / fastest = {gqa['picked_over_fastest']} (fastest: {gqa['fastest']})")
    scale = _load(folder, "scale.json")
    if scale:
        lines += ["", "## Scale", "", "| transformer | params | size | image tokens | step (s) | VAE decode (s) | peak MB |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in scale["rows"]:
            lines.append(f"| {r['scale']} | {r['transformer_params'] / 1e9:.2f} B | {r['size']}² | {r['image_tokens']} | "
                         f"{_s(r['transformer_step_s'], '{:.4f}')} | {_s(r['vae_decode_s'], '{:.4f}')} | {r['peak_memory_mb']} |")
    (folder / "result.md").write_text("\n".join(lines) + "\n")
    if rows:
        _plot(rows, folder / "speed.png")
    return folder / "result.md"


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.2))
    names = [f"{r['name']} ({r['gpus']} GPU)" for r in rows]
    colors = ["#888" if r["family"] == "baseline" else "#2a7" if r["family"].startswith("cache") else "#27c"
              for r in rows]
    ax.barh(names, [r["speedup"] or 0 for r in rows], color=colors)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("speedup over the eager single-GPU baseline of the same shape")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
