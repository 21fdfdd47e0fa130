"""verify launch sweep (sweep-rows.json; sweep-phase1.json and sweep-phase2.json came from the same script with
the variants named in their rows): 8 layers of distinct states, a CUDA graph, L2 cleared (do_bench), Qwen3-Next
heads, d = 5 drafts over n = 8 of C = 16 entries, bf16 tokens and keys, fp32 u, a bf16 and an fp32 state.
Per variant: the whole verify, and phase 1 alone ("p1:", phase 2's launch a no-op); "p2[table]": phase 2
alone.  python sweep.py 64,128,256,512 (from the repository root; OUT=DIR for the JSON)."""
import sys, json, dataclasses, os, torch, triton
sys.path.insert(0, '.')
import kvbuffer_fast as fast
import kvbuffer_fast.verify
V = sys.modules["kvbuffer_fast.verify"]
from kvbuffer_fast.launch import config_for
from kvbuffer_ref.buffer import KVBuffer
L, H, HV, K, Vd, C, n, D = 8, 16, 32, 128, 128, 16, 8, 5
dev = 'cuda'
F = torch.nn.functional

def setup(B, sd):
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
        xs.append(dict(q=F.normalize(torch.randn(B, D, H, K, device=dev, generator=g), dim=-1).bfloat16(),
                       k=F.normalize(torch.randn(B, D, H, K, device=dev, generator=g), dim=-1).bfloat16(),
                       v=torch.randn(B, D, HV, Vd, device=dev, generator=g).bfloat16(),
                       g=-0.1 * torch.rand(B, D, HV, device=dev, generator=g),
                       beta=torch.rand(B, D, HV, device=dev, generator=g)))
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

VARIANTS = [("table", {}), ("r0", dict(prep_maxnreg=0)), ("r160", dict(prep_maxnreg=160)),
            ("r192", dict(prep_maxnreg=192)), ("KB32NS3", dict(KB=32, NS=3)),
            ("KB32NS3r0", dict(KB=32, NS=3, prep_maxnreg=0)), ("r0early", dict(prep_maxnreg=0, early=True)),
            ("r0late", dict(prep_maxnreg=0, early=False))]
real1, real2 = V._verify_prep_group_kernel, V._verify_stream_kernel
rows = []
for B in [int(b) for b in sys.argv[1].split(",")]:
    for sd in (torch.bfloat16, torch.float32):
        bufs, xs = setup(B, sd)
        nbytes = bufs[0].state.numel() * bufs[0].state.element_size()
        dst = torch.empty_like(bufs[0].state)
        t_copy = triton.testing.do_bench(lambda: dst.copy_(bufs[0].state), warmup=10, rep=60, return_mode="median") * 1e3
        base = config_for("verify", V._key(xs[0]["q"], xs[0]["k"], V.check_tokens(**xs[0]), bufs[0], bufs[0].state))
        row = dict(B=B, state=str(sd), copy_us=t_copy, read_floor_us=t_copy / 2, table=str(base))
        run = lambda cfg: (lambda: [fast.verify(**x, buffer=b, config=cfg) for x, b in zip(xs, bufs)])
        for name, kw in VARIANTS:
            cfg = dataclasses.replace(base, **kw)
            try:
                row[name] = timed(run(cfg))
                V._verify_stream_kernel = Noop()
                row["p1:" + name] = timed(run(cfg))
            except Exception as e:
                row[name] = repr(e)[:160]
            finally:
                V._verify_stream_kernel = real2
        V._verify_prep_group_kernel = Noop()
        row["p2[table]"] = timed(run(base))
        V._verify_prep_group_kernel = real1
        V._verify_stream_kernel = Noop()
        row["p1"] = timed(run(base))
        V._verify_stream_kernel = real2
        print(json.dumps(row), flush=True)
        rows.append(row)
        del bufs, xs
        torch.cuda.empty_cache()
# best bf16 variants by geometric mean over batches, relative to table
import math
score = {}
for name, _ in VARIANTS:
    r = [row[name] / row["table"] for row in rows if "bfloat16" in row["state"] and isinstance(row.get(name), float)]
    if len(r) == len([1 for row in rows if "bfloat16" in row["state"]]):
        score[name] = math.exp(sum(map(math.log, r)) / len(r))
best = sorted(score, key=score.get)
print("SCORE", json.dumps({k: round(score[k], 4) for k in best}))
json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               rows=rows, score=score, best=[(n, dict(VARIANTS)[n]) for n in best[:3]]),
          open(os.environ.get("OUT", "/tmp") + "/vb4.json", "w"), indent=1)
