"""Class-level swaps for construction: ``use`` and ``replace_decoder``.

Inside the block the family's original class name shows the replacement, so
``Model(config)`` and ``from_pretrained`` build replacement layers directly; checks that
must see the real original ask the engine for it (:func:`layerswap.family.resolve`).

Example::

    with layerswap.use("llama.decoder.fused"):
        model = LlamaForCausalLM.from_pretrained(path)
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from layerswap.backend import original_of
from layerswap.patching import PatchGroup, Scoped, active_patches
from layerswap.registry import families, get, get_family
from layerswap.substitution import Substitution
from layerswap.weights import Converter

__all__ = ["SubstitutionUse", "applied", "replace_decoder", "use"]


class SubstitutionUse(PatchGroup):
    """The patches :func:`use` starts for one substitution; ``repr`` says which."""

    def __init__(self, substitution: Substitution, members: Iterable[Scoped]) -> None:
        super().__init__(members)
        self.substitution = substitution

    def _label(self) -> str:
        return f"use({self.substitution.name!r})"

    def _copy(self) -> SubstitutionUse:
        return SubstitutionUse(self.substitution, (m._copy() for m in self.members))


def applied() -> tuple[Substitution, ...]:
    """The substitutions whose :func:`use` (or :func:`replace_decoder`) is live here, oldest first.

    Example::

        with layerswap.use("llama.decoder.fused"):
            [s.name for s in applied()]   # ["llama.decoder.fused"]
    """
    found: list[Substitution] = []
    for info in active_patches():
        if isinstance(info.patch, SubstitutionUse) and info.patch.substitution not in found:
            found.append(info.patch.substitution)
    return tuple(found)


def use(substitution: str | Substitution) -> SubstitutionUse:
    """Construct models with the replacement layer: a scoped, class-level swap.

    Inside the block the family's original decoder class name is patched to the
    replacement, so ``Model(config)`` and ``from_pretrained`` build replacement
    layers directly (no second copy of the weights). ``from_pretrained`` converts an
    original-layout checkpoint while loading; ``save_pretrained`` of such a model
    writes the original layout again, at any later time. Hidden-state capture
    (``output_hidden_states``) and ``device_map`` splitting keep working.

    Example::

        with layerswap.use("llama.decoder.fused"):
            model = LlamaForCausalLM.from_pretrained(path)
        model.save_pretrained(out)      # loadable by plain transformers
    """
    sub = get(substitution)
    return SubstitutionUse(sub, sub.parts.slot.construction(sub))


def _infer_family(decoder_cls: type) -> str:
    known = families()
    for klass in decoder_cls.__mro__:
        for family in known.values():
            if klass.__name__ == family.decoder:
                return family.name
    lowered = decoder_cls.__name__.lower()
    # longest first: "qwen3" before "qwen2" never matters, "ministral" before "mistral" does
    for name in sorted(known, key=len, reverse=True):
        if re.sub(r"[^0-9a-z]", "", name) in lowered:
            return name
    return "llama"


def replace_decoder(
    decoder_cls: type[torch.nn.Module], family: str | None = None
) -> SubstitutionUse:
    """Build every decoder layer of ``family`` as ``decoder_cls`` inside the block.

    ``decoder_cls(config, layer_idx)`` must follow the transformers decoder-layer
    contract. The family is inferred from the class's bases or name when not
    given (default ``"llama"``). Weights are not converted: checkpoint keys must
    match the class's own parameter names.

    Example::

        with layerswap.replace_decoder(TELlamaDecoderLayer):
            model = LlamaForCausalLM(config)   # layers are TELlamaDecoderLayer
        # LlamaDecoderLayer is back here, also if the block raised
    """
    spec = get_family(family if family is not None else _infer_family(decoder_cls))
    sub = Substitution(
        name=f"{spec.name}.decoder.{decoder_cls.__qualname__}",
        family=spec.name,
        backend="custom",
        original=original_of(spec, "decoder"),
        replacement=decoder_cls,
        converter=Converter(),
        upstream=None,
        description=f"{decoder_cls.__module__}.{decoder_cls.__qualname__} via replace_decoder",
    )
    return use(sub)
