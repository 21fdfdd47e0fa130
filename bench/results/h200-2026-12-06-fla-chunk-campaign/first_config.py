"""Run a command with every triton.autotune list cut to its first config (a config the peer itself tries)."""
import runpy, sys
import triton
_orig = triton.autotune
def autotune(configs, *a, **k):
    return _orig(configs[:1], *a, **k)
triton.autotune = autotune
sys.argv = sys.argv[1:]
if sys.argv[0] == "-m":
    sys.argv = sys.argv[1:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    runpy.run_path(sys.argv[0], run_name="__main__")
