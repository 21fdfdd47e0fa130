"""Real models end to end: Qwen3-Next, Qwen3.5 and Kimi Linear say through KVBuffer what they say without it.

Tiny configs (hidden 64, 4 layers: 3 linear-attention, 1 full-attention; random weights, seed 0), built
by ``kvbuffer.integrations.transformers.build_model``; nothing is downloaded.

* Greedy generation through ``KVBufferRunner`` (the linear layers' recurrence in a ``kvbuffer_ref.KVPool``)
  equals transformers' own ``generate`` token for token, batched with ragged prompt lengths on both
  sides of C, for C in {4, 16, 64}.  Logits are held to the error table
  (``kvbuffer.validate.tolerances``) against the float64 truth: a float64 copy of the model whose
  recurrence is ``kvbuffer_ref.recurrent_gated_delta_rule`` in float64, teacher-forced over the same
  tokens; the baseline is transformers' own float32 path.  One slice = one (request, step).
* A step where KVBuffer's argmax differs from transformers' is a genuine tie only when a top-two gap
  (either path's) is within twice the absolute error the budget admits at that slice
  (``2 x budget x ||truth||``: each of the two logits may move by up to ``budget x ||truth||``); the test
  prints it, counts it and continues from transformers' token; any other difference fails.  In float64
  (pool and model float64) no tie is allowed.
* Speculative decoding (``speculative_generate``): prompt-lookup chains and trees verified through
  ``pool.verify`` / ``pool.accept`` give exactly the plain greedy tokens; acceptance rate, tokens per
  verify and pool bytes per request are printed (``-s`` shows them).

CI runs ``KVBUFFER_HF_TOKENS`` tokens per request (default 16); ``KVBUFFER_HF_TOKENS=128`` is the full run.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import os

import pytest

if importlib.util.find_spec("transformers") is None:
    pytest.skip("HF transformers not installed (pip install -e '.[hf]')", allow_module_level=True)

import torch  # noqa: E402

from kvbuffer.integrations import transformers as kt  # noqa: E402
from kvbuffer.validate.tolerances import compare  # noqa: E402

TOKENS = int(os.environ.get("KVBUFFER_HF_TOKENS", "16"))
MODELS = ["qwen3_next", "qwen3_5", "kimi_linear"]
CAPACITIES = [4, 16, 64]


@functools.lru_cache(maxsize=None)
def model(model_type: str, dtype: torch.dtype = torch.float32):
    if dtype == torch.float32:
        return kt.build_model(model_type, seed=0)
    m = copy.deepcopy(model(model_type)).to(dtype)
    m.config._experts_implementation = "eager"
    return m


def prompt_lengths(C: int) -> list:
    """Ragged: shorter than, just under, just over and more than twice the capacity."""
    return sorted({2, C - 1, C + 2, 2 * C + 3})


def prompts(lengths, seed: int = 1, vocab: int = 256):
    """A left-padded batch (pad id 0, mask 0) of random prompts of ``lengths``."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.zeros(len(lengths), T, dtype=torch.long)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, T - n:] = torch.randint(1, vocab, (n,), generator=g)
        mask[i, T - n:] = 1
    return ids, mask


def top_two_gap(x: torch.Tensor) -> float:
    a, b = x.topk(2).values.tolist()
    return a - b


def run_equality(model_type: str, C: int, dtype: torch.dtype):
    """(comparison of the logits, tie steps, mismatching steps) of one model / capacity / dtype."""
    m = model(model_type, dtype)
    ids, mask = prompts(prompt_lengths(C))
    ref_tok, ref_log = kt.greedy_reference(m, ids, mask, TOKENS)
    truth = kt.oracle_logits(m, ids, mask, ref_tok)
    baseline = ref_log if dtype == torch.float32 else None  # float64: the floors alone
    ties, wrong = [], []

    def choose(step, logits):
        mine = logits.argmax(-1)
        for b in (mine != ref_tok[:, step]).nonzero().flatten().tolist():
            base = None if baseline is None else baseline[b, step][None, None]
            c = compare(logits[b][None, None], truth[b, step][None, None], base, dtype=dtype, head_axis=1)
            allowed = 2 * c.budget * float(truth[b, step].norm())
            gap = min(top_two_gap(logits[b]), top_two_gap(ref_log[b, step]))
            what = (f"{model_type} C={C} {str(dtype)[6:]} request {b} step {step}: KVBuffer {int(mine[b])}, "
                    f"transformers {int(ref_tok[b, step])}, top-two gap {gap:.3e}, allowed {allowed:.3e}")
            (ties if gap <= allowed else wrong).append(what)
            if gap <= allowed:
                print("tie (continuing from transformers' token):", what)
        return ref_tok[:, step]  # both paths continue from the same token

    runner = kt.KVBufferRunner(m, capacity=C, dtype=dtype, max_requests=len(prompt_lengths(C)))
    tok, log = runner.generate(ids, mask, TOKENS, choose=choose)
    assert torch.equal(tok, ref_tok)
    c = compare(log, truth, baseline, name=f"{model_type} C={C} logits", dtype=dtype, head_axis=1)
    return c, ties, wrong


@pytest.mark.parametrize("C", CAPACITIES)
@pytest.mark.parametrize("model_type", MODELS)
def test_greedy_equals_transformers_float32(model_type, C):
    c, ties, wrong = run_equality(model_type, C, torch.float32)
    print(f"\n{c}\n{model_type} C={C} float32: {len(ties)} tie step(s) of {TOKENS * len(prompt_lengths(C))}")
    assert not wrong, "\n".join(wrong)
    assert c.passed, str(c)


@pytest.mark.parametrize("C", CAPACITIES)
@pytest.mark.parametrize("model_type", MODELS)
def test_greedy_equals_transformers_float64(model_type, C):
    c, ties, wrong = run_equality(model_type, C, torch.float64)
    print(f"\n{c}\n{model_type} C={C} float64: {len(ties)} tie step(s)")
    assert not wrong, "\n".join(wrong)
    assert not ties, "float64 must have no ties:\n" + "\n".join(ties)
    assert c.passed, str(c)


def repetitive_prompt(seed: int, n: int = 24, period: int = 5, vocab: int = 256) -> torch.Tensor:
    """A prompt with a repeated motif (what prompt lookup finds), plus noise."""
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(1, vocab, (period,), generator=g)
    p = motif.repeat(n // period + 1)[:n].clone()
    p[torch.randint(0, n, (2,), generator=g)] = torch.randint(1, vocab, (2,), generator=g)
    return p[None]


@pytest.mark.parametrize("drafter", ["chain", "tree"])
@pytest.mark.parametrize("model_type", MODELS)
def test_speculative_equals_greedy(model_type, drafter):
    """Drafts verified and accepted through the pool give exactly the plain greedy tokens (float64)."""
    m = model(model_type, torch.float64)
    draft = kt.prompt_lookup_chain(length=4) if drafter == "chain" else kt.prompt_lookup_tree(length=3, branches=3)
    runner = kt.KVBufferRunner(m, capacity=4, dtype=torch.float64, max_requests=1, max_drafts=16)
    stats = kt.SpecStats()
    for seed in (3, 4):
        ids = repetitive_prompt(seed)
        ref, _ = kt.greedy_reference(m, ids, torch.ones_like(ids), TOKENS)
        out = runner.speculative_generate(ids, TOKENS, draft, stats=stats)
        assert torch.equal(out, ref), f"seed {seed}: speculative {out.tolist()} != greedy {ref.tolist()}"
    print(f"\n{model_type} {drafter}: acceptance {stats.acceptance_rate:.2f} ({stats.accepted}/{stats.proposed} drafts), "
          f"{stats.tokens_per_verify:.2f} tokens per verify ({stats.emitted} tokens, {stats.verifies} verifies), "
          f"pool bytes per request {stats.bytes_per_request}")
    assert stats.verifies > 0 and stats.emitted >= 2 * (TOKENS - 1)  # the first token comes from the prompt


def knowing_drafter(prompt_len: int, answer: list, shape: str):
    """A test drafter that knows the greedy answer, so that long paths get accepted: ``chain``: the next
    three answer tokens; ``tree``: a wrong first branch, then the answer's path with a wrong sibling at
    depth two (the accepted path is never the first child)."""

    def draft(history):
        p = len(history) - prompt_len  # tokens of the answer already in the history
        nxt = answer[p:p + 3]
        if len(nxt) < 3:
            return [], []
        wrong = [(t + 1) % 256 or 1 for t in nxt]
        if shape == "chain":
            return nxt, [-1, 0, 1]
        return [wrong[0], nxt[0], wrong[1], nxt[1], nxt[2]], [-1, -1, 1, 1, 3]

    return draft


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("model_type", MODELS)
def test_speculative_accepts_long_paths(model_type, shape):
    """Accepted paths of several drafts, in a tree off its first branch: still exactly greedy (float64),
    with 4 tokens per verify while the drafter knows the answer."""
    m = model(model_type, torch.float64)
    ids = repetitive_prompt(5)
    ref, _ = kt.greedy_reference(m, ids, torch.ones_like(ids), TOKENS)
    runner = kt.KVBufferRunner(m, capacity=4, dtype=torch.float64, max_requests=1, max_drafts=8)
    stats = kt.SpecStats()
    out = runner.speculative_generate(ids, TOKENS, knowing_drafter(ids.shape[1], ref[0].tolist(), shape), stats=stats)
    assert torch.equal(out, ref), f"speculative {out.tolist()} != greedy {ref.tolist()}"
    print(f"\n{model_type} knowing {shape}: acceptance {stats.acceptance_rate:.2f}, "
          f"{stats.tokens_per_verify:.2f} tokens per verify")
    assert stats.accepted >= 3 * (stats.verifies - 3)  # every full round accepts its three answer tokens


def test_pool_is_one_per_model_and_empty_after():
    """One pool layer per linear-attention layer; every slot is back after generation."""
    m = model("qwen3_next")
    runner = kt.KVBufferRunner(m, capacity=4, max_requests=4)
    assert runner.pool.layers == sum(t == "linear_attention" for t in m.config.layer_types)
    ids, mask = prompts([2, 7])
    runner.generate(ids, mask, 3)
    assert not bool(runner.pool.live.any())
    assert int(runner.pool.refs.sum()) == 0


def test_reference_path_is_untouched_outside_a_step():
    """Outside the runner's forwards the modeling module's names are the model's own again."""
    m = model("kimi_linear")
    fam = kt.family_of(m)
    mod = fam.modeling()
    before = {n: getattr(mod, n) for n in (fam.chunk_name, fam.recurrent_name, "causal_conv1d_fn")}
    runner = kt.KVBufferRunner(m, capacity=4, max_requests=2)
    ids, mask = prompts([2, 5])
    runner.generate(ids, mask, 2)
    assert {n: getattr(mod, n) for n in before} == before
    assert all("forward" not in vars(layer) for layer in runner.layers)


def test_qwen3_5_moe_greedy_equals_transformers():
    """The MoE variant of Qwen3.5 (same linear layer, its own module) at one capacity, float32."""
    c, ties, wrong = run_equality("qwen3_5_moe", 16, torch.float32)
    print(f"\n{c}\nqwen3_5_moe C=16 float32: {len(ties)} tie step(s)")
    assert not wrong, "\n".join(wrong)
    assert c.passed, str(c)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_mask_is_the_attention_implementations_own_form(attn):
    """The full-attention layers get the tree in the form the model's own mask builder gives its attention
    (bool under SDPA, additive float under eager; [1, 1, nodes, past + nodes]), and the tree is verified
    exactly (float64, Kimi's MLA)."""
    m = model("kimi_linear", torch.float64) if attn == "sdpa" else kt.build_model(
        "kimi_linear", seed=0, dtype=torch.float64, attn_implementation="eager")
    ids = repetitive_prompt(5)
    ref, _ = kt.greedy_reference(m, ids, torch.ones_like(ids), TOKENS)
    runner = kt.KVBufferRunner(m, capacity=4, dtype=torch.float64, max_requests=1, max_drafts=8)
    masks, build = [], runner._tree_mask
    runner._tree_mask = lambda cache, parents, past: masks.append((parents, past, build(cache, parents, past))) \
        or masks[-1][2]
    stats = kt.SpecStats()
    out = runner.speculative_generate(ids, TOKENS, knowing_drafter(ids.shape[1], ref[0].tolist(), "tree"), stats=stats)
    assert torch.equal(out, ref), f"speculative {out.tolist()} != greedy {ref.tolist()}"
    parents, past, mask = masks[0]
    n = len(parents)
    assert mask.dtype == (torch.bool if attn == "sdpa" else torch.float64) and mask.shape == (1, 1, n, past + n)
    seen = mask[0, 0] if attn == "sdpa" else mask[0, 0] == 0
    for i in range(n):
        ancestors = set()
        j = i
        while j >= 0:
            ancestors.add(j)
            j = parents[j]
        assert seen[i, :past].all() and {j for j in range(n) if seen[i, past + j]} == ancestors


def test_tree_falls_back_to_its_first_path():
    """Where the attention implementation takes no dense mask (the runner's tree mask is None), each round
    verifies the tree's first path as a chain; the output is still exactly greedy."""
    m = model("qwen3_next", torch.float64)
    ids = repetitive_prompt(5)
    ref, _ = kt.greedy_reference(m, ids, torch.ones_like(ids), TOKENS)
    runner = kt.KVBufferRunner(m, capacity=4, dtype=torch.float64, max_requests=1, max_drafts=8)
    runner._tree_mask = lambda *a: None
    stats = kt.SpecStats()
    out = runner.speculative_generate(ids, TOKENS, knowing_drafter(ids.shape[1], ref[0].tolist(), "tree"), stats=stats)
    assert torch.equal(out, ref), f"speculative {out.tolist()} != greedy {ref.tolist()}"
    assert stats.proposed <= stats.verifies  # the first path is the wrong first branch: one draft per round


def test_qk_repeated_to_the_value_heads():
    """The core gets q/k with H heads (transformers 5.23 on) or repeated to the HV value heads (before
    5.23): both give the same tokens, logits on the error table against the float64 truth (baseline: the
    H-head run's); q/k repeated in another order are refused."""
    m = model("qwen3_next")
    ids, mask = prompts([2, 7])

    def run(repeated: bool):
        runner = kt.KVBufferRunner(m, capacity=4, max_requests=2)
        core, g, H = runner._core, runner.HV // runner.H, runner.H

        def heads(x):  # whatever the layer gives: H heads, or each repeated g times
            grouped = x if x.shape[2] == H else x[:, :, ::g]
            return grouped.repeat_interleave(g, 2) if repeated else grouped

        runner._core = lambda q, k, *a, **kw: core(heads(q), heads(k), *a, **kw)
        return runner.generate(ids, mask, 4)

    (grouped_tok, grouped_log), (tok, log) = run(False), run(True)
    assert torch.equal(tok, grouped_tok)
    c = compare(log, kt.oracle_logits(m, ids, mask, tok), grouped_log, name="q/k repeated: logits",
                dtype=torch.float32, head_axis=1)
    assert c.passed, str(c)
    runner = kt.KVBufferRunner(m, capacity=4)
    x = torch.randn(1, 3, runner.H, runner.K)
    with pytest.raises(ValueError, match="grouped"):
        runner._qk_heads(x.repeat(1, 1, runner.HV // runner.H, 1), runner.HV // runner.H)


@pytest.mark.parametrize("version", ["5.16.1", "5.26.0", "6.0.0"])
def test_unsupported_transformers_is_refused(version, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", version)
    with pytest.raises(ImportError, match=f"transformers {version} is not supported; it needs transformers>=5.17"):
        kt.family_of(model("qwen3_5")).modeling()
