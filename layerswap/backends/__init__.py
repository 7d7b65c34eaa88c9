"""The builtin backends: each declared in :mod:`layerswap.backends.declarations` (data,
read without importing torch or transformers), its layers in a module here.

A backend's declaration (a :class:`~layerswap.backend.Backend` named ``BACKEND``) names
its implementation per slot, converter, requirement, the families it supports and its
variants; the registry imports the declarations by name when first used and registers
each ``BACKEND`` it finds, exactly as it loads a third-party backend from the
``layerswap.backends`` entry-point group. The layer modules (``fused``, ``liger``, ``te``,
``head_fused``, ``head_liger``) are imported when a substitution is made; importing one
does not need its optional dependencies (those are its ``requirement``).

Every builtin backend's decoder layer derives from ``_layer.DecoderLayer``, which holds the
transformers decoder-layer contract (forward signature, residual structure, cache update,
``extra_repr``); a backend supplies only its attention and feed-forward. Its head derives
from ``head.CausalLMHead``.
"""

from __future__ import annotations

from layerswap.backends.declarations import builtin_modules

__all__ = ["builtin_modules"]
