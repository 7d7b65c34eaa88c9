"""Exception and warning types raised by layerswap.

Every error derives from :class:`LayerswapError` *and*, where one fits, from the
builtin a caller would already catch (``AttributeError`` for a missing attribute,
``ImportError`` for a module that cannot be imported, ``TypeError`` for a value of
the wrong kind), so ``except AttributeError`` keeps working around layerswap.
"""

from __future__ import annotations

__all__ = [
    "AdoptionError",
    "CheckpointError",
    "ConversionError",
    "LayerswapError",
    "LazyPatchWarning",
    "NoChangeError",
    "ParallelismError",
    "PatchConflictWarning",
    "PatchDivergenceError",
    "PatchError",
    "PatchStateError",
    "PatchTargetError",
    "RequirementError",
    "SubstitutionError",
    "SwapWarning",
    "TargetAttributeError",
    "TargetImportError",
    "TargetReadOnlyError",
    "TargetTypeError",
    "UnknownBackendError",
    "UnknownSubstitutionError",
    "UnrecordableChangeError",
    "UnsupportedFamilyError",
    "UnsupportedModelError",
    "UpstreamDriftError",
    "VerificationError",
]


class LayerswapError(Exception):
    """Base class of every error raised by layerswap."""


# --- patching ---------------------------------------------------------------


class PatchError(LayerswapError):
    """A patch could not be started or stopped."""


class PatchTargetError(PatchError):
    """A patch target could not be resolved (import, attribute or type problem)."""


class TargetImportError(PatchTargetError, ImportError):
    """The module part of a target string cannot be imported."""


class TargetAttributeError(PatchTargetError, AttributeError):
    """The attribute part of a target does not exist (and ``create=True`` was not given)."""


class TargetTypeError(PatchTargetError, TypeError):
    """The target (or the replacement) is of a kind that cannot be patched."""


class TargetReadOnlyError(PatchTargetError, AttributeError):
    """The attribute exists but refuses the write (a read-only property, a frozen
    dataclass field, an object without ``__dict__``): Python raises AttributeError here too."""


class PatchStateError(PatchError, RuntimeError):
    """A start/stop call does not fit the patch's state (e.g. ``start()`` twice)."""


class PatchConflictWarning(UserWarning):
    """Something outside layerswap rebound an attribute while a patch of it was live."""


class LazyPatchWarning(UserWarning):
    """A ``lazy=True`` patch could not be applied when its module was imported."""


# --- substitutions ------------------------------------------------------------


class SubstitutionError(LayerswapError):
    """A substitution cannot be found, applied or undone."""


class UnknownSubstitutionError(SubstitutionError, LookupError):
    """No substitution (or family, or backend) by that name is registered."""

    def __str__(self) -> str:  # LookupError would repr() a lone argument
        return str(self.args[0]) if self.args else ""


class UnknownBackendError(UnknownSubstitutionError):
    """No backend is registered under that name (the message names close ones)."""


class RequirementError(SubstitutionError, RuntimeError):
    """A substitution cannot run here (a package, a device or a feature is missing)."""


class UnsupportedFamilyError(SubstitutionError, ValueError):
    """A model family's decoder layer has structure the replacement layers cannot express
    (the message names it): it gets no declaration rather than a wrong one."""


class UpstreamDriftError(SubstitutionError, RuntimeError):
    """The installed transformers no longer has the layer structure a converter assumes."""


class ConversionError(SubstitutionError, ValueError):
    """Weights could not be converted between the original and the replacement layout."""


class ParallelismError(SubstitutionError, RuntimeError):
    """A swapped model cannot be sharded the way transformers was asked to (with the reason)."""


class CheckpointError(LayerswapError, ValueError):
    """A checkpoint cannot be loaded whole: a file is unreadable, or a tensor is missing,
    of another shape than the config gives, or has no place in the model (the message
    names the tensors and the file)."""


class SwapWarning(UserWarning):
    """A swap succeeded but needs the user's attention (e.g. a compiled model must recompile)."""


# --- verification ---------------------------------------------------------------


class VerificationError(LayerswapError, AssertionError):
    """A swapped model does not compute what the original computes within tolerance."""


class UnsupportedModelError(LayerswapError, TypeError):
    """Verification or benchmarking cannot run this model: its class, its config or
    what it returns does not allow the requested check (the message says which)."""


# --- adopting other libraries' patch functions ------------------------------------------


class AdoptionError(LayerswapError):
    """A patch function (``layerswap.adopt``) could not be adopted; its changes were taken
    back."""


class NoChangeError(AdoptionError):
    """A patch function changed nothing layerswap records (the message names it): a patch
    that quietly did nothing (an argument that turned it off, a name it no longer finds
    upstream) is refused, not reported adopted and proven."""


class UnrecordableChangeError(AdoptionError, RuntimeError):
    """A patch function changed something layerswap cannot record and take back (the
    message names it); everything else it changed was taken back."""


class PatchDivergenceError(AdoptionError, VerificationError):
    """An adopted patch function changes what the model computes beyond tolerance.

    A verification failure (``except VerificationError`` catches it, as it catches
    ``verify``'s), raised at adoption after the patch was taken back; ``layer`` is the first
    decoder layer whose output differs (``None`` where every layer's output agrees and only
    the head, decoding or the gradients differ), ``check`` the first check that does.
    """

    def __init__(self, message: str, *, layer: str | None = None, check: str | None = None):
        super().__init__(message)
        self.layer = layer
        self.check = check
