"""Generate with a Qwen3-Next, Qwen3.5 or Kimi Linear model whose linear-attention layers are served by
KVBuffer, and check that it says exactly what the model says through its own path.

    python3 examples/generate.py --model qwen3_next --capacity 16 --tokens 64
    python3 examples/generate.py --model kimi_linear --drafter tree --tokens 128
    python3 examples/generate.py --model qwen3_5 --checkpoint /path/to/local/dir --prompt "Hello"

Without ``--checkpoint`` the model is a tiny config with random weights (seed ``--seed``; nothing is
downloaded) and the prompt's UTF-8 bytes are its token ids; with one, the directory's weights and
tokenizer are loaded locally.  Needs the ``hf`` extra (``pip install -e '.[hf]'``).  docs/models.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout without install

# transformers imports fla where it is installed; on a CPU fla warns that it found no GPU (expected here)
warnings.filterwarnings("ignore", message="Triton is not supported on current platform", category=UserWarning)
from kvbuffer.integrations import transformers as kt  # noqa: E402


def progress_bar(label: str, total: int):
    """A plain-text progress bar on stderr: call it with the tokens done."""
    start = time.perf_counter()

    def show(done: int):
        width = 30
        fill = int(width * done / max(total, 1))
        rate = done / max(time.perf_counter() - start, 1e-9)
        sys.stderr.write(f"\r{label:<22} [{'#' * fill}{'.' * (width - fill)}] {done:>4}/{total} {rate:7.1f} tok/s")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(kt.FAMILIES), default="qwen3_next")
    ap.add_argument("--prompt", default="the cat sat on the mat; the cat sat on the mat; the cat")
    ap.add_argument("--capacity", "-C", type=int, default=16, help="KVBuffer capacity C (entries per buffer)")
    ap.add_argument("--drafter", choices=["none", "chain", "tree"], default="none",
                    help="speculative drafts by prompt lookup: a chain, or a tree of the top candidates")
    ap.add_argument("--draft-length", type=int, default=4)
    ap.add_argument("--branches", type=int, default=3, help="tree drafter: candidate continuations merged")
    ap.add_argument("--tokens", type=int, default=64, help="tokens to generate")
    ap.add_argument("--device", default="cpu", help="cpu (kvbuffer_ref's pool) or cuda (kvbuffer_fast's pool)")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--checkpoint", default=None, help="a local checkpoint directory (no download)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (tiny models: 1 is fastest)")
    a = ap.parse_args(argv)

    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    device = torch.device(a.device)
    if device.type == "cuda":
        from kvbuffer_fast.pool import KVPool
    else:
        from kvbuffer_ref import KVPool

    model = kt.build_model(a.model, seed=a.seed, dtype=dtype, checkpoint=a.checkpoint, device=device)
    vocab = model.config.vocab_size
    if a.checkpoint is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(a.checkpoint, local_files_only=True)
        ids = tok(a.prompt, return_tensors="pt").input_ids.to(device)
        decode = tok.decode
    else:
        tok = None
        ids = torch.tensor([[1 + b % (vocab - 1) for b in a.prompt.encode()]], device=device)
        decode = lambda t: bytes((x - 1) % 256 for x in t).decode("utf-8", "replace")  # noqa: E731
    mask = torch.ones_like(ids)
    print(f"{a.model}: {sum(p.numel() for p in model.parameters()):,} parameters, {a.dtype} on {device}; "
          f"prompt {ids.shape[1]} tokens; C = {a.capacity}; drafter {a.drafter}")

    # the model's own path: transformers' generate
    t0 = time.perf_counter()
    ref, ref_logits = kt.greedy_reference(model, ids, mask, a.tokens)
    t_ref = time.perf_counter() - t0
    print(f"{'transformers generate':<22} {a.tokens} tokens in {t_ref:.2f} s")

    # through KVBuffer
    D = 1 + (a.draft_length * (a.branches if a.drafter == "tree" else 1) if a.drafter != "none" else 0)
    runner = kt.KVBufferRunner(model, capacity=a.capacity, pool_cls=KVPool, dtype=dtype, device=device,
                               max_requests=1, max_drafts=max(D, 1))
    bar = progress_bar("through KVBuffer", a.tokens)
    stats = kt.SpecStats()
    t0 = time.perf_counter()
    if a.drafter == "none":
        out, _ = runner.generate(ids, mask, a.tokens, progress=bar)
        slots_bytes = None
    else:
        draft = (kt.prompt_lookup_chain(length=a.draft_length) if a.drafter == "chain"
                 else kt.prompt_lookup_tree(length=a.draft_length, branches=a.branches))
        out = runner.speculative_generate(ids, a.tokens, draft, stats=stats, progress=bar)
        slots_bytes = stats.bytes_per_request[-1]
    t_kvb = time.perf_counter() - t0

    same = torch.equal(out.cpu(), ref.cpu())
    print("\n--- summary")
    print(f"output: {decode(out[0].tolist())!r}")
    print(f"tokens/s: KVBuffer {a.tokens / t_kvb:.1f}, the model's own path {a.tokens / t_ref:.1f} "
          f"(tiny models measure Python and launch overhead per token, not the kernels' speed)")
    if a.drafter != "none":
        print(f"speculative: acceptance rate {stats.acceptance_rate:.2f} ({stats.accepted}/{stats.proposed} drafts), "
              f"{stats.tokens_per_verify:.2f} tokens per verify ({stats.verifies} verifies)")
        print(f"pool bytes for the request: state {slots_bytes['state']:,}, buffer {slots_bytes['buffer']:,}, "
              f"draft room {slots_bytes['drafts']:,}")
    if same:
        print(f"equality: the {a.tokens} tokens equal transformers' own greedy generation")
        return 0
    step = int((out.cpu() != ref.cpu()).nonzero()[0, 1])
    top = ref_logits[0, step].topk(2).values.tolist()
    print(f"equality: FIRST DIFFERENCE at step {step} (KVBuffer {int(out[0, step])}, transformers {int(ref[0, step])}); "
          f"transformers' top-two logits there differ by {top[0] - top[1]:.3e} (a float32 tie if that is within "
          f"a few 1e-6 of the logits' size; run with --dtype float64)")
    return 1


if __name__ == "__main__":
    sys.exit(main())
