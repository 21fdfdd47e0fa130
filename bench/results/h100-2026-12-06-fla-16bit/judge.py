import torch, sys, re
sys.path.insert(0, ".")
from kvbuffer.validate.cases import Case
from kvbuffer.validate import properties as P
from kvbuffer.validate.contracts import active_contract
class Replay:
    def __init__(self, o, S): self.o, self.S = o, S
    def chunk_gated_delta_rule(self, q, k, v, **kw):
        return self.o.to(q.dtype), self.S
for w in ["chunk-float16", "chunk_varlen-float16", "chunk_varlen-bfloat16"]:
    for r in torch.load(f"./dump-{w}.pt", weights_only=False):
        cs = r["comparisons"]
        o = torch.cat([c["actual"] for c in cs if ".o" in c["name"]], dim=1)
        S = [c["actual"] for c in cs if c["name"].endswith(".state")][0]
        case = eval(r["case"]); p = eval(r["params"]); dt = getattr(torch, r["dtype"])
        out = [r["seed"], r["dtype"]]
        for contract in (["fp16", "bf16"] if dt == torch.float16 else ["bf16"]):
            with active_contract(contract):
                if r["op"] == "chunk":
                    res = P.check_chunk(Replay(o, S), case, dt, chunk_size=p["chunk_size"], with_initial_state=p["initial"], final=p["final"])
                else:
                    res = P.check_varlen(Replay(o, S), case, dt, lengths=p["seq_lengths"], chunk_size=p["chunk_size"], initial=p["initial"], final=p["final"])
            st = [c for c in res if c.name.endswith(".state")][0]
            out.append(f"{contract}: {'PASS' if st.passed else 'FAIL'} rel {st.worst_rel:.3e} base {st.baseline_rel:.3e} ratio {st.ratio:.2f} slice {st.worst_slice}")
        print(*out, flush=True)
