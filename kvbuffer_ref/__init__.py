"""kvbuffer_ref: the float64-capable pure-PyTorch oracle of the gated delta rule in every serving form.

See docs/math.md for the derivations and docs/conventions.md for shapes and argument order.  What is
built on the oracle (``kvbuffer validate``, its adapters, the golden vectors, the hypothesis strategies
and properties) is the sub-package ``kvbuffer.validate``.
"""

from .buffer import Drafts, KVBuffer
from .chunk import chunk_gated_delta_rule
from .decode import buffered_decode, flush, materialize_state
from .direct import direct_gated_delta_rule
from .engine_inputs import engine_inputs
from .pool import KVPool, head_layout
from .prefill import default_tail, prefill
from .recurrent import recurrent_gated_delta_rule
from .speculative import accept, path_to, verify
from .tp import HeadShard, all_gather_heads, check_pool_shard, gather_heads, shard_tokens, tp_shard, tp_shards

__version__ = "0.1.0"

__all__ = [
    "KVBuffer",
    "Drafts",
    "KVPool",
    "head_layout",
    "HeadShard",
    "tp_shard",
    "tp_shards",
    "shard_tokens",
    "gather_heads",
    "all_gather_heads",
    "check_pool_shard",
    "recurrent_gated_delta_rule",
    "chunk_gated_delta_rule",
    "direct_gated_delta_rule",
    "buffered_decode",
    "flush",
    "materialize_state",
    "verify",
    "accept",
    "path_to",
    "prefill",
    "default_tail",
    "engine_inputs",
]
