"""Resolving patch targets: ``"pkg.mod:Qual.name"``, ``"pkg.mod.Qual.name"`` or ``(obj, "attr")``.

Resolution happens when a patch starts, not when it is created, so a patch can be
declared at import time for a module that is imported later. Failures raise the
specific error types from :mod:`layerswap.errors`, say which part of the target
failed, and suggest the closest existing names.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from layerswap.errors import TargetAttributeError, TargetImportError, TargetTypeError
from layerswap.suggestions import did_you_mean

__all__ = ["ParsedTarget", "import_module", "suggest"]


def suggest(name: str, candidates: Any) -> str:
    """Return ``" (did you mean `X`?)"`` for the closest candidates, or ``""``.

    ``name`` itself is never suggested, and each candidate is named once.
    """
    try:
        hint = did_you_mean(name, candidates, quote="`", cutoff=0.6)
    except TypeError:  # candidates that cannot be listed
        return ""
    return f" ({hint})" if hint else ""


def loaded_module(name: str) -> Any:
    """``sys.modules[name]`` once its import has finished, else None.

    A module another thread is still importing is already in ``sys.modules``, half
    built. ``importlib.import_module`` waits for that import to finish (it takes the
    module's import lock), so a half-built module goes through it; a finished one is
    returned at the cost of a dictionary lookup.
    """
    module = sys.modules.get(name)
    if module is None:
        return None
    spec = getattr(module, "__spec__", None)
    if spec is not None and getattr(spec, "_initializing", False):
        return importlib.import_module(name)
    return module


def import_module(name: str, *, target: str) -> Any:
    """Import ``name``; on failure raise TargetImportError naming the missing part."""
    module = loaded_module(name)
    if module is not None:
        return module
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing = exc.name or name
        parent, _, leaf = missing.rpartition(".")
        hint = ""
        try:
            if parent:
                pkg = importlib.import_module(parent)
                hint = suggest(leaf, _submodule_names(pkg) + list(vars(pkg)))
            else:
                import pkgutil

                hint = suggest(leaf, [info.name for info in pkgutil.iter_modules()])
        except Exception:  # the parent itself is broken: no suggestion
            hint = ""
        raise TargetImportError(
            f"cannot patch {target!r}: module {missing!r} cannot be imported{hint}",
            name=missing,
        ) from exc
    except ImportError as exc:  # the module exists but its own imports fail
        raise TargetImportError(
            f"cannot patch {target!r}: importing {name!r} failed: {exc}", name=name
        ) from exc


def _submodule_names(pkg: Any) -> list[str]:
    import pkgutil

    paths = getattr(pkg, "__path__", None)
    if paths is None:
        return []
    try:
        return [info.name for info in pkgutil.iter_modules(paths)]
    except Exception:
        return []


class ParsedTarget:
    """A target string split into its module and its attribute path.

    ``module`` is None for the dotted form until resolution finds the longest
    importable prefix.
    """

    __slots__ = ("attribute", "module", "owner_path", "text")

    def __init__(self, text: str) -> None:
        if not isinstance(text, str) or not text.strip():
            raise TargetTypeError(f"a patch target must be a non-empty string, got {text!r}")
        text = text.strip()
        self.text = text
        if ":" in text:
            module, _, qualname = text.partition(":")
            parts = qualname.split(".")
            if not module or not qualname or not all(parts) or ":" in qualname:
                raise TargetTypeError(
                    f"malformed target {text!r}: expected 'package.module:Name' or "
                    "'package.module:Class.attribute'"
                )
            self.module: str | None = module
            self.owner_path: tuple[str, ...] = tuple(parts[:-1])
            self.attribute: str = parts[-1]
        else:
            parts = text.split(".")
            if len(parts) < 2 or not all(parts):
                raise TargetTypeError(
                    f"malformed target {text!r}: expected 'package.module.Name' or "
                    "'package.module:Name' (the attribute must be named)"
                )
            self.module = None
            self.owner_path = tuple(parts[:-1])
            self.attribute = parts[-1]

    def module_name_for_lazy(self) -> str:
        """The module whose import a lazy patch waits for (colon form only)."""
        if self.module is None:
            raise TargetTypeError(
                f"lazy=True needs the colon form for {self.text!r} "
                "('package.module:Name'), so that the module is known without importing it"
            )
        return self.module

    def resolve(self) -> tuple[Any, str]:
        """Import what is needed and return ``(owner, attribute_name)``."""
        if self.module is not None:
            owner = import_module(self.module, target=self.text)
            walked = self.module
            path = self.owner_path
        else:
            owner, walked, path = self._longest_module_prefix()
        for part in path:
            try:
                owner = getattr(owner, part)
            except AttributeError:
                raise TargetAttributeError(
                    f"cannot patch {self.text!r}: {walked!r} has no attribute {part!r}"
                    f"{suggest(part, dir(owner))}",
                    name=part,
                    obj=owner,
                ) from None
            walked = f"{walked}.{part}"
        return owner, self.attribute

    def _longest_module_prefix(self) -> tuple[Any, str, tuple[str, ...]]:
        parts = (*self.owner_path,)
        # Longest importable prefix: "a.b.C.meth" -> try a.b.C, then a.b, then a.
        first_error: ImportError | None = None
        for cut in range(len(parts), 0, -1):
            name = ".".join(parts[:cut])
            module = loaded_module(name)
            if module is None:
                try:
                    module = importlib.import_module(name)
                except ModuleNotFoundError as exc:
                    # Only "this very name (or a package above it) is not a module"
                    # means: try a shorter prefix. A module that exists but imports a
                    # missing dependency is an error to report as it is.
                    missing = exc.name
                    if (
                        missing is not None
                        and missing != name
                        and not name.startswith(missing + ".")
                    ):
                        raise TargetImportError(
                            f"cannot patch {self.text!r}: importing {name!r} failed: {exc}",
                            name=missing,
                        ) from exc
                    first_error = first_error or exc
                    continue
                except ImportError as exc:
                    raise TargetImportError(
                        f"cannot patch {self.text!r}: importing {name!r} failed: {exc}",
                        name=name,
                    ) from exc
            return module, name, parts[cut:]
        try:
            import_module(parts[0], target=self.text)
        except TargetImportError:
            raise
        raise TargetImportError(  # pragma: no cover - import_module raised above
            f"cannot patch {self.text!r}: no importable module prefix", name=parts[0]
        ) from first_error

    def __repr__(self) -> str:
        return f"ParsedTarget({self.text!r})"
