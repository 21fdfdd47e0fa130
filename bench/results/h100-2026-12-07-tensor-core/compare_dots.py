"""The H100's float32 dots (micro_dots.py's micro.pt) against the tensor-core model (contracts._tc_product) and
the same products summed in IEEE float32 (_split_product): equal outputs, outputs more than 2 eps apart, errors.

    PYTHONPATH=. python bench/results/h100-2026-12-07-tensor-core/compare_dots.py micro.pt
"""
import torch, sys

from kvbuffer.validate.contracts import _tc_product, _split_product
R = torch.load(sys.argv[1] if len(sys.argv) > 1 else "micro.pt")
for key, d in R.items():
    if "tf32x3" not in key: continue
    A, B, C, O = d["A"], d["B"], d["C"], d["O"]
    acc = key.endswith("-1")
    tc = _tc_product(torch.einsum, "mk,kn->mn", A, B) + (C if acc else 0)
    sp = _split_product(torch.einsum, "mk,kn->mn", A, B) + (C if acc else 0)
    ex = A.double() @ B.double() + (C.double() if acc else 0)
    e = lambda x: ((x.double() - ex).norm() / ex.norm()).item()
    print(f"{key:20s} tc==hw {(tc == O).float().mean():.3f}  ulps>1 {((tc-O).abs() > 2*torch.finfo(torch.float32).eps*O.abs()).sum().item()}  err hw {e(O):.2e} tc {e(tc):.2e} split {e(sp):.2e}")
