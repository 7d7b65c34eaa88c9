"""The ``head`` slot as a declaration names it: the causal-LM subclass, by name, and why
a family's causal LM cannot take it (read from transformers' source, kept per release)."""

from __future__ import annotations

from layerswap import verdicts
from layerswap.backend import Implementation, Lazy
from layerswap.family import Family
from layerswap.substitution import UpstreamCheck

__all__ = ["head_refusal", "head_slot"]


def head_slot(
    module: str, prefix: str, *, description: str, upstream: UpstreamCheck | None = None
) -> Implementation:
    """The ``head`` slot whose classes are ``<module>:<prefix><CausalLM>`` (made by that
    module's ``__getattr__`` on first use): no weights converted, verified with the fused
    loss in eval mode too, ``upstream`` the structure check (default: the head contract).
    """

    def replacement(family: Family) -> str:
        return f"{module}:{prefix}{family.causal_lm}"

    return Implementation(
        replacement=replacement,
        converter=Lazy("layerswap.backends.head:no_conversion"),
        description=description,
        supports=head_refusal,
        upstream=upstream if upstream is not None else Lazy("layerswap.backends.head:check_head"),
        context=Lazy("layerswap.backends.head:fused_loss_in_eval"),
    )


def head_refusal(family: Family) -> str | None:
    """Why the head substitution cannot take ``family``'s causal LM, ``None`` when it can.

    The reason :func:`~layerswap.backends.head.head_contract` gives for a forward it does
    not reproduce (the mixture-of-experts causal LMs add the router's load-balancing loss
    to the loss), so the registry does not offer a ``<family>.head.*`` substitution that
    would refuse. Read once per transformers release (:func:`~layerswap.verdicts.remembered`).
    """
    compute = Lazy("layerswap.backends.head:read_head_refusal")
    return verdicts.remembered(
        "head",
        f"{family.module}:{family.causal_lm}",
        lambda: compute(family),
        module=family.module,
    )
