import torch, sys
sys.path.insert(0, '.')
import kvbuffer_ref as ref
from kvbuffer import implementations
impl = implementations.resolve("vllm-chunk")
fn = impl.obj.chunk_gated_delta_rule
torch.manual_seed(1)
def run(lens, dt=torch.bfloat16, H=2, HV=4, K=16, V=16, init=True):
    N=len(lens); T=sum(lens); d='cuda'
    q=torch.nn.functional.normalize(torch.randn(1,T,H,K,dtype=torch.float64),dim=-1); k=torch.nn.functional.normalize(torch.randn(1,T,H,K,dtype=torch.float64),dim=-1)
    v=torch.randn(1,T,HV,V,dtype=torch.float64); g=-0.5*torch.rand(1,T,HV,dtype=torch.float64); beta=torch.rand(1,T,HV,dtype=torch.float64)
    S0=torch.randn(N,HV,K,V,dtype=torch.float64) if init else None
    cu=torch.tensor([0]+list(torch.tensor(lens).cumsum(0)),dtype=torch.int64)
    c=lambda t,x=dt: None if t is None else t.to(d,x)
    o,s=fn(c(q),c(k),c(v),g=c(g,torch.float32),beta=c(beta,torch.float32),initial_state=c(S0,torch.float32),output_final_state=True,cu_seqlens=cu.to(d))
    oe,se=[],[]
    for i in range(N):
        sl=slice(int(cu[i]),int(cu[i+1]))
        if lens[i]==0:
            se.append(f"{((s[i].double().cpu()-S0[i]).norm()/S0[i].norm()).item():.1e}"); oe.append('-'); continue
        oo,st=ref.recurrent_gated_delta_rule(q[:,sl],k[:,sl],v[:,sl],g=g[:,sl],beta=beta[:,sl],initial_state=S0[i:i+1],output_final_state=True)
        oe.append(f"{((o[:,sl].double().cpu()-oo).norm()/oo.norm()).item():.1e}")
        se.append(f"{((s[i].double().cpu()-st[0]).norm()/st[0].norm()).item():.1e}")
    print(lens, dt, 'o', oe, 'state', se, flush=True)
for dt in (torch.bfloat16, torch.float16):
    for lens in ([5,0,11,2],[5,11,2],[5,11,2,0],[0,5,11,2],[5,0,11],[64,0,64],[70,0,3]):
        try: run(lens, dt)
        except Exception as e: print(lens, dt, 'raised', repr(e)[:200], flush=True)
