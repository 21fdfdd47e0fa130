"""Golden vectors on disk: the index, the case files, and how they are found.

The vectors are plain files shipped as package data: ``data/index.json`` beside this module plus one
``.npz`` per case under ``data/cases/`` (about 1.3 MB, numpy + JSON only; the wheel holds them).
``load_cases(path)`` reads them from any directory holding an ``index.json``; with no ``path`` it uses
the environment variable ``KVBUFFER_GOLDEN_DIR`` if set, else ``PACKAGE_DIR``, the installed copy.
The format is described field by field in docs/golden.md.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

__all__ = ["FORMAT", "VERSION", "ENV_VAR", "PACKAGE_DIR", "OPS", "BUFFER_OPS", "GoldenCase", "default_dir", "load_index",
           "load_cases", "read_npz", "write_npz"]

FORMAT = "kvbuffer-golden"
VERSION = 1
ENV_VAR = "KVBUFFER_GOLDEN_DIR"
#: The vectors this installation ships (package data of kvbuffer.golden).
PACKAGE_DIR = Path(__file__).resolve().parent / "data"

#: Every operation a case can exercise (the ``op`` field of the index).
OPS = ("recurrent", "chunk", "direct", "decode", "flush", "verify_chain", "verify_tree", "prefill")
#: Operations whose inputs include a buffer (given in both forms; checked in both).
BUFFER_OPS = ("decode", "flush", "verify_chain", "verify_tree")


def default_dir() -> Path:
    """``$KVBUFFER_GOLDEN_DIR`` if set, else ``PACKAGE_DIR`` (the vectors installed with the package)."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env)
    return PACKAGE_DIR


def _resolve(path) -> Path:
    d = default_dir() if path is None else Path(path)
    if d.is_file():
        d = d.parent
    if not (d / "index.json").is_file():
        shipped = (PACKAGE_DIR / "index.json").is_file()
        if shipped:
            how = f"the vectors installed with kvbuffer are in {PACKAGE_DIR} (the default when {ENV_VAR} is unset)"
        else:
            how = (f"this installation lacks its vectors ({PACKAGE_DIR}): pip install --force-reinstall kvbuffer, "
                   f"or point {ENV_VAR} or path= at a copy of kvbuffer/golden/data")
        where = f"{ENV_VAR}={d}" if path is None and os.environ.get(ENV_VAR) else str(d)
        raise FileNotFoundError(f"golden vectors: no index.json in {where}; {how}")
    return d


def load_index(path=None) -> dict:
    """The parsed ``index.json`` (format, version, conventions, and one entry per case)."""
    d = _resolve(path)
    index = json.loads((d / "index.json").read_text())
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise ValueError(f"golden vectors: {d / 'index.json'} is format {index.get('format')!r} version "
                         f"{index.get('version')!r}, this reader understands {FORMAT!r} version {VERSION}")
    return index


def read_npz(file) -> dict[str, np.ndarray]:
    """All arrays of one case file (no pickles)."""
    with np.load(file, allow_pickle=False) as z:
        return {name: z[name] for name in z.files}


def write_npz(file, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` as an uncompressed .npz, byte-for-byte reproducible.

    ``np.savez`` stamps the current time into every zip member; here members are sorted by name,
    dated 1980-01-01, stored (no compression, so the zlib version cannot matter) and little-endian.
    """
    with zipfile.ZipFile(file, "w", compression=zipfile.ZIP_STORED) as zf:
        for name in sorted(arrays):
            a = np.ascontiguousarray(arrays[name])
            a = a.astype(a.dtype.newbyteorder("<")) if a.dtype.byteorder == ">" else a
            buf = io.BytesIO()
            np.lib.format.write_array(buf, a, allow_pickle=False)
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_STORED
            info.create_system = 3
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


@dataclass(frozen=True)
class GoldenCase:
    """One case: its index entry and its arrays (inputs by plain name, expected outputs as ``expected_*``)."""

    id: str
    op: str
    description: str
    exercises: tuple[str, ...]
    params: dict
    file: Path
    arrays: dict = field(repr=False)

    @property
    def inputs(self) -> dict[str, np.ndarray]:
        return {n: a for n, a in self.arrays.items() if not n.startswith("expected_")}

    @property
    def expected(self) -> dict[str, np.ndarray]:
        return {n: a for n, a in self.arrays.items() if n.startswith("expected_")}


def load_cases(path=None, *, ops: Optional[Iterable[str]] = None, ids: Optional[Iterable[str]] = None
               ) -> list[GoldenCase]:
    """Load the cases of the index in ``path`` (default: see ``default_dir``), optionally only some ops / ids."""
    d = _resolve(path)
    index = load_index(d)
    ops = None if ops is None else set(ops)
    ids = None if ids is None else set(ids)
    if ops is not None and not ops <= set(OPS):
        raise ValueError(f"ops: unknown operation(s) {sorted(ops - set(OPS))}, expected some of {OPS}")
    cases = []
    for e in index["cases"]:
        if (ops is not None and e["op"] not in ops) or (ids is not None and e["id"] not in ids):
            continue
        f = d / e["file"]
        cases.append(GoldenCase(id=e["id"], op=e["op"], description=e["description"],
                                exercises=tuple(e["exercises"]), params=e["params"], file=f, arrays=read_npz(f)))
    if ids is not None and len(cases) != len(ids):
        raise ValueError(f"ids: not in the index: {sorted(ids - {c.id for c in cases})}")
    return cases
