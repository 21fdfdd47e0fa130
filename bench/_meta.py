"""What every GPU result file records about its run, and how it is written (shared by the
bench/gpu_*.py scripts)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time

import torch

__all__ = ["run_metadata", "save_json"]


def run_metadata(device: str, **extra) -> dict:
    """Device name, torch / triton / python / fla versions, the git commit and the start time."""
    import triton

    meta = dict(
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter smoke test)",
        torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
        started=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    try:
        meta["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                        timeout=10).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001 - no git on the machine: say so
        meta["commit"] = "unknown"
    try:
        import fla

        meta["fla"] = getattr(fla, "__version__", "?")
    except Exception as e:  # noqa: BLE001 - fla is optional; its rows say why they are missing
        meta["fla"] = f"unavailable: {e!r}"
    meta.update(extra)
    return meta


def save_json(path: str, obj: dict) -> None:
    """Write ``obj`` to ``path`` (creating its folder); called after each section so a crash keeps the rest."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=1)
