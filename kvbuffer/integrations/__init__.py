"""Integrations of the serving pool with model libraries.

``kvbuffer.integrations.transformers`` (extra ``hf``): Qwen3-Next, Qwen3.5 and Kimi Linear from HF
transformers with their linear-attention recurrence served by a ``KVPool`` (docs/models.md).  Importing
this package imports no model library; the submodule imports transformers when it is imported.
"""

__all__ = ["transformers"]
