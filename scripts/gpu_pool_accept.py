"""One eager ``KVPool.accept`` of every layer after a verify, for Nsight Compute: Qwen3-Next heads (H = 16,
HV = 32, K = V = 128), 4 layers, B requests with n = 8 buffered entries (direct mode), 5 chain drafts (in
the buffer rows: 8 + 5 <= C = 16), 3 accepted, int32 indices as an engine passes them.  The profiled range
is the second accept only (``--profile-from-start off``):

    ncu --clock-control none --profile-from-start off python3 scripts/gpu_pool_accept.py 64
"""

import sys

import torch

from kvbuffer_fast.pool import KVPool


def main(B: int) -> None:
    L, D, C, H, HV, K, V, dev = 4, 5, 16, 16, 32, 128, 128, "cuda"
    p = KVPool(layers=L, num_state_slots=B, num_buffer_slots=B, capacity=C, max_drafts=D, num_heads=H,
               num_value_heads=HV, head_k_dim=K, head_v_dim=V, dtype=torch.float32, key_dtype=torch.bfloat16,
               device=dev)
    s = p.acquire(B).to(torch.int32).to(dev)
    t = p.tensors()
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, D, H, K, device=dev, generator=g).to(torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn(B, D, H, K, device=dev, generator=g), dim=-1).to(torch.bfloat16)
    v = torch.randn(B, D, HV, V, device=dev, generator=g).to(torch.bfloat16)
    gate = -torch.rand(B, D, HV, device=dev, generator=g) * 0.1
    beta = torch.rand(B, D, HV, device=dev, generator=g)
    parents = torch.arange(-1, D - 1, dtype=torch.int32, device=dev).expand(B, D).contiguous()
    num_drafts = torch.full((B,), D, dtype=torch.int32, device=dev)
    counts = torch.full((B,), 3, dtype=torch.int32, device=dev)
    for rep in range(2):
        t["lengths"][:, s.long()] = 8
        for layer in range(L):
            p.verify(q, k, v, g=gate, beta=beta, layer=layer, slots=s, parents=parents, num_drafts=num_drafts)
        torch.cuda.synchronize()
        if rep:
            torch.cuda.cudart().cudaProfilerStart()
        p.accept(slots=s, counts=counts)
        torch.cuda.synchronize()
        if rep:
            torch.cuda.cudart().cudaProfilerStop()
    assert t["lengths"][:, s.long()].eq(11).all(), "accept did not append the 3 drafts"


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 64)
