import torch, kvbuffer_ref as ref
from kvbuffer.validate.cases import Case, make_inputs
from kvbuffer.validate.tolerances import rel_rms_slices
from kvbuffer.validate import contracts as C
case = Case(B=1, T=129, H=16, HV=32, K=128, V=128, channel_gate=False, gate='strong', beta='mixed', zero_key=False,
            seed=21642993, norm='any', v_scale=1.0, scale=0.37, beta_max=1.0, qk_l2norm=False, raw_gate_dtype='')
x16 = make_inputs(case, torch.float16)
x64 = {n: t.double() for n, t in x16.items()}
o64, S64 = ref.recurrent_gated_delta_rule(**x64, scale=0.37, output_final_state=True)
forms = C.correct_forms(**x16, scale=0.37, chunks=(1, 64))
for i, (o, S) in enumerate(forms):
    e = rel_rms_slices(S.double(), S64, 1)
    print(i, f"state worst {float(e.max()):.3e} head23 {float(e.flatten()[23]):.3e}")
g = x16["g"].float()
print("gates: min", float(g.min()), "mean", float(g.mean()), "G64 min", float(g[:, :64].sum(1).min()))
# HF with a whole-chunk Hillis-Steele scan, per head, vs each form per head
from kvbuffer.peers.hf import load_functions
_, fns = load_functions(); fn = fns["gdn_chunk"]
orig = torch.Tensor.cumsum
torch.Tensor.cumsum = lambda self, dim=None: C._scan_cumsum(self, dim, lanes=1 << 20)
rep = lambda t: t.repeat_interleave(2, dim=2)
o, S = fn(query=rep(x16["q"]) * (0.37 * 128 ** 0.5), key=rep(x16["k"]), value=x16["v"], g=x16["g"], beta=x16["beta"],
          chunk_size=64, initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=False)
torch.Tensor.cumsum = orig
eh = rel_rms_slices(S.double(), S64, 1).flatten()
print("HF full-scan: worst", f"{float(eh.max()):.3e}", "head", int(eh.argmax()), "head23", f"{float(eh[23]):.3e}")
E = torch.stack([rel_rms_slices(S.double(), S64, 1).flatten() for _, S in forms[5:]])
print("forms 5-7 per-head max / HF full-scan per head: min ratio", float((E.max(0).values / eh).min()))
print("heads where HF full-scan > 4x forms max:", [(h, f"{float(eh[h]/E[:, h].max()):.1f}") for h in range(32) if eh[h] > 4 * E[:, h].max()])
