"""kvbuffer_fast: Triton kernels behind the same signatures as kvbuffer_ref (docs/kernels.md).

Unlike the reference, buffer operations update the buffer's tensors IN PLACE (serving needs it).
"""

from .baseline_verify import per_draft_state_accept, per_draft_state_verify
from .decode import buffered_decode, flush, materialize_state
from .recurrent import recurrent_decode, recurrent_gated_delta_rule
from .speculative import accept, verify

#: The buffer capacity to use when nothing else decides: on the H200 at Qwen3-Next shapes, C = 16
#: gave the fastest buffered decode step at every batch (0.74-0.79x fla's per-token time, against
#: 0.84-0.87x for C = 32 and 0.96-0.99x for C = 64; bench/results/h200_gpu_check/README.md),
#: since it moves the fewest bytes per step (the buffer's reads grow with C faster than the
#: amortised fold shrinks).
DEFAULT_CAPACITY = 16

__all__ = [
    "recurrent_decode", "recurrent_gated_delta_rule", "buffered_decode", "flush", "materialize_state",
    "verify", "accept", "per_draft_state_verify", "per_draft_state_accept", "DEFAULT_CAPACITY",
]
