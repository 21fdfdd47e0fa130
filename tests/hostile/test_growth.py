"""Positive gates past kvbuffer_fast's float32 range (docs/conventions.md, Domain): every fast entry point
that forms cumulative decays refuses them with a ValueError naming g, instead of returning NaN; gates just
inside the limit still compute, and finite results match the reference."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import kvbuffer_fast as fast  # noqa: E402
import kvbuffer_ref as ref  # noqa: E402
from kvbuffer_fast._common import GROWTH_LIMIT  # noqa: E402
from kvbuffer.validate.properties import truth_and_baseline  # noqa: E402
from kvbuffer.validate.tolerances import compare  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, T, H, K = 1, 8, 1, 16


def _tokens(g_value: float, channel: bool = False):
    gen = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, K, generator=gen)
    g = torch.full((B, T, H, K) if channel else (B, T, H), g_value)
    beta = torch.rand(B, T, H, generator=gen)
    return {n: x.to(DEVICE) for n, x in dict(q=q, k=k, v=v, g=g, beta=beta).items()}


@pytest.mark.parametrize("name", ["recurrent_gated_delta_rule", "chunk_gated_delta_rule", "direct_gated_delta_rule"])
@pytest.mark.parametrize("channel", [False, True])
def test_growth_past_the_limit_is_refused(name, channel):
    x = _tokens(30.0, channel)  # 8 tokens: a sum of 240
    with pytest.raises(ValueError, match=r"g: the positive gates of request 0, value head 0.*sum to 240"):
        getattr(fast, name)(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"])


def test_growth_inside_the_limit_is_computed():
    x = _tokens(0.9 * GROWTH_LIMIT / T)  # just inside: finite, and the reference's answer
    o = fast.recurrent_gated_delta_rule(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"])[0]
    cpu = {n: t.cpu() for n, t in x.items()}
    (o64, _), (o32, _) = truth_and_baseline(cpu)  # a stepwise form: the recurrence in float32 is the baseline
    assert torch.isfinite(o).all()
    res = compare(o.cpu(), o64, o32, name="recurrent.o")
    assert res.passed, (res.worst_rel, res.budget_terms())


@pytest.mark.parametrize("channel", [False, True])
def test_growth_across_buffered_calls_is_refused(channel):
    """Gates of +15 per decode step: each call alone is far inside the limit, but the buffer's G since its
    last flush grows by 15 a step, so the step that would pass 80 is refused (and verify over that buffer
    too), while a step of a decaying request beside it is not blamed."""
    Bq, C = 2, 16
    buf = ref.KVBuffer.empty(Bq, H, H, K, K, C, channel_gate=channel, dtype=torch.float32, device=DEVICE)
    steps = 0
    with pytest.raises(ValueError, match=r"g: request 0, value head 0.*grows by 90"):
        for _ in range(C):
            x = _tokens(0.0, channel)
            x = {n: t[:, :1].repeat(Bq, *([1] * (t.dim() - 1))) for n, t in x.items()}
            x["g"][0] = 15.0   # request 0 grows, request 1 decays
            x["g"][1] = -0.5
            fast.buffered_decode(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], buffer=buf)
            steps += 1
    assert steps == 5  # 5 x 15 = 75 buffered; the sixth step would make 90
    x = _tokens(0.0, channel)
    x = {n: t[:, :2].repeat(Bq, *([1] * (t.dim() - 1))).contiguous() for n, t in x.items()}
    x["g"][0] = 15.0
    with pytest.raises(ValueError, match=r"g: request 0, value head 0.*grows by 105"):
        fast.verify(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], buffer=buf)
