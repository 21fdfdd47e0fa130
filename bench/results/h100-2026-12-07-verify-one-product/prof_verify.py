"""One verify at Qwen3-Next heads, B given, d = 5 over n = 8, bf16 tokens; state dtype from argv (for ncu)."""
import sys, torch
sys.path.insert(0, '.')
import kvbuffer_fast as fast
from kvbuffer_ref.buffer import KVBuffer
F = torch.nn.functional
B, sd = int(sys.argv[1]), getattr(torch, sys.argv[2])
H, HV, K, Vd, C, n, D = 16, 32, 128, 128, 16, 8, 5
dev = 'cuda'
g = torch.Generator(device=dev).manual_seed(0)
b = KVBuffer.empty(B, H, HV, K, Vd, C, dtype=torch.float32, gate_dtype=torch.float32, key_dtype=torch.bfloat16,
                   state_dtype=sd, device=dev)
b.k.copy_(F.normalize(torch.randn(B, C, H, K, device=dev, generator=g), dim=-1))
b.u.copy_(0.3 * torch.randn(B, C, HV, Vd, device=dev, generator=g))
b.G.copy_((-0.1 * torch.rand(B, C, HV, device=dev, generator=g)).cumsum(1))
b.state.copy_(0.05 * torch.randn(B, HV, K, Vd, device=dev, generator=g))
b.has_state.fill_(True); b.lengths.fill_(n)
x = dict(q=F.normalize(torch.randn(B, D, H, K, device=dev, generator=g), dim=-1).bfloat16(),
         k=F.normalize(torch.randn(B, D, H, K, device=dev, generator=g), dim=-1).bfloat16(),
         v=torch.randn(B, D, HV, Vd, device=dev, generator=g).bfloat16(),
         g=-0.1 * torch.rand(B, D, HV, device=dev, generator=g),
         beta=torch.rand(B, D, HV, device=dev, generator=g))
for _ in range(3):
    fast.verify(**x, buffer=b)
torch.cuda.synchronize()
print("done", B, sd)
