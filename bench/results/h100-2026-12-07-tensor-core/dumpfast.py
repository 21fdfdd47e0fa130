"""--impl dumpfast:make : kvbuffer_fast whose chunk_gated_delta_rule saves every call (inputs, outputs) to $OUT/case."""
import os, torch
from kvbuffer.implementations import fast
N = [0]
def make():
    impl = fast()
    f = impl.obj.chunk_gated_delta_rule
    def chunk(q, k, v, **kw):
        o, S = f(q, k, v, **kw)
        d = os.path.join(os.environ.get("OUT", "/tmp"), "case"); os.makedirs(d, exist_ok=True)
        cpu = lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x
        torch.save(dict(q=cpu(q), k=cpu(k), v=cpu(v), kw={a: cpu(b) for a, b in kw.items()}, o=cpu(o), S=cpu(S)),
                   os.path.join(d, f"call{N[0]}.pt")); N[0] += 1
        return o, S
    impl.obj.chunk_gated_delta_rule = chunk
    impl.name = "kvbuffer_fast (dump)"
    return impl
