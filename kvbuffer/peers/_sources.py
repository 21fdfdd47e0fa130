"""Finding and loading a peer's kernel files without installing the peer: the machinery the vLLM, SGLang
and ReplaySSM adapters share (each keeps what is its own: where its files live, which it needs, its
messages and the contents of its shims).

* ``extract``: chosen members of a wheel unpacked once into a temporary folder (cached per wheel and
  members; the temporary folders are removed when the process exits);
* ``find``: the search order ``--peer-path`` given to the call, else ``$KVBUFFER_PEER_PATH``, else the
  installed package (found, not imported);
* ``version_in``, ``dist_version``, ``git_version``: version strings read from a tree;
* ``write_shims``, ``shims_first``: a temporary folder of shim modules, and the import of the kernel files
  with it first on ``sys.path`` and the process's own modules of that package set aside meanwhile;
* ``interpreter_fixes``: what fla's kernel files need under the Triton interpreter;
  ``interpretable_chunk_kernels``: what its chunk kernels (and the engines' copies) need there besides
  (block pointers among them: ``_block_ptr``);
* ``on_gpu``, ``dtypes``: the dtypes a peer's lanes declare (bfloat16 only where the kernels run compiled).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import re
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import torch

from ..validate.adapters import AdapterError, interpreter_active

__all__ = ["PEER_ENV", "extract", "find", "version_in", "dist_version", "git_version", "write_shims",
           "shims_first", "interpreter_fixes", "interpretable_chunk_kernels", "on_gpu", "dtypes"]

#: The environment variable ``--peer-path`` sets: where the user keeps a peer's kernel files.
PEER_ENV = "KVBUFFER_PEER_PATH"


# ----------------------------------------------------------------------------- finding the kernel files
_EXTRACTED: dict = {}


def _temporary_folder(prefix: str) -> Path:
    """A new temporary folder named ``prefix...``, removed when the process that made it exits."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    pid = os.getpid()

    def remove():
        if os.getpid() == pid:
            shutil.rmtree(root, ignore_errors=True)

    atexit.register(remove)
    return root


def extract(whl: Path, patterns: Iterable[str], prefix: str) -> Path:
    """The members of wheel ``whl`` whose names fully match one of the regular expressions ``patterns``,
    extracted into a temporary folder named ``prefix...``; returns that folder (the root of the wheel's
    tree).  Extracted once per wheel and patterns in a process.  AdapterError when ``whl`` is not a
    readable wheel."""
    patterns = tuple(patterns)
    key = (str(whl.resolve()), patterns)
    if key not in _EXTRACTED:
        root = _temporary_folder(prefix)
        try:
            with zipfile.ZipFile(whl) as z:
                for n in z.namelist():
                    if any(re.fullmatch(p, n) for p in patterns):
                        z.extract(n, root)
        except (OSError, zipfile.BadZipFile) as e:
            raise AdapterError(f"--peer-path {whl}: not a readable wheel ({e})") from None
        _EXTRACTED[key] = root
    return _EXTRACTED[key]


def find(path, tree: Callable[[Path], Optional[tuple]], package: str,
         in_package: Callable[[Path], Optional[tuple]], *, not_at: Callable[[str], str],
         not_in_env: Callable[[str], str], not_in_package: Callable[[Path], str],
         not_found: Callable[[str], str]) -> tuple:
    """(kernel folder, version, where from) of a peer's kernel files: at ``path`` when it is given (that place
    only), else at ``$KVBUFFER_PEER_PATH``, else in the installed ``package`` (found with
    ``importlib.util.find_spec``, not imported).

    ``tree(place)`` and ``in_package(package folder)``: (kernel folder, version) of the files there, None
    where they are not all there.  The AdapterError messages: ``not_at(path)`` when ``path`` holds none;
    otherwise ``not_found(looked)``, ``looked`` joining with "; " ``not_in_env(value of the variable)``
    (where it is set), ``not_in_package(package folder)`` or "no <package> package is installed"."""
    if path is not None:
        found = tree(Path(path))
        if found:
            return found[0], found[1], str(path)
        raise AdapterError(not_at(path))
    looked = []
    given = os.environ.get(PEER_ENV)
    if given:
        found = tree(Path(given))
        if found:
            return found[0], found[1], f"--peer-path {given}"
        looked.append(not_in_env(given))
    spec = importlib.util.find_spec(package)  # a top-level package: found, not imported
    if spec is not None and spec.submodule_search_locations:
        pkg = Path(list(spec.submodule_search_locations)[0])
        found = in_package(pkg)
        if found:
            return found[0], found[1], f"installed {package} ({pkg})"
        looked.append(not_in_package(pkg))
    else:
        looked.append(f"no {package} package is installed")
    raise AdapterError(not_found("; ".join(looked)))


# ----------------------------------------------------------------------------- version strings
def version_in(text: str, name: str = "__version__", alias: str = "version", form: str = r"[^'\"]+",
               prefix: str = "") -> Optional[str]:
    """The string first assigned to ``name`` in Python source ``text`` (``name = '...'``, ``name: str =
    '...'``, ``name = alias = '...'``), the part after ``prefix`` matching ``form`` (both regular
    expressions); None where there is no such assignment."""
    m = re.search(rf"""{name}\s*(?::\s*str\s*)?=\s*(?:{alias}\s*=\s*)?['"]{prefix}({form})['"]""", text)
    return m.group(1) if m else None


def dist_version(folder: Path, dist: str) -> Optional[str]:
    """The ``Version:`` of the first ``<dist>-*.dist-info/METADATA`` in ``folder`` that has one, else None."""
    for meta in sorted(folder.glob(f"{dist}-*.dist-info/METADATA")):
        m = re.search(r"^Version: (\S+)", meta.read_text(errors="replace"), re.M)
        if m:
            return m.group(1)
    return None


def git_version(root: Path) -> Optional[str]:
    """'git <12 hex digits>' of checkout ``root``'s HEAD (the ref's commit where HEAD names a ref that is a
    file), else None."""
    head = root / ".git" / "HEAD"
    if not head.is_file():
        return None
    ref = head.read_text().strip()
    if ref.startswith("ref: "):
        p = root / ".git" / ref[5:]
        ref = p.read_text().strip() if p.is_file() else ref
    return f"git {ref[:12]}"


# ----------------------------------------------------------------------------- loading them
def write_shims(prefix: str, files: dict) -> Path:
    """A new temporary folder named ``prefix...`` holding ``files`` ({relative path: text}, folders made as
    needed), removed when the process exits; returns it."""
    root = _temporary_folder(prefix)
    for p, text in files.items():
        (root / p).parent.mkdir(parents=True, exist_ok=True)
        (root / p).write_text(text)
    return root


def _modules_of(package: str) -> list:
    """The names of the loaded modules of top-level package ``package``."""
    return [n for n in sys.modules if n == package or n.startswith(package + ".")]


@contextlib.contextmanager
def shims_first(shims: Path, package: str) -> Iterator[None]:
    """A context in which folder ``shims`` is first on ``sys.path`` and no module of ``package`` (the
    top-level name the shims provide) is loaded: the process's own ones are set aside on entry, and on exit
    the shims' path and every ``package`` module loaded meanwhile are removed and the process's own put
    back."""
    saved = {n: sys.modules[n] for n in _modules_of(package)}
    for n in saved:
        del sys.modules[n]
    sys.path.insert(0, str(shims))
    try:
        yield
    finally:
        sys.path.remove(str(shims))
        for n in _modules_of(package):
            del sys.modules[n]
        sys.modules.update(saved)


def interpreter_fixes(modules: dict) -> None:
    """Under the Triton interpreter, in ``modules`` ({name: module} of fla kernel files): module-level
    aliases of Triton builtins -> jitted functions of the same builtin; where ``modules`` has ``fla.utils``
    and torch has no device context for the tensors' device (CPU), input_guard's device context -> a null
    context."""
    import triton.language as tl

    from . import _sglang_interp as ji  # here: it imports triton, after the interpreter is chosen

    alias = {id(tl.exp): ji.exp, id(tl.math.exp2): ji.exp2, id(tl.log): ji.log, id(tl.log2): ji.log2}
    for m in modules.values():
        for n, val in list(vars(m).items()):
            if id(val) in alias:
                setattr(m, n, alias[id(val)])
    utils = modules.get("fla.utils")
    if utils is not None and not hasattr(getattr(utils, "device_torch_lib", None), "device"):
        utils.custom_device_ctx = lambda index: contextlib.nullcontext()


def _tensor_range(*args):
    """``range`` whose indices are interpreter tensors (int32), as a compiled kernel's loop indices are: fla's
    chunk kernels (and their copies in vLLM and SGLang) call ``.to()`` on them."""
    import triton.language as tl

    for i in range(*args):
        yield tl.full([], i, tl.int32)


def interpretable_chunk_kernels(modules: dict) -> None:
    """Under the Triton interpreter, make the chunk kernels of ``modules`` ({name: module} of fla kernel files,
    or a peer's copy of them) run: every autotuner keeps the first of its configs (one config runs without the
    benchmark that needs a GPU driver; under the interpreter a config changes tiling only, not the arithmetic),
    and every kernel outside the fused recurrent files runs with loop indices that are tensors
    (``_tensor_range``) and, where it names ``triton.language`` ``tl``, with block pointers
    (``_block_ptr.language``: ``tl.make_block_ptr``, ``tl.advance`` and ``tl.load`` / ``tl.store`` with
    ``boundary_check``, which triton 3.9 removed; SGLang's fla copy uses them), both in a copy of its
    module's globals: the host code keeps Python's ``range`` and the module.  Idempotent."""
    import types

    import triton.language as tl
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.interpreter import InterpretedFunction

    from . import _block_ptr

    for name, mod in modules.items():
        if mod is None:
            continue
        for obj in list(vars(mod).values()):
            depth = 0
            while obj is not None and not isinstance(obj, InterpretedFunction) and depth < 8:
                if isinstance(obj, Autotuner) and len(obj.configs) > 1:
                    obj.configs = obj.configs[:1]
                obj, depth = getattr(obj, "fn", None), depth + 1
            if not isinstance(obj, InterpretedFunction) or "fused_recurrent" in name:
                continue
            fn = obj.fn
            if fn.__globals__.get("range") is _tensor_range:
                continue
            scope = {**fn.__globals__, "range": _tensor_range}
            if scope.get("tl") is tl:  # the module stays visible (the interpreter patches what it finds)
                scope.update(tl=_block_ptr.language, _triton_language=tl)
            clone = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
            clone.__kwdefaults__, clone.__qualname__ = fn.__kwdefaults__, fn.__qualname__
            obj.fn = obj.rewriter.fn = clone


# ----------------------------------------------------------------------------- the lanes' declarations
def on_gpu() -> bool:
    """Whether the kernels run compiled on a GPU (CUDA available and the Triton interpreter not chosen)."""
    return torch.cuda.is_available() and not interpreter_active()


def dtypes(*base: torch.dtype) -> tuple:
    """``base`` and, where the kernels run compiled on a GPU, bfloat16 (the interpreter mishandles it)."""
    return tuple(base) + ((torch.bfloat16,) if on_gpu() else ())
