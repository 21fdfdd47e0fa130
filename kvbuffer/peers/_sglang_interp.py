"""Jitted stand-ins for module-level aliases of Triton builtins (``exp = tl.exp`` in SGLang's fla copy),
which the Triton interpreter does not patch: the same builtin, called from a jitted function.  Used by
``kvbuffer.peers._sources.interpreter_fixes`` (the SGLang and vLLM adapters) under TRITON_INTERPRET=1 only."""

import triton
import triton.language as tl


@triton.jit
def exp(x):
    return tl.exp(x)


@triton.jit
def exp2(x):
    return tl.math.exp2(x)


@triton.jit
def log(x):
    return tl.log(x)


@triton.jit
def log2(x):
    return tl.log2(x)
