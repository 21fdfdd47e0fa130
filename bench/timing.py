"""Device time of a benchmarked call, and the copy bandwidth every floor is taken against.

``device_ms(run, smoke)``: the median milliseconds of ``run()`` replayed from a CUDA graph with the L2
cleared before each replay (``--smoke``: the wall clock of one call under the Triton interpreter).
``copy_bandwidth(device, smoke)``: a device-to-device copy of 1 GiB of fp32.  triton is imported inside
``device_ms``: under ``--smoke`` the interpreter must be chosen before triton is first imported.
"""

from __future__ import annotations

import time
from typing import Callable

import torch


def device_ms(run: Callable[[], object], smoke: bool, warmup_ms: float = 25.0, rep_ms: float = 150.0,
              graph: bool = True):
    """Milliseconds of one ``run()`` and how they were taken.

    GPU: ``run`` is warmed up on a side stream, captured in a CUDA graph, and the replay timed by
    ``triton.testing.do_bench`` (CUDA events around each replay, the L2 cleared before each, median);
    if capture fails (or ``graph`` is False), the eager launches are timed the same way and the method
    says so.  Smoke: the
    wall clock of one call under the interpreter.
    """
    if smoke:
        t = time.perf_counter()
        run()
        return (time.perf_counter() - t) * 1e3, "wall clock of one call (Triton interpreter, smoke)"
    import triton.testing

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    method = "CUDA graph replay, triton.testing.do_bench median, L2 cleared before each replay"
    fn = run
    if not graph:
        method = "eager launch, triton.testing.do_bench median, L2 cleared before each call"
    else:
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                run()
            torch.cuda.synchronize()
            fn = g.replay
        except Exception as e:  # noqa: BLE001 - time the eager launches instead, and say so
            torch.cuda.synchronize()
            method = f"eager launches (graph capture failed: {type(e).__name__}: {str(e)[:160]}), do_bench median"
    ms = float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    return ms, method


def copy_bandwidth(device: str, smoke: bool) -> dict:
    """A device-to-device copy of 1 GiB of fp32 (bytes read + written over the median time).

    Timed eagerly: captured in a graph, the copy becomes a memcpy node served by the copy engines,
    about two thirds of the bandwidth the SMs' copy kernel reaches."""
    n = (1 << 16) if smoke else (1 << 28)
    x = torch.randn(n, device=device)
    y = torch.empty_like(x)
    ms, method = device_ms(lambda: y.copy_(x), smoke, rep_ms=300.0, graph=False)
    nbytes = 2 * x.numel() * x.element_size()
    return dict(bytes=nbytes, ms=ms, TBps=nbytes / (ms * 1e-3) / 1e12, method=f"torch copy_: {method}")
