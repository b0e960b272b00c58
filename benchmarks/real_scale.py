"""The playbook at real model size on one GPU (issue 24, item 3): a FLUX.1-dev-shaped or a
Wan2.1-T2V-1.3B-shaped pipeline with random weights, saved with ``save_pretrained``, through all five
stages of ``ditbook run`` with a card sized as a user would size it; per stage the seconds and the
GPU's peak memory.

    . .gpu-wheels/install.sh && python3 benchmarks/real_scale.py --shape flux --work /tmp/rs \\
        --record OUT/real_scale_flux.json

The shapes are the published ``config.json`` of each part (numbers in ``speedsuite.fullsize`` and
``speedsuite.video``; text encoders below): the text encoders are built at their real sizes (CLIP-L
and T5-v1.1-XXL for FLUX, UMT5-XXL for Wan), with the shipped reference models' small tokenizers
(token ids stay far below the real vocabularies). The weights are random, so the images are not
pictures; what is measured is what a user waits for and how much memory each stage needs.

The run is the user's: ``ditbook run CARD`` (intake, inspect; the cache stage stops at the approval
gate), ``ditbook approve CARD --run RUN --yes``, ``ditbook run --resume RUN``. Peak memory is the
device's used memory (``nvidia-smi``, every 0.25 s) over each stage's wall-clock window, so it
counts the CUDA context and any helper process the stage starts. ``--budget`` bounds the whole
command: a stage that would run past it is stopped, and the record says which.

``--continue`` picks up a ``--work`` folder an earlier command left (on a host that kept it, as a
warm device does between calls): the saved pipeline is not built again, an unfinished run is
approved and resumed, and the record counts the calls and memory samples of every command
(``state.json`` in the work folder), so a playbook longer than one command's limit is measured
whole.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO / "lib")]

STAGES = ("intake", "inspect", "cache", "parallel", "benchmark")

# published text encoder configs: openai/clip-vit-large-patch14 (text part), google/t5-v1_1-xxl,
# google/umt5-xxl (the encoders of FLUX.1-dev and Wan2.1)
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
              num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768)
T5_XXL = dict(vocab_size=32128, d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24,
              feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
              relative_attention_max_distance=128, layer_norm_epsilon=1e-6, tie_word_embeddings=False)
UMT5_XXL = {**T5_XXL, "vocab_size": 256384}
# --tiny: the same code path on a CPU in seconds (every width shrunk; the tokenizers stay)
TINY = {"flux": dict(num_layers=1, num_single_layers=1, num_attention_heads=2, attention_head_dim=16,
                     joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)),
        "vae": dict(block_out_channels=(32, 32), down_block_types=("DownEncoderBlock2D",) * 2,
                    up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, norm_num_groups=8),
        "clip": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, projection_dim=32),
        "t5": dict(d_model=32, d_ff=64, d_kv=16, num_heads=2, num_layers=1),
        "wan": dict(num_attention_heads=2, attention_head_dim=16, ffn_dim=64, num_layers=1, text_dim=32, freq_dim=16),
        "wan_vae": dict(base_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=1)}
TINY_GENERATION = {"flux": {"height": 64, "width": 64, "steps": 4, "extra": {"max_sequence_length": 16}},
                   "wan": {"height": 32, "width": 32, "steps": 4, "extra": {"num_frames": 5, "max_sequence_length": 16}}}

# what a user would try first at this size: two prompts, one seed (held-out seed: +1000), the
# strategies without a fitted calibration, three configurations each, the verdict's own timing rules
CARDS = {
    "flux": {"generation": {"prompts": ["a red fox in the snow", "a lighthouse at dusk"], "seeds": [0],
                            "height": 512, "width": 512, "steps": 20, "guidance_scale": 3.5,
                            "extra": {"max_sequence_length": 256}},
             "cache": {"strategies": ["dbcache_taylorseer", "scm", "diffusers_fbc"], "max_configs": 3},
             "benchmark": {"warmup": 1, "repeats": 3, "max_cases": 1}},
    "wan": {"generation": {"prompts": ["a red fox running in the snow"], "seeds": [0],
                           "negative_prompt": "blurry, low quality", "height": 480, "width": 832,
                           "steps": 8, "guidance_scale": 5.0, "extra": {"num_frames": 81, "max_sequence_length": 128}},
            "cache": {"strategies": ["dbcache_taylorseer"], "max_configs": 2, "confirm_tries": 1},
            "benchmark": {"warmup": 1, "repeats": 3, "max_cases": 1}, "runtime": {"compile": False}},
}


def _log(msg: str) -> None:
    print(f"[real_scale {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_flux(folder: Path, device: str = "cuda", tiny: bool = False) -> dict:
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5TokenizerFast
    from speedsuite.fullsize import FLUX_DEV, FLUX_SCHEDULER, FLUX_VAE, _make

    dtype = torch.float32 if tiny else torch.bfloat16
    ref = REPO / "models" / "reference" / "pipeline"
    t = TINY if tiny else {}
    parts = dict(transformer=_make(FluxTransformer2DModel, {**FLUX_DEV, **t.get("flux", {})}, device, dtype, 0),
                 vae=_make(AutoencoderKL, {**FLUX_VAE, **t.get("vae", {})}, device, dtype, 1),
                 text_encoder=_make_hf(CLIPTextModel, CLIPTextConfig(**{**CLIP_L, **t.get("clip", {})}), device, dtype, 2),
                 text_encoder_2=_make_hf(T5EncoderModel, T5Config(**{**T5_XXL, **t.get("t5", {})}), device, dtype, 3),
                 tokenizer=CLIPTokenizer.from_pretrained(ref / "tokenizer"),
                 tokenizer_2=T5TokenizerFast.from_pretrained(ref / "tokenizer_2"),
                 scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER))
    pipe = FluxPipeline(**parts)
    return _save(pipe, folder, "FluxPipeline", "FluxTransformer2DModel")


def build_wan(folder: Path, device: str = "cuda", tiny: bool = False) -> dict:
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import T5TokenizerFast, UMT5Config, UMT5EncoderModel
    from speedsuite.fullsize import _make
    from speedsuite.video import SCHEDULER, WAN_1_3B

    dtype = torch.float32 if tiny else torch.bfloat16
    t = TINY if tiny else {}
    ref = REPO / "models" / "video_reference" / "pipeline"
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        flow_shift=SCHEDULER["shift"], num_train_timesteps=SCHEDULER["num_train_timesteps"])
    pipe = WanPipeline(transformer=_make(WanTransformer3DModel, {**WAN_1_3B, **t.get("wan", {})}, device, dtype, 0),
                       vae=_make(AutoencoderKLWan, t.get("wan_vae", {}), device, dtype, 1),
                       text_encoder=_make_hf(UMT5EncoderModel, UMT5Config(**{**UMT5_XXL, **t.get("t5", {})}), device,
                                             dtype, 2),
                       tokenizer=T5TokenizerFast.from_pretrained(ref / "tokenizer"), scheduler=scheduler)
    return _save(pipe, folder, "WanPipeline", "WanTransformer3DModel")


def _make_hf(cls, config, device: str, dtype, seed: int):
    import torch

    torch.manual_seed(seed)
    with torch.device(device):
        model = cls(config)
    return model.to(device=device, dtype=dtype).eval()


def _save(pipe, folder: Path, pipeline_cls: str, transformer_cls: str) -> dict:
    import torch

    counts = {name: sum(p.numel() for p in part.parameters()) for name, part in pipe.components.items()
              if isinstance(part, torch.nn.Module)}
    t0 = time.perf_counter()
    pipe.save_pretrained(folder, safe_serialization=True)
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    del pipe
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"pipeline": pipeline_cls, "transformer": transformer_cls, "parameters": counts,
            "saved_gb": round(size / 2**30, 2), "save_s": round(time.perf_counter() - t0, 1)}


def write_card(shape: str, folder: Path, built: dict, card_path: Path, tiny: bool = False,
               settings: list[str] | None = None) -> None:
    """The card a user would write for the built pipeline; ``settings``: ``KEY=VALUE`` pairs (a
    dotted key, a YAML value) set on it, e.g. ``cache.fp8=true``."""
    import yaml as pyyaml

    sized = json.loads(json.dumps(CARDS[shape]))
    if tiny:
        sized["generation"].update(TINY_GENERATION[shape])
    sized["runtime"] = {"device": "cpu", "dtype": "float32"} if tiny else {"device": "cuda", "dtype": "bfloat16"}
    for item in settings or []:
        key, _, value = item.partition("=")
        *parents, leaf = key.split(".")
        node = sized
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = pyyaml.safe_load(value)

    card = {"name": f"real_{shape}", "path": str(folder),
            "pipeline": {"class": built["pipeline"], "source": "diffusers"},
            "transformer": {"class": built["transformer"], "source": "diffusers", "subfolder": "transformer"},
            **sized}
    card_path.write_text(pyyaml.safe_dump(card, sort_keys=False))


class MemorySampler(threading.Thread):
    """The device's used memory (MiB) with a timestamp, every ``period`` seconds, from nvidia-smi."""

    def __init__(self, period: float = 0.25):
        super().__init__(daemon=True)
        self.samples: list[tuple[float, float]] = []
        self.period, self.stop = period, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                      "-i", "0"], capture_output=True, text=True, timeout=5).stdout
                self.samples.append((time.time(), float(out.split()[0])))
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                pass
            self.stop.wait(self.period)

    def peak_gib(self, start: float, end: float) -> float | None:
        inside = [m for t, m in self.samples if start <= t <= end]
        return round(max(inside) / 1024, 2) if inside else None


def _ditbook(args: list[str], deadline: float, log) -> dict:
    left = deadline - time.time()
    if left < 20:
        return {"returncode": None, "timed_out": True, "seconds": 0.0}
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "ditbook", *args], stdout=log, stderr=subprocess.STDOUT,
                            cwd=REPO, start_new_session=True)
    try:
        rc, timed_out = proc.wait(timeout=left), False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        rc, timed_out = proc.wait(), True
    return {"returncode": rc, "timed_out": timed_out, "seconds": round(time.time() - t0, 1)}


def run_playbook(card: Path, outputs: Path, deadline: float, log) -> tuple[Path, list[dict]]:
    """The user's calls that are still to make: ``run`` (when the run folder is not there yet),
    ``approve`` and ``run --resume`` (until the run is finished)."""
    run = outputs / card.stem / "real"
    meta = json.loads((run / "run.json").read_text()) if (run / "run.json").exists() else None
    steps = [] if meta else [("run", ["run", str(card), "--run-id", "real", "--outputs", str(outputs)])]
    if not meta or meta.get("status") != "finished":
        steps += [("approve", ["approve", str(card), "--run", str(run), "--yes"]),
                  ("resume", ["run", "--resume", str(run)])]
    calls = []
    for name, args in steps:
        _log(f"ditbook {' '.join(args)}")
        calls.append({"call": name, **_ditbook(args, deadline, log)})
        if calls[-1]["timed_out"]:
            break
    return run, calls


def stage_rows(run: Path, sampler: MemorySampler) -> list[dict]:
    meta_path = run / "run.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    rows = []
    for stage in STAGES:
        info = (meta.get("stages") or {}).get(stage) or {}
        start, secs = info.get("started"), info.get("seconds")
        peak = sampler.peak_gib(start, start + secs) if start and secs else None
        rows.append({"stage": stage, "status": info.get("status", "not run"), "seconds": secs, "peak_gib": peak,
                     "error": (info.get("error") or "")[-600:] or None})
    return rows


def verdict(run: Path) -> dict:
    out = {}
    cache = run / "cache" / "results.json"
    if cache.exists():
        res = json.loads(cache.read_text())
        out.update({f"cache.{key}": res.get(key) for key in ("chosen", "refused")})
    result = run / "result.md"
    if result.exists():
        out["result_md_head"] = result.read_text()[:1500]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(CARDS), required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/real_scale"))
    ap.add_argument("--record", type=Path, required=True, help="JSON record written here")
    ap.add_argument("--budget", type=float, default=560.0, help="seconds for the whole command")
    ap.add_argument("--tiny", action="store_true", help="every width shrunk, on the CPU: the code path in minutes")
    ap.add_argument("--continue", dest="resume", action="store_true",
                    help="continue what an earlier command left in --work (no new build; the run resumed; the record "
                         "covers every command)")
    ap.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                    help="a card setting on top of the shape's card (dotted key, YAML value; repeatable), "
                         "e.g. --set cache.fp8=true")
    ap.add_argument("--build-only", action="store_true",
                    help="build and save the pipeline, write built.json beside it, and exit (the run does this in a "
                         "child process, so the measuring process holds no GPU memory)")
    args = ap.parse_args(argv)
    deadline = time.time() + args.budget
    work = args.work / args.shape
    folder, card = work / "pipeline", work / f"real_{args.shape}.yaml"
    work.mkdir(parents=True, exist_ok=True)
    if args.build_only:
        built = (build_flux if args.shape == "flux" else build_wan)(folder, "cpu" if args.tiny else "cuda", args.tiny)
        (work / "built.json").write_text(json.dumps(built))
        return 0
    state_path = work / "state.json"
    state = json.loads(state_path.read_text()) if args.resume and state_path.exists() else {}
    sampler = MemorySampler()
    sampler.samples = [tuple(x) for x in state.get("samples", [])]
    sampler.start()
    t0 = time.time()
    if state.get("built") and (folder / "model_index.json").exists():
        built = state["built"]
        _log(f"continuing in {work}: the pipeline built by an earlier command is kept")
    else:
        _log(f"building the {args.shape}-shaped pipeline into {folder}")
        subprocess.run([sys.executable, __file__, "--shape", args.shape, "--work", str(args.work), "--record",
                        str(args.record), "--build-only"] + (["--tiny"] if args.tiny else []), check=True)
        built = json.loads((work / "built.json").read_text())
        built["build_s"] = round(time.time() - t0, 1)
        _log(f"built: {built}")
        time.sleep(1.0)
        built["gpu_used_before_run_gib"] = sampler.peak_gib(time.time() - 0.9, time.time())
        write_card(args.shape, folder, built, card, args.tiny, args.settings)
        state = {"built": built, "calls": [], "commands_s": []}
    with (work / "ditbook.log").open("a") as log:
        run, calls = run_playbook(card, work / "outputs", deadline, log)
    sampler.stop.set()
    state["calls"] = state.get("calls", []) + calls
    state["commands_s"] = state.get("commands_s", []) + [round(time.time() - t0, 1)]
    state["samples"] = sampler.samples
    state_path.write_text(json.dumps(state))
    rows = stage_rows(run, sampler)
    record = {"shape": args.shape, "card": CARDS[args.shape], "settings": args.settings, "built": built, "calls": state["calls"], "stages": rows,
              "whole_playbook_s": round(sum(r["seconds"] or 0 for r in rows), 1),
              "command_s": round(sum(state["commands_s"]), 1), "commands_s": state["commands_s"], "run": str(run),
              **verdict(run), "log_tail": (work / "ditbook.log").read_text()[-4000:]}
    args.record.parent.mkdir(parents=True, exist_ok=True)
    args.record.write_text(json.dumps(record, indent=2))
    for r in rows:
        _log(f"{r['stage']:9s} {r['status']:8s} {r['seconds']} s  peak {r['peak_gib']} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
