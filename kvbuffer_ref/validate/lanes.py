"""What ``kvbuffer validate`` runs: the validated operations, their cases, and the plan of lanes.

A *lane* is one (operation, implementation, dtype).  ``OPS`` names each operation, the adapter
attributes it needs, the hypothesis strategy of its parameters, its fixed anchor cases and the
property (``properties.check_*``) that judges it; ``plan`` turns implementations into lanes,
with a NOT PROVIDED / SKIP row and its reason for everything that is not run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from . import properties as P
from . import strategies as kst
from .adapters import Implementation, stepwise_recurrent
from .cases import Case

__all__ = ["ValidationError", "DTYPES", "DEFAULT_DTYPES", "dtype_name", "Sizes", "NORMAL", "SMALL",
           "INTERPRETED_EXAMPLES", "Op", "OPS", "OP_KEYS", "FORM_OPS", "ANCHORS", "select_ops", "parse_dtypes",
           "Lane", "plan", "op_params"]


class ValidationError(ValueError):
    """A bad request (unknown op or dtype, missing device, nothing to run): the CLI exits 2 on it."""


#: dtype names accepted by --dtype.
DTYPES = {"float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
          "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
#: dtypes validated when --dtype is not given (each implementation runs those it declares).
DEFAULT_DTYPES = (torch.float64, torch.float32)


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


# ----------------------------------------------------------------------------- sizes of the cases
@dataclass(frozen=True)
class Sizes:
    """Bounds of the drawn cases.  ``small`` is for implementations on the Triton interpreter."""

    max_B: int = 3
    max_T: int = 12
    max_H: int = 2
    max_group: int = 3
    dims: tuple = (1, 2, 3, 5, 7, 8, 12, 16, 40, 72, 136)  # > 32, > 64, > 128: more than one tile of BV columns
    max_capacity: int = 6
    max_history: int = 10
    max_new: int = 6
    max_chain: int = 6
    max_tree: int = 10
    max_after: int = 3
    max_prompt: int = 12
    big_capacity: int = 20  # drawn now and then: more cached rows than a kernel's row tile (16)


NORMAL = Sizes()
SMALL = Sizes(max_B=3, max_T=8, max_H=2, max_group=2, max_capacity=5, max_history=6, max_new=4, max_chain=4,
              max_tree=6, max_after=2, max_prompt=8, big_capacity=18)
#: examples per lane on the interpreter, per profile: its cases are SMALL (the interpreter is ~1000x slower
#: than PyTorch), so more of them; each still covers ragged requests in several modes at once.
INTERPRETED_EXAMPLES = {"ci": 30, "thorough": 300}


# ----------------------------------------------------------------------------- operations
@dataclass(frozen=True)
class Op:
    """One validated operation: the adapter attributes it needs, its cases, its property."""

    key: str
    needs: tuple
    summary: str
    strategy: Callable  # (sizes, case_kw) -> strategy of a params dict
    check: Callable  # (impl_obj, params, dtype, device, form) -> list[Comparison]
    form: Optional[str] = None

    @property
    def name(self) -> str:
        return f"{self.key}[{self.form}]" if self.form else self.key

    def with_form(self, form: str) -> "Op":
        return Op(self.key, self.needs, self.summary, self.strategy, self.check, form)


#: Gate and beta regimes drawn, weighted by repetition towards the informative ones (and hypothesis
#: shrinks towards the first): with g = 0 (no decay), an underflowing decay (everything before the
#: last token vanishes) or beta = 0 (nothing written) many wrong formulas agree with the right one.
#: The degenerate regimes still come up, a quarter of the time.
GATES = ("mild", "strong", "mixed", "mild", "strong", "mixed", "zero", "underflow")
BETAS = ("uniform", "mixed", "uniform", "mixed", "one", "zero")


def _case_kw(s: Sizes, kw: dict) -> dict:
    return dict(max_H=s.max_H, max_group=s.max_group, dims=s.dims, gates=GATES, betas=BETAS, **kw)


def _cases(s, kw):
    from hypothesis import strategies as st
    return st.fixed_dictionaries({"case": kst.cases(max_B=s.max_B, max_T=s.max_T, **_case_kw(s, kw))})


def _chunk_params(s, kw):
    from hypothesis import strategies as st
    return st.fixed_dictionaries({"case": kst.cases(max_B=s.max_B, max_T=s.max_T + 8, **_case_kw(s, kw)),
                                  "chunk_size": st.sampled_from([1, 2, 3, 5, 8, 64])})


def _buffer_params(s, kw, min_new=0):
    return kst.buffer_setups(max_capacity=s.max_capacity, max_history=s.max_history, min_new=min_new,
                             max_new=s.max_new, max_B=s.max_B, big_capacity=s.big_capacity, **_case_kw(s, kw))


def _flush_params(s, kw):
    from hypothesis import strategies as st

    @st.composite
    def draw(d):
        p = d(_buffer_params(s, kw, min_new=1))
        steps = p["case"].T - p["history"]
        p["flushes"] = d(kst.flush_schedules(p["case"].B, steps, p["capacity"], min_flushes=1, lengths=p["lengths"]),
                         label="flushes")
        return p
    return draw()


def _materialize_params(s, kw):
    return kst.buffer_setups(max_capacity=s.max_capacity, max_history=s.max_history, min_new=0, max_new=0,
                             max_B=s.max_B, big_capacity=s.big_capacity, **_case_kw(s, kw))


def _chain_params(s, kw):
    return kst.chain_setups(max_capacity=s.max_capacity, max_B=s.max_B, max_drafts=s.max_chain,
                            max_history=s.max_history, max_after=s.max_after, big_capacity=s.big_capacity,
                            **_case_kw(s, kw))


def _tree_params(s, kw):
    return kst.tree_setups(max_capacity=s.max_capacity, max_B=s.max_B, max_drafts=s.max_tree,
                           max_history=s.max_history, max_after=s.max_after, big_capacity=s.big_capacity,
                           **_case_kw(s, kw))


def _prefill_params(s, kw):
    return kst.prefill_setups(max_capacity=s.max_capacity, max_prompt=s.max_prompt, max_new=s.max_new // 2 + 1,
                              max_B=s.max_B, big_capacity=s.big_capacity, **_case_kw(s, kw))


# ----------------------------------------------------------------------------- anchor cases
# A few fixed cases per operation that every run checks first (hypothesis explicit examples), before
# the fresh random ones: each hits the paths a kernel is most likely to get wrong at once, whatever
# the seed: more cached rows than a 16-row tile (C = 18), more value columns than a 128-column tile
# (V = 136), grouped heads, a direct-mode request whose full buffer folds, requests that own a state
# and fill up, partial flushes that keep entries, acceptances past the capacity, both gate kinds.
def _anchors() -> dict:
    def c(B, T, H, HV, K, V, channel, gate="mild", beta="uniform", seed=1):
        return Case(B=B, T=T, H=H, HV=HV, K=K, V=V, channel_gate=channel, gate=gate, beta=beta, seed=seed)

    return {
        "recurrent": [dict(case=c(2, 3, 2, 4, 8, 136, False)), dict(case=c(1, 3, 1, 2, 5, 7, True, "strong"))],
        "recurrent_decode": [dict(case=c(2, 3, 2, 4, 8, 136, False)), dict(case=c(1, 3, 1, 2, 5, 7, True, "strong"))],
        "chunk": [dict(case=c(2, 11, 2, 4, 7, 5, False), chunk_size=4),
                  dict(case=c(1, 9, 1, 2, 5, 6, True, "strong"), chunk_size=3)],
        "direct": [dict(case=c(2, 7, 2, 4, 7, 5, False)), dict(case=c(1, 6, 1, 2, 5, 6, True, "strong"))],
        "decode": [dict(case=c(3, 21, 2, 4, 8, 136, False), capacity=18, history=18, lengths=[18, 17, 5]),
                   dict(case=c(2, 11, 1, 2, 5, 7, True, "strong"), capacity=3, history=7, lengths=[3, 1])],
        "flush": [dict(case=c(2, 12, 2, 4, 6, 136, False), capacity=5, history=9, lengths=[5, 4],
                       flushes={0: [3, 2], 1: None, 2: [1, 0]}),
                  dict(case=c(2, 7, 1, 2, 3, 5, True, "strong"), capacity=4, history=4, lengths=[4, 2],
                       flushes={0: [2, 1], 2: [1, 2]})],
        "materialize": [dict(case=c(2, 18, 2, 4, 8, 136, False), capacity=18, lengths=[18, 3]),
                        dict(case=c(2, 6, 1, 2, 5, 6, True, "strong"), capacity=4, lengths=[4, 2])],
        "verify_chain": [dict(case=c(2, 13, 2, 4, 6, 136, False), capacity=4, history=6, lengths=[4, 2],
                              parents=[[-1, 0, 1, 2, 3]] * 2, num_drafts=[5, 3], nodes=[4, 1], after=2,
                              use_counts=True)],
        "verify_tree": [dict(case=c(2, 13, 1, 2, 5, 7, True, "strong"), capacity=3, history=5, lengths=[3, 1],
                             parents=[[-1, 0, 0, 1, 3, -1], [-1, 0, -1, 2, 3, 4]], num_drafts=[6, 4],
                             nodes=[4, 3], after=2, use_counts=False)],
        "prefill": [dict(case=c(2, 13, 2, 4, 6, 7, False), capacity=4, prompt=10, tail=None, chunk_size=3),
                    dict(case=c(1, 8, 1, 2, 5, 6, True, "strong"), capacity=3, prompt=6, tail=3, chunk_size=4)],
    }


ANCHORS = _anchors()


def op_params(p: dict) -> dict:
    """An operation's parameters without its ``case`` (what the property takes besides the case)."""
    return {k: v for k, v in p.items() if k != "case"}


OPS: tuple[Op, ...] = (
    Op("recurrent", ("recurrent_gated_delta_rule",), "recurrent form (output and final state) from a random state",
       _cases, lambda o, p, dt, dev, f: P.check_recurrent(o, p["case"], dt, device=dev)),
    Op("recurrent_decode", ("recurrent_decode",), "in-place single-token step, run once per token",
       _cases, lambda o, p, dt, dev, f: P.check_recurrent(stepwise_recurrent(o.recurrent_decode), p["case"], dt,
                                                          device=dev)),
    Op("chunk", ("chunk_gated_delta_rule",), "chunkwise form, any T and chunk size",
       _chunk_params, lambda o, p, dt, dev, f: P.check_chunk(o, p["case"], dt, chunk_size=p["chunk_size"], device=dev)),
    Op("direct", ("direct_gated_delta_rule",), "direct mode (no state) == recurrence from zero",
       _cases, lambda o, p, dt, dev, f: P.check_direct(o, p["case"], dt, device=dev)),
    Op("decode", ("buffered_decode", "flush"), "buffered decode after ragged buffers (unused slots poisoned)",
       _buffer_params, lambda o, p, dt, dev, f: P.check_decode(o, p["case"], dt, form=f, device=dev, poison=True,
                                                               **op_params(p))),
    Op("flush", ("buffered_decode", "flush"), "flush schedules (partial, repeated) are invisible",
       _flush_params, lambda o, p, dt, dev, f: P.check_decode(o, p["case"], dt, form=f, device=dev, poison=True,
                                                              **op_params(p))),
    Op("materialize", ("materialize_state",), "materialize_state == the recurrence's state, buffer unchanged",
       _materialize_params, lambda o, p, dt, dev, f: P.check_materialize(
           o, p["case"], dt, capacity=p["capacity"], lengths=p["lengths"], form=f, device=dev, poison=True)),
    Op("verify_chain", ("verify", "accept", "buffered_decode", "flush"),
       "chain verify of ragged drafts, accept counts, decode on",
       _chain_params, lambda o, p, dt, dev, f: P.check_verify_accept(o, p["case"], dt, form=f, device=dev,
                                                                     poison=True, **op_params(p))),
    Op("verify_tree", ("verify", "accept", "buffered_decode", "flush"),
       "tree verify (per-path recurrence), accept a node, decode on",
       _tree_params, lambda o, p, dt, dev, f: P.check_verify_accept(o, p["case"], dt, form=f, device=dev,
                                                                    poison=True, **op_params(p))),
    Op("prefill", ("prefill", "buffered_decode", "flush"), "prefill hand-off at any split, then decode",
       _prefill_params, lambda o, p, dt, dev, f: P.check_prefill(o, p["case"], dt, form=f, device=dev, **op_params(p))),
)
#: Operations whose lanes exist once per buffer form.
FORM_OPS = {"decode", "flush", "materialize", "verify_chain", "verify_tree", "prefill"}
OP_KEYS = tuple(o.key for o in OPS)



def select_ops(spec: Optional[str]) -> list[tuple[str, Optional[str]]]:
    """--ops 'decode,verify_tree[u]' -> [(key, form or None)]; None = every operation."""
    if spec is None or not spec.strip():
        return [(k, None) for k in OP_KEYS]
    out = []
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        m = re.fullmatch(r"([a-z_]+)(?:\[(u|raw)\])?", item)
        if not m or m.group(1) not in OP_KEYS:
            raise ValidationError(f"--ops: unknown operation {item!r}; known: {', '.join(OP_KEYS)} "
                                  f"(a buffer operation may name its form, e.g. decode[u])")
        if m.group(2) and m.group(1) not in FORM_OPS:
            raise ValidationError(f"--ops: {m.group(1)} has no buffer form, got {item!r}")
        out.append((m.group(1), m.group(2)))
    if not out:
        raise ValidationError("--ops: no operation given")
    return out


def parse_dtypes(spec: Optional[str]) -> Optional[list[torch.dtype]]:
    if spec is None or not spec.strip():
        return None
    out = []
    for name in (x.strip().lower().replace("torch.", "") for x in spec.split(",")):
        if name not in DTYPES:
            raise ValidationError(f"--dtype: unknown dtype {name!r}; known: float64, float32, float16, bfloat16")
        if DTYPES[name] not in out:
            out.append(DTYPES[name])
    return out


# ----------------------------------------------------------------------------- plan
@dataclass
class Lane:
    """One (operation, implementation, dtype) to run, or a row saying why it is not run."""

    op: Op
    impl: Implementation
    dtype: Optional[torch.dtype]
    status: str = "RUN"  # RUN, or NOT PROVIDED / SKIP with a reason
    reason: str = ""


def plan(impls: Sequence[Implementation], ops=None, dtypes: Optional[Sequence[torch.dtype]] = None,
         device: str = "cpu") -> list[Lane]:
    """Every lane: what runs, and for everything else a NOT PROVIDED / SKIP row with its reason."""
    selected = ops or [(k, None) for k in OP_KEYS]
    lanes = []
    for impl in impls:
        for op in OPS:
            wanted = [f for k, f in selected if k == op.key]
            if not wanted:
                continue
            missing = [a for a in op.needs if not impl.has(a) or a in impl.not_provided]
            if missing:
                reasons = [impl.not_provided[a] for a in missing if a in impl.not_provided]
                why = reasons[0] if reasons else f"the adapter has no {', '.join(missing)}"
                lanes.append(Lane(op, impl, None, "NOT PROVIDED", why))
                continue
            if op.key in FORM_OPS:
                forms = sorted({f for f in wanted if f} or {"u", "raw"}, key=["u", "raw"].index)
                variants = [op.with_form(f) for f in forms if f in impl.forms]
                absent = [op.with_form(f) for f in forms if f not in impl.forms]
            else:
                variants, absent = [op], []
            if dtypes is None:
                use = [d for d in DEFAULT_DTYPES if d in impl.dtypes] or [impl.dtypes[0]]
            else:
                use = list(dtypes)
            for v in variants:
                for dt in use:
                    if dt not in impl.dtypes:
                        lanes.append(Lane(v, impl, dt, "NOT PROVIDED",
                                          f"the adapter declares dtypes {[dtype_name(d) for d in impl.dtypes]}"))
                    elif dt == torch.bfloat16 and impl.interpreted:
                        lanes.append(Lane(v, impl, dt, "SKIP", "the Triton interpreter mishandles bfloat16 "
                                                               "(run --device cuda)"))
                    else:
                        lanes.append(Lane(v, impl, dt))
            for v in absent:
                lanes.append(Lane(v, impl, None, "NOT PROVIDED", f"the adapter declares buffer forms {list(impl.forms)}"))
    return lanes
