"""What ran where: library versions and hardware, recorded in every run."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys

PACKAGES = ("torch", "diffusers", "cache-dit", "transformers", "papermill", "numpy", "scikit-image", "ditbook")


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def hardware() -> dict:
    info = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "gpus": [],
    }
    try:
        import torch

        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            info["cuda"] = torch.version.cuda
    except Exception:  # torch missing or broken: the record says so rather than failing the run
        info["gpus"] = None
    try:
        with open("/proc/meminfo") as fh:
            kb = int(fh.readline().split()[1])
        info["memory_gb"] = round(kb / 2**20, 1)
    except OSError:
        pass
    return info


def environment() -> dict:
    return {"versions": versions(), "hardware": hardware(), "argv": list(sys.argv),
            "offline": os.environ.get("HF_HUB_OFFLINE") == "1"}


def environment_rows() -> list[tuple[str, str]]:
    """The environment as (item, value) rows for a notebook table."""
    env = environment()
    rows = [(k, str(v)) for k, v in env["versions"].items()]
    rows += [(k, str(v)) for k, v in env["hardware"].items()]
    rows.append(("HF_HUB_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "")))
    return rows
