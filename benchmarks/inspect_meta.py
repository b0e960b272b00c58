"""Static inspection of a FLUX.1-dev-sized transformer built on the meta device.

FluxTransformer2DModel with FLUX.1-dev's config (19 double + 38 single blocks, 24 heads of
128, joint_attention_dim 4096, in_channels 64, guidance embedding) is built under
``torch.device("meta")`` (no weights, no memory for them) and handed to
``ditbook.arch.static.inspect_transformer``. Prints the import time, the build time, the inspection
wall time and the peak RSS of the process. Budget: inspection < 10 s, peak RSS < 2 GB.

Measured (CPU container, 2 cores, torch 2.13, diffusers 0.42.1, cache-dit 1.5.3;
`python benchmarks/inspect_meta.py`): build on meta 0.33 s, inspect_transformer 0.86 s (including
cache-dit's registry lookups), peak RSS 0.42 GB; the imports of torch + diffusers +
cache-dit took a further 14.2 s on this machine and are reported separately.
"""

from __future__ import annotations

import resource
import sys
import time


def peak_rss_gb() -> float:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / (1024 ** 2) if sys.platform != "darwin" else kb / 1024 ** 3


def main() -> int:
    t0 = time.perf_counter()
    import torch
    from diffusers import FluxTransformer2DModel

    from ditbook.arch.static import inspect_transformer

    t1 = time.perf_counter()
    with torch.device("meta"):
        model = FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
            axes_dims_rope=(16, 56, 56),
        )
    t2 = time.perf_counter()
    report = inspect_transformer(model, "FluxPipeline")
    t3 = time.perf_counter()
    lists = ", ".join(f"{b.path} x{b.length} {b.forward_pattern}" for b in report.block_lists)
    print(f"model: {report.transformer_class}, {report.param_count / 1e9:.2f} B parameters on meta")
    print(f"blocks: {lists}")
    print(f"attention: {report.attention.heads} heads x {report.attention.head_dim}, kv {report.attention.kv_heads}, "
          f"{report.attention.kind}; cache-dit adapter {report.support.cache_dit_adapter}")
    print(f"imports {t1 - t0:.2f} s | build on meta {t2 - t1:.2f} s | inspect_transformer {t3 - t2:.2f} s | "
          f"peak RSS {peak_rss_gb():.2f} GB")
    ok = (t3 - t2) < 10 and peak_rss_gb() < 2
    print("PASS" if ok else "FAIL", "(budget: inspection < 10 s, peak RSS < 2 GB)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
