"""HF torch_chunk_gated_delta_rule, float16 inputs, the case the H200 failed: final-state and output error against
the float64 recurrence on the same rounded inputs, run on the CPU and on CUDA, with the transformers on the path."""
import json, sys, torch, transformers
import kvbuffer_ref as ref
from kvbuffer.validate.cases import Case, make_inputs
from kvbuffer.validate.tolerances import rel_rms_slices
from kvbuffer.peers.hf import load_functions
import importlib
case = Case(B=1, T=129, H=16, HV=32, K=128, V=128, channel_gate=False, gate='strong', beta='mixed', zero_key=False,
            seed=21642993, norm='any', v_scale=1.0, scale=0.37, beta_max=1.0, qk_l2norm=False, raw_gate_dtype='')
x16 = make_inputs(case, torch.float16)
x64 = {n: t.double() for n, t in x16.items()}
o64, S64 = ref.recurrent_gated_delta_rule(**x64, scale=0.37, output_final_state=True)
o32, S32 = ref.recurrent_gated_delta_rule(**{n: t.float() for n, t in x64.items()}, scale=0.37, output_final_state=True)
mod = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
_, fns = load_functions()
fn = fns["gdn_chunk"]
res = dict(transformers=transformers.__version__, torch=torch.__version__,
           solve_triangular="solve_triangular" in open(mod.__file__).read(),
           fp32_recurrence=dict(o=float(rel_rms_slices(o32.double(), o64, 2).max()),
                                state=float(rel_rms_slices(S32.double(), S64, 1).max())))
rep = lambda t: t.repeat_interleave(2, dim=2)
for dev in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
    for tf32 in ([False, True] if dev == "cuda" else [False]):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        xi = {n: t.to(dev) for n, t in x16.items()}
        o, S = fn(query=rep(xi["q"]) * (0.37 * 128 ** 0.5), key=rep(xi["k"]), value=xi["v"], g=xi["g"], beta=xi["beta"],
                  chunk_size=64, initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=False)
        res[f"{dev}{'-tf32' if tf32 else ''}"] = dict(o=float(rel_rms_slices(o.double().cpu(), o64, 2).max()),
                                                    state=float(rel_rms_slices(S.double().cpu(), S64, 1).max()))
torch.backends.cuda.matmul.allow_tf32 = False
print(json.dumps(res))
