"""The benchmarked operations by group, and the peers each is compared with: plain data, read by the
workloads (``bench/workloads.py``), the runner and the report (which renders without torch)."""

#: op -> group, in the order the runner measures them.
OPS = {
    "read_state": "decode", "recurrent_decode": "decode", "fla_fused_recurrent": "decode", "buffered_decode": "decode",
    "buffered_decode_bf16": "decode",
    "pool_decode": "decode", "pool_decode_engine": "decode", "replayssm_decode": "decode", "sglang_decode": "decode",
    "flashinfer_decode": "decode", "flashinfer_decode_bf16": "decode", "flashinfer_decode_kmajor": "decode",
    "verify": "verify", "per_draft_state_verify": "verify", "fla_fused_recurrent_tokens": "verify",
    "fla_chunk_tokens": "verify", "flashinfer_mtp": "verify",
    "pool_verify": "verify",
    "accept": "accept", "per_draft_state_accept": "accept", "pool_accept": "accept", "flush": "accept",
    "round": "round", "pool_round": "round", "pool_round_per_layer": "round", "per_draft_state_round": "round",
    "replayssm_round": "round", "round_cycle": "round", "round_cycle_fold": "round", "round_cycle_fold_bf16": "round",
    "pool_round_cycle": "round", "pool_round_cycle_fold": "round", "replayssm_round_cycle": "round",
    "tree_round": "round", "per_draft_state_tree_round": "round", "flashinfer_round": "round",
}
GROUPS = ("decode", "verify", "accept", "round")
#: The op each group is about, and the peers its ratios are taken against (same run, same batch).  Every
#: decode op is also taken against ``read_state``, the measured floor of its state read (the report's "x read").
PEERS = {
    "recurrent_decode": ("read_state",),
    "fla_fused_recurrent": ("read_state",),
    "buffered_decode": ("recurrent_decode", "fla_fused_recurrent", "replayssm_decode", "sglang_decode",
                        "flashinfer_decode", "flashinfer_decode_kmajor", "read_state"),
    "buffered_decode_bf16": ("buffered_decode", "flashinfer_decode_bf16", "read_state"),
    "pool_decode": ("buffered_decode", "recurrent_decode", "replayssm_decode", "sglang_decode", "flashinfer_decode",
                    "flashinfer_decode_bf16", "read_state"),
    "pool_decode_engine": ("pool_decode", "sglang_decode", "replayssm_decode", "flashinfer_decode", "read_state"),
    "verify": ("per_draft_state_verify", "fla_fused_recurrent_tokens", "fla_chunk_tokens", "flashinfer_mtp"),
    "accept": ("per_draft_state_accept",),
    "flush": ("recurrent_decode",),
    "pool_verify": ("verify",),
    "pool_accept": ("accept",),
    "round": ("per_draft_state_round", "fla_fused_recurrent_tokens", "replayssm_round", "flashinfer_round"),
    "pool_round": ("round", "per_draft_state_round", "replayssm_round", "flashinfer_round"),
    "pool_round_per_layer": ("pool_round", "replayssm_round"),
    "replayssm_decode": ("recurrent_decode", "read_state"),
    "sglang_decode": ("recurrent_decode", "read_state"),
    "flashinfer_decode": ("recurrent_decode", "sglang_decode", "read_state"),
    "flashinfer_decode_bf16": ("flashinfer_decode", "read_state"),
    "flashinfer_decode_kmajor": ("recurrent_decode", "flashinfer_decode", "read_state"),
    "flashinfer_mtp": ("per_draft_state_verify",),
    "flashinfer_round": ("per_draft_state_round",),
    "replayssm_round": ("per_draft_state_round",),
    "round_cycle": ("replayssm_round_cycle", "round", "flashinfer_round"),
    "round_cycle_fold": ("round_cycle", "replayssm_round_cycle"),
    "round_cycle_fold_bf16": ("round_cycle_fold", "replayssm_round_cycle"),
    "pool_round_cycle": ("replayssm_round_cycle", "round_cycle", "pool_round", "flashinfer_round"),
    "pool_round_cycle_fold": ("pool_round_cycle", "round_cycle_fold", "replayssm_round_cycle"),
    "tree_round": ("per_draft_state_tree_round", "round"),
}
