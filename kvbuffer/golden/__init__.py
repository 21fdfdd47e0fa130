"""Golden vectors: frozen float64 cases any implementation (in any language) can be checked against.

Three jobs, one module each:

* ``files``: where the vectors live and how they are read and written (``load_cases``, ``read_npz``,
  ``write_npz``; the format is docs/golden.md);
* ``truth``: the expected outputs, every one of them computed by the plain recurrent oracle over the
  case's token history, never by the buffered forms (``truth``, ``derive_buffer``);
* ``check``: running a case through an implementation and judging it (``check``, ``check_case``).

Inputs are float64 (tokens ``q, k, v, g, beta``; for buffered operations a ``buffer_*`` state given in
BOTH forms, u-cache and raw).  The generator (scripts/make_golden.py) also asserts that the buffered
reference agrees with the truth before it writes a case.
"""

from .check import CaseReport, check, check_case, run_case, stored_mismatch
from .files import (BUFFER_OPS, ENV_VAR, FORMAT, OPS, PACKAGE_DIR, VERSION, GoldenCase, default_dir, load_cases,
                    load_index, read_npz, write_npz)
from .truth import derive_buffer, truth

__all__ = ["FORMAT", "VERSION", "OPS", "BUFFER_OPS", "ENV_VAR", "PACKAGE_DIR", "GoldenCase", "CaseReport", "default_dir",
           "load_index", "load_cases", "read_npz", "write_npz", "truth", "derive_buffer", "run_case", "check_case",
           "check", "stored_mismatch"]
