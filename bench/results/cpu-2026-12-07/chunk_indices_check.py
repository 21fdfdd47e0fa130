"""SGLang 0.5.23's chunk_gated_delta_rule (under TRITON_INTERPRET=1) on ragged batches with an empty sequence,
per sequence against the float64 recurrence: as shipped, and with ``prepare_chunk_indices`` replaced by one that
numbers each chunk with its own sequence (``repeat_interleave``), to tell the index from anything else.

    TRITON_INTERPRET=1 PYTHONPATH=. python bench/results/cpu-2026-12-07/chunk_indices_check.py /work/main/.sgl-tree
"""
import gc
import sys

import torch
import torch.nn.functional as F
import triton

import kvbuffer_ref
from kvbuffer.peers import sglang as S


def own_sequence(cu_seqlens, chunk_size):
    """[chunks, 2]: (the chunk's sequence, its index in the sequence)."""
    n = triton.cdiv(cu_seqlens[1:] - cu_seqlens[:-1], chunk_size)
    seq = torch.repeat_interleave(torch.arange(len(n)), n)
    return torch.stack([seq, torch.cat([torch.arange(int(c)) for c in n.tolist()])], 1).to(cu_seqlens)


def run(kernels, lens, H, K, V, label):
    g = torch.Generator().manual_seed(0)
    T = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    q = F.normalize(torch.randn(1, T, H, K, generator=g), dim=-1).half()
    k = F.normalize(torch.randn(1, T, H, K, generator=g), dim=-1).half()
    v, gate = torch.randn(1, T, H, V, generator=g).half(), F.logsigmoid(torch.randn(1, T, H, generator=g) + 3)
    beta, h0 = torch.rand(1, T, H, generator=g).half(), torch.randn(len(lens), H, K, V, generator=g) * 0.1
    o, st = S.SGLangChunk(kernels).chunk_gated_delta_rule(q, k, v, g=gate, beta=beta, initial_state=h0,
                                                          output_final_state=True, cu_seqlens=cu)
    d = lambda t: t.double()  # noqa: E731
    ro, rs = kvbuffer_ref.recurrent_gated_delta_rule(d(q), d(k), d(v), g=d(gate), beta=d(beta), initial_state=d(h0),
                                                      output_final_state=True, cu_seqlens=cu)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        rel = lambda x, y: float((d(x) - y).norm() / y.norm())  # noqa: E731
        print(f"{label}  lens {lens}  sequence {i} ({b - a} tokens): o rel-RMS "
              f"{rel(o[:, a:b], ro[:, a:b]) if b > a else float('nan'):.3g}, state rel-RMS {rel(st[i], rs[i]):.3g}, "
              f"non-finite o {int((~torch.isfinite(o[:, a:b])).sum())}, state {int((~torch.isfinite(st[i])).sum())}")


kernels = S.load_kernels(chunk=True, path=sys.argv[1])
cases = [([5, 0, 11, 2], 4, 6, 5), ([70, 0, 90, 5], 2, 16, 16)]
for c in cases:
    run(kernels, *c, "as shipped      ")
# the kernel modules' namespaces (their module objects may be gone: the loader takes them out of sys.modules)
patched = [d for d in gc.get_objects() if isinstance(d, dict) and "prepare_chunk_indices" in d
           and str(d.get("__name__", "")).startswith("sglang.kernels")]
for d in patched:
    d["prepare_chunk_indices"] = own_sequence
print("prepare_chunk_indices replaced in", sorted(d["__name__"].rsplit(".", 1)[-1] for d in patched))
for c in cases:
    run(kernels, *c, "own-seq indices ")
