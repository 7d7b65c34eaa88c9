"""A patch function as a substitution of the ``patch`` slot, to register like any other.

:func:`patch_substitution` names the function by its import path (so that the registry,
the command line, a pytest session and other processes find it) and keeps the keyword
arguments it is called with as its variant's options, which
:meth:`~layerswap.Substitution.with_options` changes. The slot (:mod:`layerswap.slots.patch`)
adopts it (:func:`layerswap.adopt`) wherever the substitution is used.

Example::

    sub = layerswap.register(
        patch_substitution("my_patches:apply_fast_norm", "llama", name="llama.patch.mine")
    )
    with layerswap.use("llama.patch.mine"):
        model = LlamaForCausalLM(config)
"""

from __future__ import annotations

import contextlib
import re
import types
from collections.abc import Callable
from typing import Any

from layerswap.errors import SubstitutionError
from layerswap.family import resolve
from layerswap.registry import get_family
from layerswap.slots import get_slot
from layerswap.substitution import Substitution, Variant
from layerswap.weights import Converter

__all__ = ["patch_substitution"]


def _as_adopted(**arguments: Any) -> contextlib.AbstractContextManager[None]:
    # the patch is in effect wherever the substitution is: its forward needs no context
    return contextlib.nullcontext()


def _target(function: Callable[..., Any] | str) -> tuple[str, str]:
    """``("package.module:function", "function")``, checked to import back to ``function``."""
    if isinstance(function, str):
        module, _, qualname = function.partition(":")
        if not module or not qualname:
            raise SubstitutionError(
                f"a patch function is named 'package.module:function', not {function!r}"
            )
        return function, qualname.rpartition(".")[2]
    owner = getattr(function, "__module__", None)
    name = getattr(function, "__qualname__", None)
    target = f"{owner}:{name}"
    try:
        found = resolve(target) if owner and name else None
    except (ImportError, AttributeError):
        found = None
    if found is not function:
        raise SubstitutionError(
            f"{function!r} cannot be found again by its name ({target}): a registered patch "
            "is imported by name where it is used, so define the function at a module's top "
            "level, or pass its 'package.module:function'"
        )
    return target, str(name).rpartition(".")[2]


def patch_substitution(
    function: Callable[..., Any] | str,
    family: str,
    name: str | None = None,
    *,
    description: str = "",
    **arguments: Any,
) -> Substitution:
    """The substitution of the ``patch`` slot that adopts ``function(**arguments)`` on
    ``family``'s models.

    ``function`` is the patch function or its ``"package.module:function"``; ``name``
    defaults to ``"<family>.patch.<function>"``, and its last part is the substitution's
    backend. ``arguments`` are kept as data (the variant's options:
    ``sub.with_options(rope=False)`` changes one). Register it with
    :func:`layerswap.register`; ``use``, ``swap``, ``verify``, ``layerswap verify
    --substitution``, ``layerswap check --substitution`` and the pytest plugin take it by
    name.

    Example::

        sub = patch_substitution(apply_liger_kernel_to_llama, "llama", rope=True)
        sub.name                          # "llama.patch.apply_liger_kernel_to_llama"
        layerswap.register(sub)
    """
    target, function_name = _target(function)
    declared = get_family(family)
    name = name if name is not None else f"{declared.name}.patch.{function_name}"
    if not re.fullmatch(r"[\w.\-]+", name):
        raise SubstitutionError(
            f"substitution name {name!r} must be letters, digits, '_', '-' and '.'"
        )
    options = Variant(
        name="arguments",
        context=_as_adopted,
        options=types.MappingProxyType(dict(arguments)),
        slots=("patch",),
        description="the keyword arguments the patch function is called with",
    )
    return Substitution(
        name=name,
        family=declared.name,
        backend=name.rpartition(".")[2],
        original=get_slot("patch").original(declared),
        replacement=target,
        converter=Converter(),
        upstream=None,
        description=description or f"{target}, adopted (layerswap.adopt)",
        slot="patch",
        variant=options,
    )
