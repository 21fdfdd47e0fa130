"""kvbuffer_fast: Triton kernels behind the same signatures as kvbuffer_ref (docs/kernels.md).

Unlike the reference, buffer operations update the buffer's tensors IN PLACE (serving needs it).
"""

from .decode import buffered_decode, flush, materialize_state
from .recurrent import recurrent_decode, recurrent_gated_delta_rule

__all__ = ["recurrent_decode", "recurrent_gated_delta_rule", "buffered_decode", "flush", "materialize_state"]
from .speculative import accept, verify  # noqa: E402  (speculative verification, docs/speculative.md)
from .baseline_verify import per_draft_state_accept, per_draft_state_verify  # noqa: E402
__all__ += ["verify", "accept", "per_draft_state_verify", "per_draft_state_accept"]
