"""The GPU runner's launch overrides (``--set OP.FIELD=VALUE``): parsed, checked against the launch
table's config classes, applied per call as ``dataclasses.replace(config_for(op, key), ...)``, and
never written into the package."""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import workloads as W

launch = pytest.importorskip("kvbuffer_fast.launch", reason="kvbuffer_fast has no launch tables")
ROOT = Path(__file__).resolve().parents[2]


def test_overrides_parse_values_and_reject_malformed_items():
    got = W.parse_overrides(["decode.fold_FH=4", "verify.early=True", "decode.fold=tile", "x.y=0.5"])
    assert got == {"decode": {"fold_FH": 4, "fold": "tile"}, "verify": {"early": True}, "x": {"y": 0.5}}
    for bad in ("decode.fold_FH", "fold_FH=4", ".x=1", "decode.=1"):
        with pytest.raises(ValueError, match="OP.FIELD=VALUE"):
            W.parse_overrides([bad])


@pytest.mark.parametrize("overrides, match", [({"decode": {"no_such_field": 1}}, "no field"),
                                              ({"no_such_op": {"BV": 1}}, "no launch table")])
def test_unknown_overrides_fail_clearly(overrides, match):
    with pytest.raises(ValueError, match=match):
        W.Api(overrides)


@pytest.mark.parametrize("op, fields", [("decode", {"fold_FH": 2}), ("verify", {"early": True, "KB": 16})])
def test_override_replaces_only_its_fields_and_writes_no_module_state(op, fields):
    api = W.Api({op: fields})
    tables = copy.deepcopy(launch.TABLES)
    wl = W.Workload(W.SMOKE, 2, "cpu")
    x = wl.tokens(1, seed=0)

    def fn(q, *, config=None):  # the config API's shape of a public op
        return config

    cfg = api.kwargs(op, fn, x, C=W.SMOKE.C)["config"]
    key = launch.key_of(x["q"], C=W.SMOKE.C, B=2, HV=W.SMOKE.shapes.HV, V=W.SMOKE.shapes.V)
    assert cfg == dataclasses.replace(launch.config_for(op, key), **fields)
    assert launch.TABLES == tables and launch.config_for(op, key) != cfg
    assert api.kwargs("accept", fn, x, C=W.SMOKE.C) == {}  # no override of that table: no keyword


def test_aot_register_report_runs():
    """scripts/aot_regs.py compiles a kept kernel (the bookkeeping kernel: the quickest) for sm_90 ahead
    of time and reads ptxas's report (in a subprocess: the tests run Triton in interpreter mode)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "aot_regs.py"), "book"], capture_output=True,
                         text=True, env=env, timeout=300)
    if "no usable ptxas" in out.stdout + out.stderr:
        pytest.skip("no usable ptxas for sm_90 in this Triton install")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "regs" in out.stdout and int(out.stdout.split("regs ")[1].split()[0]) > 0, out.stdout


@pytest.mark.parametrize("op", ["pool_verify", "pool_accept"])
def test_overrides_reach_the_pools_calls(op, monkeypatch):
    """``--set verify.* / accept.*`` reach the pool's verify and accept in the pool ops (each call gets the
    replaced config), so the pool round's launches can be swept like the plain ones."""
    api = W.Api({"verify": {"KB": 16}, "accept": {"CH": 256}})
    KVPool = api.pool_class()
    seen = {"verify": [], "accept": []}
    for name in seen:
        real = getattr(KVPool, name)

        @functools.wraps(real)  # its signature (config=) is what the runner inspects
        def spy(self, *a, _real=real, _name=name, **kw):
            seen[_name].append(kw.get("config"))
            return _real(self, *a, **kw)
        monkeypatch.setattr(KVPool, name, spy)
    W.build(op, api, W.Workload(W.SMOKE, 2, "cpu")).run()
    assert seen["verify"] and all(c is not None and c.KB == 16 for c in seen["verify"])
    assert seen["accept"] and all(c is not None and c.CH == 256 for c in seen["accept"])
