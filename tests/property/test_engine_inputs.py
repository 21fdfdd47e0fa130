"""engine_inputs: an engine's packed tokens and raw gates as the operations' inputs (docs/serving.md).

The reference against its formula in float64 (written out here independently, per element); the kernel
against the float64 reference under the tolerance table (the baseline: what a correct float32 kernel
computes, the reference on the float32 arguments and g's formula in float32 arithmetic), over strided and packed layouts, decode [N, D] and varlen [B, T, D] forms
and the whole domain of the gating inputs (a = +-inf, b = +-inf, a + dt_bias past the softplus threshold,
large A_log); then engine_inputs feeding the pool's decode, which must equal the reference pool's.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvbuffer_fast
import kvbuffer_ref
from kvbuffer_ref.checks import RESET_GATE
from kvbuffer_ref.engine_inputs import engine_inputs as ref_inputs
from kvbuffer_fast.engine_inputs import engine_inputs as fast_inputs
from kvbuffer.validate.tolerances import compare

NAMES = ("q", "k", "v", "g", "beta")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _dev(x: torch.Tensor) -> torch.Tensor:
    """``x`` on DEVICE; on a GPU as a view at a row stride past its last dimension (rows of a wider tensor)."""
    if DEVICE == "cpu":
        return x
    wide = torch.zeros(*x.shape[:-1], x.shape[-1] + 5, dtype=x.dtype, device=DEVICE)
    wide[..., 5:] = x.to(DEVICE)
    return wide[..., 5:]


@st.composite
def packed(draw):
    """(mixed_qkv, a, b, A_log, dt_bias, H, K, qk_l2norm): random sizes, a strided view half the time."""
    H = draw(st.integers(1, 3))
    HV = H * draw(st.integers(1, 3))
    K, V = draw(st.integers(1, 20)), draw(st.integers(1, 20))
    lead = draw(st.sampled_from([(draw(st.integers(0, 5)),), (draw(st.integers(1, 2)), draw(st.integers(1, 6)))]))
    dtype = draw(st.sampled_from([torch.float32, torch.float16]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    D = 2 * H * K + HV * V
    pad = draw(st.sampled_from([0, 5]))
    rows = torch.randn(*lead, D + pad, generator=gen) * 10 ** draw(st.integers(-2, 2))
    x = rows.to(dtype)[..., pad:] if pad else rows.to(dtype)  # a view at a row stride of D + pad
    a = torch.randn(*lead, HV, generator=gen) * draw(st.sampled_from([1.0, 10.0, 40.0]))
    b = torch.randn(*lead, HV, generator=gen) * draw(st.sampled_from([1.0, 30.0]))
    specials = [math.inf, -math.inf, 25.0, -100.0, 0.0]
    for t in (a, b):
        if t.numel() and draw(st.booleans()):
            flat = t.view(-1)
            for _ in range(draw(st.integers(1, 3))):
                flat[draw(st.integers(0, flat.numel() - 1))] = draw(st.sampled_from(specials))
    A_log = torch.rand(HV, generator=gen) * draw(st.sampled_from([2.0, 8.0])) - 4.0
    dt_bias = torch.randn(HV, generator=gen)
    return x, a, b, A_log, dt_bias, H, K, draw(st.booleans())


def _formula(x, a, b, A_log, dt_bias, H, K, norm):
    """The map, element by element in float64 with math (independent of the reference's tensor code)."""
    B, T = (x.shape[0], 1) if x.dim() == 2 else x.shape[:2]
    HV = A_log.shape[0]
    rows = x.reshape(B * T, x.shape[-1]).double().tolist()
    aa, bb = a.reshape(B * T, HV).double().tolist(), b.reshape(B * T, HV).double().tolist()
    q, k, g, beta = [], [], [], []
    for r, ar, br in zip(rows, aa, bb):
        for dst, off in ((q, 0), (k, H * K)):
            heads = []
            for h in range(H):
                e = r[off + h * K:off + (h + 1) * K]
                n = math.sqrt(sum(t * t for t in e) + 1e-6) if norm else 1.0
                heads.append([t / n for t in e])
            dst.append(heads)
        gr, brow = [], []
        for h in range(HV):
            z = ar[h] + float(dt_bias[h])
            sp = z if z > 20 else math.log1p(math.exp(z)) if z < 700 else z
            gr.append(-RESET_GATE[torch.float64] if math.isinf(sp) else 0.0 if sp == 0 else
                      max(-math.exp(float(A_log[h])) * sp, -RESET_GATE[torch.float64]))
            brow.append(1.0 / (1.0 + math.exp(-br[h])) if br[h] >= 0 else math.exp(br[h]) / (1.0 + math.exp(br[h])))
        g.append(gr)
        beta.append(brow)
    t = lambda v, *s: torch.tensor(v, dtype=torch.float64).reshape(B, T, *s)  # noqa: E731
    return t(q, H, K), t(k, H, K), t(g, HV), t(beta, HV)


@given(setup=packed())
def test_reference_is_the_formula(setup):
    x, a, b, A_log, dt_bias, H, K, norm = setup
    x64 = x.double()
    q, k, v, g, beta = ref_inputs(x64, a.double(), b.double(), A_log=A_log.double(), dt_bias=dt_bias.double(),
                                  num_heads=H, head_k_dim=K, qk_l2norm=norm)
    fq, fk, fg, fb = _formula(x, a, b, A_log, dt_bias, H, K, norm)
    for name, got, want in (("q", q, fq), ("k", k, fk), ("g", g, fg), ("beta", beta, fb)):
        assert got.dtype == torch.float64 and got.shape == want.shape, name
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0, msg=name)
    assert torch.equal(v.flatten(2), x64.reshape(*v.shape[:2], x.shape[-1])[..., 2 * H * K:])


def _slices(name, t):
    """A [B, T, heads, ...] view with the heads at axis 2 for compare (g, beta: one element per slice row)."""
    return t[..., None] if name in ("g", "beta") else t


def _g_in_float32(a, A_log, dt_bias):
    """g = -exp(A_log) softplus(a + dt_bias) with every operation in float32 (the reference rounds its float64
    value once): what a correct float32 kernel computes; a + dt_bias rounded in float32 moves exp(z), below the
    softplus threshold, by |z| ulps."""
    from kvbuffer_ref.engine_inputs import SOFTPLUS_THRESHOLD

    z = a.float() + dt_bias.float()
    sp = torch.where(z > SOFTPLUS_THRESHOLD, z, torch.log1p(torch.exp(z)))
    g = -torch.exp(A_log.float()) * sp
    g = torch.where(sp == 0, torch.zeros_like(g), torch.where(torch.isinf(sp), -torch.inf, g))
    return g.clamp(min=-RESET_GATE[torch.float32])


def _judge(got, x, a, b, **kw):
    """Judge the fast kernel's (q, k, v, g, beta) by the error policy: against the float64 reference, with a
    correct float32 implementation's error on the same arguments as the baseline (the reference on the float32
    arguments, which rounds once, and for g the formula in float32 arithmetic); v must be x's slice exactly."""
    H, K = kw["num_heads"], kw["head_k_dim"]
    got = [t.cpu() for t in got]
    x, a, b = x.cpu(), a.cpu(), b.cpu()
    kw = {**kw, "A_log": kw["A_log"].cpu(), "dt_bias": kw["dt_bias"].cpu()}
    truth = ref_inputs(x.double(), a.double(), b.double(), **{**kw, "A_log": kw["A_log"].double(),
                                                              "dt_bias": kw["dt_bias"].double()})
    low = -RESET_GATE[torch.float32]  # every gate below it has decay 0 in float32, as the operations take it
    base32 = ref_inputs(x, a, b, **kw)
    bases = {n: [t] for n, t in zip(NAMES, base32)}
    bases["g"].append(_g_in_float32(a, kw["A_log"], kw["dt_bias"]).reshape(base32[3].shape))
    for name, f, r in zip(NAMES, got, truth):
        assert f.is_contiguous() and f.shape == r.shape, name
        assert f.dtype == (x.dtype if name == "v" else torch.float32), name
        if name == "v":
            assert torch.equal(f.flatten(2), x.reshape(f.shape[0], f.shape[1], x.shape[-1])[..., 2 * H * K:])
            continue
        if name == "g":
            r = r.clamp(min=low)
        c = compare(_slices(name, f), _slices(name, r), [_slices(name, t) for t in bases[name]], name=name,
                    dtype=torch.float32)
        assert c.passed, str(c)


@given(setup=packed())
def test_kernel_matches_the_reference(setup):
    x, a, b, A_log, dt_bias, H, K, norm = setup
    kw = dict(A_log=A_log, dt_bias=dt_bias, num_heads=H, head_k_dim=K, qk_l2norm=norm)
    args = [_dev(t) for t in (x, a, b, A_log, dt_bias)]
    before = [t.clone() for t in args]
    got = fast_inputs(*args[:3], **{**kw, "A_log": args[3], "dt_bias": args[4]})
    for t, t0 in zip(args, before):
        assert torch.equal(t, t0)
    _judge(got, x, a, b, **kw)


def test_strided_last_dimension_and_empty_batches():
    H, HV, K, V = 2, 4, 8, 4
    D = 2 * H * K + HV * V
    x = torch.randn(D, 3, device=DEVICE).t()  # [3, D] with a last-dimension stride of 3
    a, b = torch.randn(3, HV, device=DEVICE), torch.randn(3, HV, device=DEVICE)
    p = dict(A_log=torch.randn(HV, device=DEVICE), dt_bias=torch.randn(HV, device=DEVICE), num_heads=H, head_k_dim=K)
    _judge(fast_inputs(x, a, b, **p), x, a, b, **p)
    out = fast_inputs(x[:0], a[:0], b[:0], **p)
    assert [list(t.shape) for t in out] == [[0, 1, H, K], [0, 1, H, K], [0, 1, HV, V], [0, 1, HV], [0, 1, HV]]


@pytest.mark.parametrize("fn", [ref_inputs, fast_inputs], ids=["ref", "fast"])
@pytest.mark.parametrize("change, match", [
    (dict(x=torch.zeros(3, 2 * 2 * 8 + 4 * 4 + 1)), "mixed_qkv: the last dimension 49 must be 2 H K"),
    (dict(a=torch.zeros(3, 5)), r"a: expected \[N, HV\] = \[3, 4\]"),
    (dict(b=torch.zeros(2, 4)), r"b: expected \[N, HV\] = \[3, 4\]"),
    (dict(A_log=torch.zeros(3), dt_bias=torch.zeros(3)), "A_log: the number of value heads HV=3"),
    (dict(dt_bias=torch.zeros(5)), r"dt_bias: expected \[HV\] = \[4\]"),
    (dict(nan_a=True), r"a: NaN at index \(1, 2\)"),
    (dict(inf_A=True), "A_log: expected finite values"),
    (dict(H=0), "num_heads: expected a positive int"),
    (dict(x=torch.zeros(2, 3, 4, 2 * 2 * 8 + 16)), "mixed_qkv: expected \\[N, 2 H K \\+ HV V\\]"),
])
def test_bad_arguments_are_named(fn, change, match):
    H, HV, K, V = 2, 4, 8, 4
    x = change.get("x", torch.randn(3, 2 * H * K + HV * V))
    a = change.get("a", torch.randn(3, HV))
    if change.get("nan_a"):
        a[1, 2] = float("nan")
    A_log = change.get("A_log", torch.randn(HV))
    if change.get("inf_A"):
        A_log[1] = float("inf")
    with pytest.raises(ValueError, match=match):
        fn(x, a, change.get("b", torch.randn(3, HV)), A_log=A_log, dt_bias=change.get("dt_bias", torch.randn(HV)),
           num_heads=change.get("H", H), head_k_dim=K)


def test_the_kernel_refuses_float64():
    x = torch.randn(2, 2 * 8 + 4, dtype=torch.float64)
    with pytest.raises(TypeError, match="float64"):
        fast_inputs(x, torch.randn(2, 1), torch.randn(2, 1), A_log=torch.zeros(1), dt_bias=torch.zeros(1),
                    num_heads=1, head_k_dim=8)


def test_feeding_the_pool_decode():
    """An engine's decode step: engine_inputs then the pool's decode (float16 packed rows, float32 pool, -1
    pads among the slots), through C + 2 steps (a fold), against the reference pool in float64 on the same
    rows: the float16 row of the table (the outputs are float16)."""
    H, HV, K, V, C, B = 2, 4, 16, 8, 4, 3
    gen = torch.Generator().manual_seed(3)
    A_log, dt_bias = torch.rand(HV, generator=gen) - 2, torch.randn(HV, generator=gen)
    kw = dict(layers=1, num_state_slots=4, num_buffer_slots=4, capacity=C, max_drafts=2, num_heads=H,
              num_value_heads=HV, head_k_dim=K, head_v_dim=V)
    pools = kvbuffer_ref.KVPool(**kw), kvbuffer_fast.KVPool(**kw, device=DEVICE)
    slots = torch.tensor([2, -1, 0])
    for p in pools:
        got = p.acquire(4)
        assert sorted(got.tolist()) == [0, 1, 2, 3]
    for step in range(C + 2):  # past a fold
        x = (torch.randn(B, 2 * H * K + HV * V, generator=gen)).half()
        a, b = torch.randn(B, HV, generator=gen) * 3, torch.randn(B, HV, generator=gen)
        p_ref = ref_inputs(x.double(), a.double(), b.double(), A_log=A_log.double(), dt_bias=dt_bias.double(),
                           num_heads=H, head_k_dim=K)
        p_fast = fast_inputs(*(_dev(t) for t in (x, a, b)), A_log=A_log.to(DEVICE), dt_bias=dt_bias.to(DEVICE),
                             num_heads=H, head_k_dim=K)
        outs = []
        for p, (q, k, v, g, beta) in zip(pools, (p_ref, p_fast)):
            outs.append(p.decode(q, k, v, g=g, beta=beta, layer=0, slots=slots.to(q.device)).cpu())
        rows = slots >= 0
        assert outs[1].dtype == torch.float16
        c = compare(outs[1][rows], outs[0][rows], None, name=f"decode step {step}", dtype=torch.float16)
        assert c.passed, str(c)


@pytest.mark.skipif(DEVICE == "cpu", reason="CUDA graphs need a GPU")
def test_an_engine_decode_step_replays_in_a_cuda_graph():
    """engine_inputs then the pool's decode, captured once and replayed with new packed rows and gates
    copied into the captured inputs (as an engine replays its decode graph): each replay's output equals
    the same step run eagerly on a twin pool."""
    H, HV, K, V, C, B = 2, 4, 16, 8, 4, 3
    kw = dict(layers=1, num_state_slots=4, num_buffer_slots=4, capacity=C, max_drafts=2, num_heads=H,
              num_value_heads=HV, head_k_dim=K, head_v_dim=V, device=DEVICE)
    pools = kvbuffer_fast.KVPool(**kw), kvbuffer_fast.KVPool(**kw)
    for p in pools:
        p.acquire(4)
    slots = torch.tensor([2, -1, 0], device=DEVICE, dtype=torch.int32)
    gen = torch.Generator().manual_seed(5)
    A_log, dt_bias = (torch.rand(HV, generator=gen) - 2).to(DEVICE), torch.randn(HV, generator=gen).to(DEVICE)

    def draw():
        return (torch.randn(B, 2 * H * K + HV * V, generator=gen).to(DEVICE, torch.bfloat16),
                torch.randn(B, HV, generator=gen).to(DEVICE), torch.randn(B, HV, generator=gen).to(DEVICE))

    def step(pool, x, a, b):
        q, k, v, g, beta = fast_inputs(x, a, b, A_log=A_log, dt_bias=dt_bias, num_heads=H, head_k_dim=K)
        return pool.decode(q, k, v, g=g, beta=beta, layer=0, slots=slots)

    static = list(draw())
    step(pools[0], *static)  # a warm-up call (compiles) on the graph's pool, mirrored on the twin
    step(pools[1], *static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(pools[0], *static)
    for replay in range(C + 2):  # across a fold
        new = draw()
        for dst, src in zip(static, new):
            dst.copy_(src)
        graph.replay()
        want = step(pools[1], *new)
        torch.cuda.synchronize()
        rows = slots >= 0
        assert torch.equal(out[rows], want[rows]), f"replay {replay}"


def test_reference_outputs_never_alias_the_packed_tokens():
    """q, k, v of ``kvbuffer_ref.engine_inputs`` are fresh tensors in every dtype and norm setting: an engine
    that reuses its ``mixed_qkv`` buffer must not change them."""
    import kvbuffer_ref as ref

    for dt in (torch.float64, torch.float32):
        x = torch.randn(3, 2 * 2 * 4 + 2 * 4, dtype=dt)
        a, b = torch.randn(3, 2, dtype=dt), torch.randn(3, 2, dtype=dt)
        for norm in (False, True):
            q, k, v, _, _ = ref.engine_inputs(x, a, b, A_log=torch.zeros(2, dtype=dt), dt_bias=torch.zeros(2, dtype=dt),
                                              num_heads=2, head_k_dim=4, qk_l2norm=norm)
            assert not any(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in (q, k, v))
