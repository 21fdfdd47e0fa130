"""kvbuffer_fast: Triton kernels behind the same signatures as kvbuffer_ref (docs/kernels.md).

Unlike the reference, buffer operations update the buffer's tensors IN PLACE (serving needs it).
"""

from .decode import buffered_decode, flush, materialize_state
from .recurrent import recurrent_decode, recurrent_gated_delta_rule

__all__ = ["recurrent_decode", "recurrent_gated_delta_rule", "buffered_decode", "flush", "materialize_state"]
