"""kvbuffer: the tool built on the oracle (``kvbuffer_ref``) and the kernels (``kvbuffer_fast``).

* ``kvbuffer.validate``: the validator (cases, the error policy, properties, lanes, the runner, reports);
* ``kvbuffer.implementations``: the implementations it knows by name and ``resolve`` for any other;
* ``kvbuffer.peers``: other projects' kernels behind the adapter protocol (fla, SGLang, ReplaySSM, engine
  calling conventions);
* ``kvbuffer.golden``: the frozen float64 vectors, read and checked;
* ``kvbuffer.integrations``: Hugging Face transformers models served through the pool;
* ``kvbuffer.cli``: the ``kvbuffer`` command; ``kvbuffer.pytest_plugin``: its pytest plugin.

Imports run one way: ``kvbuffer`` imports ``kvbuffer_ref`` and ``kvbuffer_fast``; neither imports it
(``python3 scripts/import_graph.py`` checks it).
"""

from .implementations import builtin_names, default_implementations, resolve
from .validate import Case, run_validation

__all__ = ["Case", "run_validation", "resolve", "builtin_names", "default_implementations"]
