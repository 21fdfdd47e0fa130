"""A buffer whose stored cumulative gates ``G`` hold a reset value (-inf, -1e30), NaN or +inf in a live row
(a caller building or editing a buffer by hand, not through prefill) is rejected by both packages' decode,
flush, verify and accept with a ValueError naming ``buffer.G``, what was found and what is expected; rows
past the lengths may still hold anything."""

import pytest
import torch

from kvbuffer_ref.buffer import G_FLOOR_PER_ROW
from kvbuffer_ref.checks import RESET_GATE

from .probes import C, F32, buffer, one, tokens

import kvbuffer_fast as fast  # noqa: E402  (probes sets the interpreter and the poison first)
import kvbuffer_ref as ref  # noqa: E402

BAD = [float("-inf"), -1e30, float("nan"), float("inf"), -G_FLOOR_PER_ROW * (C + 1) * 1.5]


def _bad(value, channel=False, row=(0, 1)):
    buf = buffer(F32, channel=channel)  # lengths [2, 1]: rows (0, 0), (0, 1), (1, 0) are live
    G = buf.G.clone()
    G[row] = value
    return buf.replace(G=G)


def _calls(pkg, buf, channel=False):
    x = tokens(F32, B=2, channel=channel, seed=5)
    x1 = one(x)
    D = 2
    xd = {n: a[:, :D] for n, a in x.items()}
    yield "buffered_decode", lambda: pkg.buffered_decode(x1["q"], x1["k"], x1["v"], g=x1["g"], beta=x1["beta"],
                                                         buffer=buf)
    yield "flush", lambda: pkg.flush(buf, count=1)
    yield "verify", lambda: pkg.verify(xd["q"], xd["k"], xd["v"], g=xd["g"], beta=xd["beta"], buffer=buf)
    good = buffer(F32, channel=channel)
    _, drafts = ref.verify(xd["q"], xd["k"], xd["v"], g=xd["g"], beta=xd["beta"], buffer=good)
    yield "accept", lambda: pkg.accept(buf, drafts, counts=torch.tensor([1, 0]))


@pytest.mark.parametrize("pkg", [ref, fast], ids=["ref", "fast"])
@pytest.mark.parametrize("value", BAD, ids=["-inf", "-1e30", "nan", "+inf", "below-floor"])
def test_a_bad_stored_gate_is_rejected_by_every_buffer_operation(pkg, value):
    for name, call in _calls(pkg, _bad(value)):
        with pytest.raises(ValueError) as e:
            call()
        msg = str(e.value)
        assert msg.startswith("buffer.G: entry [0, 1"), (name, msg)
        assert "expected a finite cumulative log-gate" in msg and f"{G_FLOOR_PER_ROW * (C + 1):g}" in msg, (name, msg)
        found = float(msg.split(" is ", 1)[1].split(",", 1)[0])
        assert found == value or (found != found and value != value) or found == float(torch.tensor(value)), msg


@pytest.mark.parametrize("pkg", [ref, fast], ids=["ref", "fast"])
def test_a_per_channel_gate_and_the_second_request(pkg):
    buf = _bad(float("-inf"), channel=True, row=(1, 0, 1, 2))
    with pytest.raises(ValueError, match=r"buffer\.G: entry \[1, 0, 1, 2\] \(request 1, row 0 of its 1"):
        pkg.flush(buf, count=1)


@pytest.mark.parametrize("pkg", [ref, fast], ids=["ref", "fast"])
def test_rows_past_the_lengths_and_the_floor_itself_pass(pkg):
    """Row (1, 1) is past request 1's length: -inf there is garbage, never read.  A live G at the floor
    (C resets of -RESET_GATE[float64] each) is what the operations can write, and is accepted."""
    buf = _bad(float("-inf"), row=(1, 1))
    G = buf.G.clone()
    G[0, 1] = -G_FLOOR_PER_ROW * C
    buf = buf.replace(G=G)
    out = pkg.flush(buf, count=0)
    assert out is not None
    assert G_FLOOR_PER_ROW == RESET_GATE[torch.float64]


def test_the_reference_writes_no_G_below_the_floor():
    """Resets through the operations themselves (-inf gates, every token): the buffers they make pass."""
    x = tokens(torch.float64, B=2, T=5, seed=3)
    x["g"][:] = float("-inf")
    _, buf = ref.prefill(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], capacity=3, tail=3)
    buf.check()
    y = one(tokens(torch.float64, B=2, T=1, seed=4))
    y["g"][:] = float("-inf")
    _, buf = ref.buffered_decode(y["q"], y["k"], y["v"], g=y["g"], beta=y["beta"], buffer=buf)
    buf.check()
    assert bool((buf.G[:, :3] >= -G_FLOOR_PER_ROW * 3).all())


@pytest.mark.parametrize("value", [float("-inf"), -1e30, float("nan"), float("inf")], ids=["-inf", "-1e30", "nan", "+inf"])
def test_a_raw_buffer_with_a_bad_stored_gate_is_rejected(value):
    """The raw form keeps each token's gate as the operations store it (a reset as -RESET_GATE): -inf there
    gave NaN silently in the reference's decode."""
    buf = buffer(F32, form="raw")
    g = buf.g.clone()
    g[0, 1] = value
    buf = buf.replace(g=g)
    x = one(tokens(F32, B=2, seed=5))
    with pytest.raises(ValueError, match=r"^buffer\.g: entry \[0, 1, 0\] .*expected a finite log-gate not below -2000"):
        ref.buffered_decode(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], buffer=buf)
    with pytest.raises(ValueError, match=r"^buffer\.g: "):
        ref.flush(buf)
    g[0, 1] = -RESET_GATE[torch.float64]  # what the operations store for a reset: accepted
    o, _ = ref.buffered_decode(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], buffer=buf.replace(g=g))
    assert bool(o.isfinite().all())
