"""The device launches of one fast-pool call, counted on any machine (the interpreter on a CPU).

``count_launches(fn)`` runs ``fn`` as it would run inside a CUDA graph capture (the fast pool's checks
that read device values switched off, as ``values_checked`` does while capturing) and counts

* ``triton``: Triton kernel launches, by kernel name;
* ``torch``: aten ops that would be device kernels (views, allocations and metadata queries are not);
* ``host``: ops that read a device value on the host or copy a host value in (a capture forbids them).

The aten ops a Triton launch makes under the interpreter (its copies to and from the host) are not
counted. ``python -m tests.pool.launches`` prints the counts of a pool decode, verify (without and with
``fold``) and accept (with and without its fold) at small shapes (the counts do not depend on the shapes),
after one uncounted round on a twin pool (the first call on a device allocates the reusable scratches).
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if not torch.cuda.is_available():  # kernels are decorated at import
    os.environ.setdefault("TRITON_INTERPRET", "1")


aten = torch.ops.aten
#: not kernels: allocations and metadata
_FREE = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.detach.default,
         aten.alias.default, aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.is_same_size.default}
#: a host read of a device value (a sync), or a host value copied in
_HOST = {aten._local_scalar_dense.default, aten.nonzero.default, aten.lift_fresh.default, aten.item.default,
         aten.masked_select.default}


class _Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.torch, self.host, self.paused = Counter(), Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and func not in _FREE and not func.is_view:
            (self.host if func in _HOST else self.torch)[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


class NoLaunch:
    """Stands in for a Triton kernel that must not be launched (``kernel[grid](...)`` fails the test): put in
    its module's place with monkeypatch.setattr, it shows that a call makes no such launch."""

    def __init__(self, why: str):
        self.why = why

    def __getitem__(self, grid):
        raise AssertionError(f"a launch was made (grid {grid}) though {self.why}")


def count_launches(fn) -> dict:
    """{"triton": Counter, "torch": Counter, "host": Counter} of one run of ``fn()`` (see the module)."""
    from triton.runtime import jit
    kinds = [jit.JITFunction]
    if os.environ.get("TRITON_INTERPRET") == "1":
        from triton.runtime.interpreter import InterpretedFunction
        kinds.append(InterpretedFunction)
    mode, launched = _Counter(), Counter()

    def counted(run):
        def wrapper(self, *args, **kwargs):
            if kwargs.get("warmup"):
                return run(self, *args, **kwargs)
            launched[self.__name__ if hasattr(self, "__name__") else self.fn.__name__] += 1
            mode.paused += 1
            try:
                return run(self, *args, **kwargs)
            finally:
                mode.paused -= 1
        return wrapper

    with contextlib.ExitStack() as stack:
        for kind in kinds:
            stack.enter_context(mock.patch.object(kind, "run", counted(kind.run)))
        stack.enter_context(mock.patch.dict(os.environ, {"KVBUFFER_POISON": "0"}))  # outputs: empty, not filled
        for module in ("kvbuffer_fast.pool", "kvbuffer_fast.verify", "kvbuffer_fast._common"):
            stack.enter_context(mock.patch(f"{module}.values_checked", lambda x: False))
        stack.enter_context(mode)
        fn()
    return {"triton": launched, "torch": mode.torch, "host": mode.host}


def pool_calls(device="cpu", B: int = 2, twin: bool = False):
    """A small pool with B live requests (a state each, one of them shared with a fork) and the four
    calls to count: {"decode": fn, "verify": fn, "verify_fold": fn, "accept": fn, "verify_fold_all": fn,
    "accept_nofold": fn} (layer 0, layer 0, layer 0, every layer, each layer, every layer), run in that order
    (the second verify replaces the first's drafts, and they are what accept takes; layer 1's are verified
    here), on a fork, the requests and a pad (int32 slots, parents, draft counts and accepted counts;
    verify's fold flags a bool tensor, as an engine computes them on the device); decode and accept fold
    every request, decode's fork and its source out of one shared slot (copy-on-write), and verify_fold
    every request but one; verify_fold_all folds every request in both layers (fold=True), so that
    accept_nofold (``accept(fold=False)``, D = C drafts onto emptied buffers) folds none.  ``twin``: (those
    calls, the same calls on a second pool holding the same tensors: ``copy_pool``)."""
    from kvbuffer_fast.pool import KVPool

    from .schedule import Tokens, copy_pool
    L, C, D, H, HV, K, V = 2, 3, 3, 1, 2, 4, 4
    shapes = dict(layers=L, num_state_slots=2 * B, num_buffer_slots=B + 1, capacity=C, max_drafts=D, num_heads=H,
                  num_value_heads=HV, head_k_dim=K, head_v_dim=V, device=device)
    p = KVPool(**shapes)
    tok = Tokens(0, H, HV, K, V, torch.float32, "cpu")
    draw = lambda n, T: {n_: t.to(device) for n_, t in tok.draw(n, T).items()}  # noqa: E731
    s = p.acquire(B).to(device)
    for layer in range(L):
        p.admit(**draw(B, C + 2), layer=layer, slots=s)                          # a state each, C - 1 entries
        p.decode(**draw(B, 1), layer=layer, slots=s)                              # full buffers
    f = p.acquire(1).to(device)
    p.fork(src=s[:1], dst=f, keep=C)                                              # shares request 0's slot
    rows = torch.cat([f, s, torch.tensor([-1], device=device)]).to(torch.int32)
    x, y = draw(B + 2, 1), draw(B + 2, D)
    # the draft structure and the counts as an engine passes them: int32 (each could cost a conversion launch)
    par = torch.arange(-1, D - 1, dtype=torch.int32, device=device).expand(B + 2, D).contiguous()
    nd = torch.full((B + 2,), D, dtype=torch.int32, device=device)
    p.verify(**y, layer=1, slots=rows, parents=par, num_drafts=nd)                # accept takes every layer
    counts = torch.full((B + 2,), D, dtype=torch.int32, device=device)
    fold = torch.arange(B + 2, device=device) != 1

    def calls(p):
        return {"decode": lambda: p.decode(**x, layer=0, slots=rows),
                "verify": lambda: p.verify(**y, layer=0, slots=rows, parents=par, num_drafts=nd),
                "verify_fold": lambda: p.verify(**y, layer=0, slots=rows, parents=par, num_drafts=nd, fold=fold),
                "accept": lambda: p.accept(slots=rows, counts=counts),
                "verify_fold_all": lambda: [p.verify(**y, layer=layer, slots=rows, parents=par, num_drafts=nd,
                                                     fold=True) for layer in range(L)],
                "accept_nofold": lambda: p.accept(slots=rows, counts=counts, fold=False)}
    if not twin:
        return calls(p)
    q = KVPool(**shapes)
    copy_pool(q, p)
    return calls(p), calls(q)


def steady_counts(device="cpu") -> dict:
    """{op: count_launches of it} for the calls of ``pool_calls``, after a round on a twin pool."""
    counted, warm = pool_calls(device, twin=True)
    for fn in warm.values():
        fn()
    return {op: count_launches(fn) for op, fn in counted.items()}


def main() -> None:
    for op, c in steady_counts().items():
        n = {k: sum(v.values()) for k, v in c.items()}
        print(f"{op}: {n['triton']} Triton launches, {n['torch']} torch kernels, {n['host']} host reads/copies")
        for kind in ("triton", "torch", "host"):
            if c[kind]:
                print(f"    {kind}: " + ", ".join(f"{k} x{v}" if v > 1 else k for k, v in sorted(c[kind].items())))


if __name__ == "__main__":
    main()
