"""What a proof found (:class:`Verdict`): passed, or the first check that differs and how,
on which versions, and the transformers source it vouches for.

:mod:`layerswap.proof_run` gives one; :mod:`layerswap.verdicts` keeps them on disk (as
:meth:`Verdict.to_dict`); :mod:`layerswap.proof` decides which one a swap needs.

Example::

    verdict = layerswap.proof.prove(layerswap.get("llama.decoder.fused"))
    verdict.passed, verdict.message()
"""

from __future__ import annotations

import dataclasses
from typing import Any

from layerswap import sources

__all__ = ["Verdict"]


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a proof found: ``passed``, else the first ``check`` that differs and how."""

    substitution: str
    passed: bool
    check: str | None
    detail: str
    seconds: float
    versions: dict[str, str]
    #: which config was proven: ``"shrunk"`` (the user's) or ``"family"`` (the family's tiny)
    config: str = "shrunk"
    #: the transformers module the original layer lives in, and a digest of the source it
    #: runs (:mod:`layerswap.sources`): the verdict vouches for that source only
    module: str = ""
    source: str = ""
    #: the attention implementation the proof ran (``"sdpa"``, ``"eager"``)
    attention: str | None = None
    #: the low-precision dtype the model computes in, proven besides float32
    #: (``"bfloat16"``, ``"float16"``), ``None`` for a float32 model
    dtype: str | None = None
    #: the dtype ``torch.autocast`` runs the model's passes in, proven besides float32
    #: (Trainer's ``bf16=True``), ``None`` where the model runs without autocast
    autocast: str | None = None

    def changed_since(self) -> bool:
        """Whether the transformers source this verdict proved has changed since (an install
        from git main, a locally edited release: the version string stays the same)."""
        return bool(self.module) and sources.digest(self.module) != self.source

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Verdict:
        fields = {field.name for field in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in fields})

    def config_message(self) -> str:
        """One line for a verdict that failed on a config although the family's tiny
        config passes: the config selects structure the family does not describe."""
        if self.check == "idle":
            return self.message()
        return (
            f"{self.substitution} does not compute what the original does for this model's "
            f"config: {self.check} differs ({self.detail}), while the family's own tiny "
            "config is proven equal on these versions. A field of this "
            "config selects structure the family does not describe (another norm, "
            "activation or attention variant): this model cannot take the substitution"
        )

    def message(self) -> str:
        """One line: what was proven, on which versions, and the first difference."""
        on = ", ".join(f"{name} {version}" for name, version in self.versions.items())
        if self.attention:
            on += f", attn_implementation={self.attention!r}"
        if self.dtype:
            on += f", in float32 and {self.dtype}"
        if self.autocast:
            on += f", and under autocast to {self.autocast}"
        if self.passed:
            return f"{self.substitution}: proven equal to the original on {on}"
        if self.check == "idle":
            return f"{self.substitution} would change nothing in this model: {self.detail}"
        return (
            f"{self.substitution} does not behave like the original on {on}: "
            f"{self.check} differs ({self.detail}). The layer contract changed in a way "
            "this layerswap does not follow; upgrade layerswap, or install a transformers "
            "release it supports (docs/compatibility.md). Where transformers' code was "
            "patched in this process (another library's or your own patch of its modeling "
            "code, not made through layerswap.adopt), the original runs that code: the "
            "proof compared the swap with it"
        )
