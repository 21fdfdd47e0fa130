"""fla's chunk kernels on the cases its 16-bit lanes failed: every comparison's actual, truth and baseline saved."""
import sys, json, torch
sys.path.insert(0, ".")
from kvbuffer.validate.cases import Case
from kvbuffer.validate import properties as P
from kvbuffer.validate.contracts import active_contract
from kvbuffer import implementations
which = sys.argv[1]; out = sys.argv[2]
impl = implementations.resolve("fla")
fails = [f for f in json.load(open("../.dbg/fla_fails.json")) if f"{f['op']}-{f['dtype']}" == which]
rec, cur = [], []
orig = P.compare
def spy(actual, truth, base=None, **kw):
    c = orig(actual, truth, base, **kw)
    cur.append(dict(name=kw.get("name"), actual=actual.detach().cpu(), truth=truth.detach().cpu(),
                    base=None if base is None else (base.detach().cpu() if isinstance(base, torch.Tensor) else [b.detach().cpu() for b in base]),
                    text=str(c), passed=c.passed))
    return c
P.compare = spy
for f in fails:
    case = eval(f["case"]); p = eval(f["params"]); dt = getattr(torch, f["dtype"])
    cur = []
    with active_contract("bf16"):
        if f["op"] == "chunk":
            P.check_chunk(impl.obj, case, dt, chunk_size=p["chunk_size"], device="cuda", with_initial_state=p["initial"], final=p["final"])
        else:
            P.check_varlen(impl.obj, case, dt, lengths=p["seq_lengths"], chunk_size=p["chunk_size"], device="cuda", initial=p["initial"], final=p["final"])
    rec.append(dict(f, comparisons=cur))
    print(f["seed"], [c["text"][:90] for c in cur if not c["passed"]], flush=True)
torch.save(rec, out)
