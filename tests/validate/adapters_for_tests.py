"""Adapters used by the tests of ``kvbuffer validate``: a correct one, deliberately broken ones."""

import types

import torch

import kvbuffer_ref as ref

#: A correct adapter: the reference's direct and chunk forms, float64 only.
good = types.SimpleNamespace(
    name="good", dtypes=(torch.float64,),
    direct_gated_delta_rule=ref.direct_gated_delta_rule,
    chunk_gated_delta_rule=ref.chunk_gated_delta_rule,
)


def _wrong_scale_direct(q, k, v, *, g, beta, scale=None):
    """Forgets that the default scale is K ** -0.5 (uses 1)."""
    return ref.direct_gated_delta_rule(q, k, v, g=g, beta=beta, scale=1.0 if scale is None else scale)


#: Broken: direct mode ignores the default scale.
wrong_scale = types.SimpleNamespace(name="wrong_scale", dtypes=(torch.float64,),
                                    direct_gated_delta_rule=_wrong_scale_direct)


def _raising_direct(q, k, v, *, g, beta, scale=None):
    if 3 <= q.shape[0] <= 5 and 2 < q.shape[1] <= 20:
        raise RuntimeError("sequences longer than 2 tokens are not supported in batches of 3")
    return ref.direct_gated_delta_rule(q, k, v, g=g, beta=beta, scale=scale)


#: Broken: raises for 3 <= B <= 5 and 2 < T <= 20 (no fixed anchor or boundary case has that shape: hypothesis
#: must find it).
raises = types.SimpleNamespace(name="raises", dtypes=(torch.float64,), direct_gated_delta_rule=_raising_direct)

#: Not an adapter: no operation at all.
empty = types.SimpleNamespace(name="empty")


def factory():
    """A factory: called with no arguments, returns the adapter."""
    return good
