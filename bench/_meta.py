"""What every GPU result file records about its run, and how it is written (shared by the
bench/gpu_*.py scripts)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import time
import traceback

import torch

__all__ = ["run_metadata", "save_json", "sources_digest", "record_checks"]


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
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
        meta["commit_dirty"] = bool(dirty)  # the device's copy of a working tree can differ from its HEAD
    except Exception:  # noqa: BLE001 - no git on the machine: say so
        meta["commit"] = "unknown"
    meta["sources_sha256"] = sources_digest()
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


def sources_digest() -> str:
    """sha256 over the .py files of kvbuffer_fast and kvbuffer_ref (sorted paths): which code a result
    file measured, even where the recorded git HEAD is stale.  Recompute it at a commit with
    ``python -c "from bench._meta import sources_digest; print(sources_digest())"``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for pkg in ("kvbuffer_fast", "kvbuffer_ref"):
        for dirpath, _, files in sorted(os.walk(os.path.join(root, pkg))):
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    h.update(os.path.relpath(path, root).encode())
                    with open(path, "rb") as fh:
                        h.update(fh.read())
    return h.hexdigest()


def record_checks(out: list, label: str, fn) -> None:
    """Run ``fn`` (returning oracle Comparisons), append one row per comparison to ``out`` and print it;
    an exception becomes an error row, so a broken check is recorded and the GPU script goes on."""
    t0 = time.time()
    try:
        for c in fn():
            out.append(dict(check=label, name=c.name, dtype=str(c.dtype), passed=bool(c.passed),
                            worst_rel=c.worst_rel, baseline_rel=c.baseline_rel, budget=c.budget,
                            max_abs=c.max_abs, nonfinite=c.nonfinite, seconds=round(time.time() - t0, 2)))
            print(("   " if c.passed else "!! ") + label + ": " + str(c), flush=True)
    except Exception as e:  # noqa: BLE001 - recorded, the rest still runs
        out.append(dict(check=label, error=repr(e), trace=traceback.format_exc(limit=6)))
        print(f"!! {label}: ERROR {e!r}", flush=True)
