"""ncu target: one buffered-decode step (n = 8 of C = 16, no fold) at Qwen3-Next heads, fp32 then bf16 state,
4 layers each; run twice (warm-up, then profiled between cudaProfilerStart/Stop)."""
import sys, torch
sys.path.insert(0, '.')
import kvbuffer_fast as fast
from kvbuffer_ref.buffer import KVBuffer
B = int(sys.argv[1]) if len(sys.argv) > 1 else 64
L, H, HV, K, V, C, n = 4, 16, 32, 128, 128, 16, 8
dev = 'cuda'
g = torch.Generator(device=dev).manual_seed(0)
F = torch.nn.functional
def buf(sd):
    b = KVBuffer.empty(B, H, HV, K, V, C, dtype=torch.float32, gate_dtype=torch.float32, key_dtype=torch.bfloat16,
                       state_dtype=sd, device=dev)
    b.k.copy_(F.normalize(torch.randn(B, C, H, K, device=dev, generator=g), dim=-1))
    b.u.copy_(0.3 * torch.randn(B, C, HV, V, device=dev, generator=g))
    b.G.copy_((-0.1 * torch.rand(B, C, HV, device=dev, generator=g)).cumsum(1))
    b.state.copy_(0.05 * torch.randn(B, HV, K, V, device=dev, generator=g))
    b.has_state.fill_(True)
    return b
def tok():
    return dict(q=F.normalize(torch.randn(B, 1, H, K, device=dev, generator=g), dim=-1).bfloat16(),
                k=F.normalize(torch.randn(B, 1, H, K, device=dev, generator=g), dim=-1).bfloat16(),
                v=torch.randn(B, 1, HV, V, device=dev, generator=g).bfloat16(),
                g=-0.1 * torch.rand(B, 1, HV, device=dev, generator=g), beta=torch.rand(B, 1, HV, device=dev, generator=g))
sets = {name: ([buf(sd) for _ in range(L)], [tok() for _ in range(L)]) for name, sd in
        (("fp32", torch.float32), ("bf16", torch.bfloat16))}
for it in range(2):
    for name, (bufs, xs) in sets.items():
        for b in bufs:
            b.lengths.fill_(n)
        torch.cuda.synchronize()
        if it == 1:
            torch.cuda.profiler.start()
        for b, x in zip(bufs, xs):
            fast.buffered_decode(**x, buffer=b)
        torch.cuda.synchronize()
        if it == 1:
            torch.cuda.profiler.stop()
print("done")
