"""kvbuffer_fast: Triton kernels behind the same signatures as kvbuffer_ref (docs/kernels.md).

Each operation takes the reference's keyword-only arguments plus an optional ``config`` (its class in
``kvbuffer_fast.launch``; None picks the launch table's choice).  Unlike the reference, buffer
operations update the buffer's tensors IN PLACE (serving needs it).  ``kvbuffer_fast.baselines`` holds
what engines run today (the recurrent decode step, per-draft-state verify / accept), for benchmarks.
"""

from .decode import buffered_decode
from .flush import flush, materialize_state
from .recurrent import recurrent_gated_delta_rule
from .accept import accept
from .chunk import chunk_gated_delta_rule
from .direct import direct_gated_delta_rule
from .engine_inputs import engine_inputs
from .prefill import prefill
from .verify import verify
from .pool import KVPool

#: The buffer capacity to use when nothing else decides: on the H200 at Qwen3-Next shapes, C = 16
#: gave the fastest buffered decode step at every batch (0.74-0.79x fla's per-token time, against
#: 0.84-0.87x for C = 32 and 0.96-0.99x for C = 64), since it moves the fewest bytes per step (the
#: buffer's reads grow with C faster than the amortised fold shrinks).
DEFAULT_CAPACITY = 16

__all__ = [
    "recurrent_gated_delta_rule", "buffered_decode", "flush", "materialize_state", "verify", "accept",
    "chunk_gated_delta_rule", "direct_gated_delta_rule", "prefill", "engine_inputs", "KVPool", "DEFAULT_CAPACITY",
]
