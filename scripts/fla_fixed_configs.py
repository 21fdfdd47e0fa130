"""Run fla without autotuning: one fixed launch config per autotuned kernel, through fla's own config cache.

    python3 scripts/fla_fixed_configs.py DIR
    FLA_CACHE_MODE=default FLA_CONFIG_DIR=DIR python3 scripts/false_failures.py --impl fla --device cuda ...

fla autotunes each of its chunk kernels for every new (H, HV, K, V): a validation run that draws many small
shapes spends minutes per case compiling candidate configs (about 215 s for the first case of fla 0.6.0's chunk
lane on an H100, ten processes compiling at once).  fla reads a fixed config per kernel from
``$FLA_CONFIG_DIR/<kernel>.json`` when ``FLA_CACHE_MODE=default`` (fla/ops/utils/cache.py); this script writes
those files, one per autotuned kernel of the packages the validator calls, each naming one of the configs fla itself would try:
the first of its list, or the first with a reduced dot precision where the list has one (the least accurate
arithmetic fla may pick, so a correctness run judges the worst of its choices).  Every such config is one fla
may run with when autotuning, so a correctness verdict over it is a verdict about fla.

The configs depend on the GPU (fla builds its lists from the device's shared memory at import): run this on
the machine that runs the check.  Prints the kernels written, then the two environment variables to set.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
from pathlib import Path


# the packages whose kernels the validator's fla implementations call; fla names a config file after the kernel
# only, and other packages reuse these names with other tunable arguments, so only these are written
PACKAGES = ("fla.ops.common", "fla.ops.utils", "fla.ops.gated_delta_rule", "fla.ops.kda", "fla.modules.l2norm")


def _modules():
    for pkg in PACKAGES:
        mod = importlib.import_module(pkg)
        yield mod
        for info in pkgutil.walk_packages(getattr(mod, "__path__", []), pkg + "."):
            if ".backends" in info.name:
                continue
            try:
                yield importlib.import_module(info.name)
            except Exception:  # optional backends (tilelang, ...) that this machine lacks
                continue


def autotuners():
    """{kernel name: triton Autotuner} for every autotuned kernel of ``PACKAGES`` that imports here
    (decorators above the autotuner, such as ``triton.heuristics``, unwrapped); a name seen twice keeps the
    first package's kernel."""
    from triton.runtime.autotuner import Autotuner

    found = {}
    for mod in _modules():
        for name, obj in vars(mod).items():
            for _ in range(4):  # heuristics / jit wrappers around the autotuner
                if isinstance(obj, Autotuner) or not hasattr(obj, "fn"):
                    break
                obj = obj.fn
            if isinstance(obj, Autotuner):
                found.setdefault(getattr(obj, "kernel_name", name), obj)
    return found


def chosen(tuner):
    """The config written for ``tuner``: the first with a reduced ``DOT_PRECISION`` when any, else the first."""
    for c in tuner.configs:
        if c.kwargs.get("DOT_PRECISION", "ieee") != "ieee":
            return c
    return tuner.configs[0]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    tuners = autotuners()
    for name, tuner in sorted(tuners.items()):
        c = chosen(tuner)
        cfg = dict(kwargs=dict(c.kwargs), num_warps=c.num_warps, num_stages=c.num_stages,
                   num_ctas=getattr(c, "num_ctas", 1), maxnreg=getattr(c, "maxnreg", None))
        (out / f"{name}.json").write_text(json.dumps(dict(kernel_name=name, default_config=cfg), indent=1) + "\n")
        print(f"{name}: {cfg}")
    print(f"\n{len(tuners)} kernels; set FLA_CACHE_MODE=default FLA_CONFIG_DIR={out.resolve()}")
    return 0 if tuners else 1


if __name__ == "__main__":
    sys.exit(main())
