"""kvbuffer_fast as the properties see it in the tests: before every buffer operation, all buffer
memory a kernel must not read (slots past each request's length, the state storage of requests in
direct mode) is set to NaN, so a read of garbage turns into a failing output; and each operation is
held to its in-place contract."""

import dataclasses
import os

import torch

if not torch.cuda.is_available():  # tests/conftest.py does this too; kernels are decorated at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kvbuffer_fast as fast  # noqa: E402
from kvbuffer.validate.properties import poison_unused_  # noqa: E402


class Poisoned:
    """kvbuffer_fast with every buffer element it must not read set to NaN before each call."""

    recurrent_gated_delta_rule = staticmethod(fast.recurrent_gated_delta_rule)

    @staticmethod
    def buffered_decode(*args, buffer, **kw):
        poison_unused_(buffer)
        o, out = fast.buffered_decode(*args, buffer=buffer, **kw)
        assert out is buffer, "buffered_decode must return the buffer it updated in place"
        return o, out

    @staticmethod
    def flush(buffer, **kw):
        poison_unused_(buffer)
        return fast.flush(buffer, **kw)

    @staticmethod
    def verify(*args, buffer, **kw):
        poison_unused_(buffer)
        before = {f.name: getattr(buffer, f.name).clone() for f in dataclasses.fields(buffer)
                  if getattr(buffer, f.name) is not None}
        o, drafts = fast.verify(*args, buffer=buffer, **kw)
        for n, x in before.items():
            assert torch.equal(x.nan_to_num(0.0), getattr(buffer, n).nan_to_num(0.0)), f"verify modified buffer.{n}"
        return o, drafts

    @staticmethod
    def accept(buffer, drafts, **kw):
        poison_unused_(buffer)
        out = fast.accept(buffer, drafts, **kw)
        assert out is buffer, "accept must return the buffer it updated in place"
        return out


def assert_all(results) -> None:
    """Every comparison passed, and there was at least one."""
    assert results, "no comparison was made"
    for r in results:
        assert r.passed, str(r)
