import os, sys, json, torch, triton, triton.language as tl
OUT = os.environ.get("OUT", "/tmp/o")

@triton.jit
def dotk(a_ptr, b_ptr, c_ptr, o_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr):
    om = tl.arange(0, M); on = tl.arange(0, N); ok = tl.arange(0, K)
    a = tl.load(a_ptr + om[:, None] * K + ok[None, :])
    b = tl.load(b_ptr + ok[:, None] * N + on[None, :])
    if ACC:
        c = tl.load(c_ptr + om[:, None] * N + on[None, :])
        o = tl.dot(a, b, c, input_precision=PREC)
    else:
        o = tl.dot(a, b, input_precision=PREC)
    tl.store(o_ptr + om[:, None] * N + on[None, :], o)

res = {}
g = torch.Generator().manual_seed(0)
for (M, N, K) in [(16, 16, 16), (16, 16, 32), (16, 16, 128), (64, 64, 16), (64, 64, 128), (64, 128, 64)]:
    A = torch.randn(M, K, generator=g); B = torch.randn(K, N, generator=g); C = torch.randn(M, N, generator=g) * 4
    for prec in ("tf32", "tf32x3", "ieee"):
        for acc in (0, 1):
            o = torch.empty(M, N, device="cuda")
            dotk[(1,)](A.cuda(), B.cuda(), C.cuda(), o, M, N, K, prec, acc)
            res[f"{M}x{N}x{K}-{prec}-{acc}"] = dict(A=A, B=B, C=C, O=o.cpu())
torch.save(res, f"{OUT}/micro.pt")
print("micro saved", len(res))
