"""Costs of the Triton interpreter (TRITON_INTERPRET=1) that carry no check, removed in the tests' processes
(``install()``: tests/conftest.py, the spawned gloo ranks of tests/pool/tp_harness.py, and every program the tests
start that loads kvbuffer_fast, which runs the file named by $KVBUFFER_INTERPRETER_SETUP: tests/conftest.py names
this one):

* CPython keeps its frames in 16 KiB chunks that it maps when the stack grows past a chunk's end and unmaps
  when it shrinks back.  An interpreted kernel goes a few dozen frames deep for every element operation; where
  the caller's depth puts a chunk's end inside that range, every operation maps and unmaps a chunk (hundreds
  of thousands of mmap / munmap pairs in one test, up to half its time).  Each launch runs on a thread of its
  own, whose frames start at the base of a fresh chunk, while the caller waits; the caller's grad mode,
  inference mode and context variables (numpy's error state) go with it, and an exception it raises is raised
  in the caller.
* triton's device-function call (``InterpretedFunction.__call__``) patches triton.language for the interpreter
  on every call of a @triton.jit function from inside a kernel (tl.sum and tl.zeros among them), though the
  launch has patched it already.  Inside a launch that has patched the called function's language modules, the
  call runs on that patch; any other call takes triton's own path.  Which language modules a function's module
  imports is looked up once per function.
* triton's ``_get_np_dtype`` (the NumPy dtype of a Triton dtype, asked by nearly every interpreted operation)
  builds its table of NumPy dtypes on every call; its answer is kept per element dtype.  The interpreter's
  builder makes a new ``tl.block_type`` (shape checked, name formatted) for every block an operation yields;
  one per (element dtype, shape) is kept and handed out again (a block type is not changed after it is made).

Only triton's interpreter is wrapped, and only if its code has the form this expects (else it is left as it
is); the kernels, their arguments and their results are the same.
"""

from __future__ import annotations

import contextvars
import inspect
import threading
import weakref


def install() -> bool:
    """Wrap the interpreter's launch and device-function call as the module says; True if they are wrapped
    (now or before), False where triton is missing or its interpreter is not the expected form."""
    try:
        import torch
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    grid_call, device_call = interp.GridExecutor.__call__, interp.InterpretedFunction.__call__
    if getattr(grid_call, "_tests_wrapped", False):
        return True
    try:
        src = inspect.getsource(device_call)
    except (OSError, TypeError):
        return False
    if "_patch_lang(self.fn)" not in src or "restore" in src or not hasattr(interp, "_patch_lang"):
        return False

    lang_modules = (interp.tl, interp.tl.core)
    patched = threading.local()  # .stack: per running launch, the ids of the language modules it has patched
    known = weakref.WeakKeyDictionary()  # function -> langs(function): its module's imports, fixed once loaded

    def langs(fn) -> frozenset:
        try:
            return known[fn]
        except (KeyError, TypeError):
            pass
        mine = frozenset(id(v) for v in fn.__globals__.values() if any(v is m for m in lang_modules))
        try:
            known[fn] = mine
        except TypeError:  # not weakly referenceable: not kept
            pass
        return mine

    def stack() -> list:
        if not hasattr(patched, "stack"):
            patched.stack = []
        return patched.stack

    def launch(self, *args, **kwargs):
        stack().append(set(langs(self.fn)))  # grows as the launch's device calls patch more modules
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            stack().pop()

    def on_a_fresh_stack(self, *args, **kwargs):
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        context = contextvars.copy_context()
        box = {}

        def run():
            try:
                with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                    box["result"] = context.run(launch, self, *args, **kwargs)
            except BaseException as e:  # raised in the caller
                box["error"] = e

        worker = threading.Thread(target=run, name="triton-interpreter-launch")
        worker.start()
        worker.join()
        if "error" in box:
            raise box["error"]
        return box.get("result")

    def device_function_call(self, *args, **kwargs):
        mine, running = langs(self.fn), stack()
        if not running or not mine or not mine <= running[-1]:
            if running:  # triton's call patches them, and they stay patched for the rest of the launch
                running[-1] |= mine
            return device_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    on_a_fresh_stack._tests_wrapped = True
    interp.GridExecutor.__call__ = on_a_fresh_stack
    interp.InterpretedFunction.__call__ = device_function_call
    np_dtype = getattr(interp, "_get_np_dtype", None)
    if "np_types = {" in _source(np_dtype):
        interp._get_np_dtype = _remembered(np_dtype, interp.tl.block_type)
    builder = getattr(interp, "InterpreterBuilder", None)
    if "return tl.block_type(dtype, shape)" in _source(getattr(builder, "get_block_ty", None)):
        block_types = {}

        def get_block_ty(self, dtype, shape):
            try:
                key = (dtype, tuple(shape))
                return block_types[key]
            except KeyError:
                made = block_types[key] = interp.tl.block_type(dtype, shape)
                return made
            except TypeError:
                return interp.tl.block_type(dtype, shape)
        builder.get_block_ty = get_block_ty
    return True


def _source(fn) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def _remembered(np_dtype, block_type):
    """triton's ``_get_np_dtype`` (a Triton dtype's NumPy dtype; a block's, its elements'), which builds its table
    of the NumPy dtypes on every call, asked once per element dtype."""
    seen = {}

    def get(tt_dtype):
        key = tt_dtype.element_ty if isinstance(tt_dtype, block_type) else tt_dtype
        try:
            return seen[key]
        except KeyError:
            found = seen[key] = np_dtype(key)
            return found
        except TypeError:  # an unhashable dtype: asked every time
            return np_dtype(tt_dtype)
    return get
