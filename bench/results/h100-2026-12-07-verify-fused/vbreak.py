"""Verify breakdown: phase 1 alone, phase 2 alone, both (PDL), and phase-2 launch variants; 8 layers of
distinct states in a CUDA graph, L2 cleared before each replay (triton do_bench), Qwen3-Next heads, d = 5,
n = 8 of C = 16, bf16 tokens/keys, fp32 state and u."""
import sys, json, dataclasses, torch, triton
sys.path.insert(0, '.')
import kvbuffer_fast as fast
from kvbuffer_fast import verify as V
from kvbuffer_fast.launch import config_for, VerifyConfig
from kvbuffer_ref.buffer import KVBuffer
L, H, HV, K, Vd, C, n, D = 8, 16, 32, 128, 128, 16, 8, 5
dev = 'cuda'
F = torch.nn.functional
res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, rows=[])

def setup(B, sd=torch.float32):
    g = torch.Generator(device=dev).manual_seed(0)
    bufs, xs = [], []
    for _ in range(L):
        b = KVBuffer.empty(B, H, HV, K, Vd, C, dtype=torch.float32, gate_dtype=torch.float32, key_dtype=torch.bfloat16,
                           state_dtype=sd, device=dev)
        b.k.copy_(F.normalize(torch.randn(B, C, H, K, device=dev, generator=g), dim=-1))
        b.u.copy_(0.3 * torch.randn(B, C, HV, Vd, device=dev, generator=g))
        b.G.copy_((-0.1 * torch.rand(B, C, HV, device=dev, generator=g)).cumsum(1))
        b.state.copy_(0.05 * torch.randn(B, HV, K, Vd, device=dev, generator=g))
        b.has_state.fill_(True); b.lengths.fill_(n)
        bufs.append(b)
        x = dict(q=F.normalize(torch.randn(B, D, H, K, device=dev, generator=g), dim=-1).bfloat16(),
                 k=F.normalize(torch.randn(B, D, H, K, device=dev, generator=g), dim=-1).bfloat16(),
                 v=torch.randn(B, D, HV, Vd, device=dev, generator=g).bfloat16(),
                 g=-0.1 * torch.rand(B, D, HV, device=dev, generator=g),
                 beta=torch.rand(B, D, HV, device=dev, generator=g))
        xs.append(x)
    return bufs, xs

class Noop:
    def __getitem__(self, grid):
        return lambda *a, **k: None

def timed(fn):
    fn(); torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        fn()
    return triton.testing.do_bench(gr.replay, warmup=10, rep=60, return_mode="median") * 1e3 / L

real1, real2 = V._verify_prep_group_kernel, V._verify_stream_kernel
for B in [int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "64,256").split(",")]:
    for sd in (torch.float32, torch.bfloat16):
        bufs, xs = setup(B, sd)
        nbytes = bufs[0].state.numel() * bufs[0].state.element_size()
        dst = torch.empty_like(bufs[0].state)
        t_copy = triton.testing.do_bench(lambda: dst.copy_(bufs[0].state), warmup=10, rep=60, return_mode="median") * 1e3
        row = dict(B=B, state=str(sd), state_MB=nbytes / 1e6, copy_us=t_copy, read_floor_us=nbytes / (2 * nbytes / t_copy))
        def run(cfg=None):
            return lambda: [fast.verify(**x, buffer=b, config=cfg) for x, b in zip(xs, bufs)]
        variants = [("table", None)]
        base = config_for("verify", V._key(xs[0]["q"], xs[0]["k"], V.check_tokens(**xs[0]), bufs[0]))
        row["table"] = str(base)
        for name, kw in [("fused", dict(fused=True)), ("fused-r128", dict(fused=True, maxnreg=128)),
                         ("tma", dict(tma=True)), ("fused-w8", dict(fused=True, num_warps=8)),
                         ("fused-KB32-NS3", dict(fused=True, KB=32, NS=3))]:
            variants.append((name, dataclasses.replace(base, **kw)))
        if sd != torch.float32:
            variants = variants[:2]
        for name, cfg in variants:
            try:
                row[f"both[{name}]"] = timed(run(cfg))
                if "fused" in name:
                    continue
                V._verify_prep_group_kernel = Noop()
                row[f"p2[{name}]"] = timed(run(cfg))
            except Exception as e:
                row[f"both[{name}]"] = repr(e)[:200]
            finally:
                V._verify_prep_group_kernel = real1
        V._verify_stream_kernel = Noop()
        row["p1"] = timed(run())
        V._verify_stream_kernel = real2
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
        del bufs, xs
import os
json.dump(res, open(os.environ.get("OUT", "/tmp") + "/vbreak.json", "w"), indent=1)
