"""The hostile-input sweep (tests/hostile/probes.py): every public entry point of kvbuffer_ref and
kvbuffer_fast under bad and edge inputs gives a clear ValueError / TypeError naming the argument or
the exact answer, and never modifies its inputs.  Probes whose values would index out of bounds if
unchecked run in subprocesses, so that a crash (a segmentation fault under the interpreter, an illegal
address on a GPU) is a failure and not the end of the test run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .probes import all_probes, run_probe

ROOT = Path(__file__).resolve().parents[2]
PROBES = all_probes()
SAFE = [p for p in PROBES if not p.crashy]
CRASHY = [p.id for p in PROBES if p.crashy]
GROUPS = sorted({p.id.split("/")[0] for p in SAFE})


@pytest.mark.parametrize("group", GROUPS)
def test_bad_and_edge_inputs(group):
    """One test per entry point (its probes in this process): every probe passes."""
    failures = []
    n = 0
    for p in SAFE:
        if p.id.split("/")[0] != group:
            continue
        n += 1
        ok, what = run_probe(p)
        if not ok:
            failures.append(f"{p.id}: {what}")
    assert n > 0
    assert not failures, f"{len(failures)} of {n} probes failed:\n" + "\n".join(failures)


def run_in_subprocess(ids: list) -> dict:
    """{id: (ok, what)} for the probes ``ids``, run in child processes: a child that dies (a crash) fails
    the probe it was running, and a new child goes on with the rest."""
    env = dict(os.environ, KVBUFFER_POISON="1")
    env.setdefault("TRITON_INTERPRET", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    results, todo = {}, list(ids)
    while todo:
        proc = subprocess.run([sys.executable, "-m", "tests.hostile.probes"], input=json.dumps(todo), cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=600)
        running = None
        for line in proc.stdout.splitlines():
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if "start" in msg:
                running = msg["start"]
            else:
                results[msg["id"]] = (msg["ok"], msg["what"])
                running = None
        if proc.returncode != 0:
            if running is None:  # died outside any probe: fail the rest
                for pid in todo:
                    results.setdefault(pid, (False, f"the child process exited {proc.returncode}: {proc.stderr[-2000:]}"))
                break
            results[running] = (False, f"crashed the process (exit status {proc.returncode}): {proc.stderr[-1000:]}")
        todo = [pid for pid in todo if pid not in results]
    return results


@pytest.mark.parametrize("half", [0, 1])
def test_crash_prone_inputs_in_a_subprocess(half):
    ids = CRASHY[half::2]
    assert ids
    results = run_in_subprocess(ids)
    failures = [f"{pid}: {what}" for pid, (ok, what) in results.items() if not ok]
    assert len(results) == len(ids)
    assert not failures, f"{len(failures)} of {len(ids)} probes failed:\n" + "\n".join(failures)
