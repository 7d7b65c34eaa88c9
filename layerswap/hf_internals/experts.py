"""The experts of a mixture-of-experts block as transformers 5 declares them.

``transformers.integrations.moe.use_experts_implementation`` decorates a model's experts
class (``Qwen3MoeExperts``: every expert's weights as one 3-D parameter): its ``forward``
dispatches on ``config._experts_implementation`` (``"grouped_mm"``, the default where the
kernel runs, ``"batched_mm"``, ``"eager"``, or a registered one), each instance holds the
flags below, and the class gets ``_apply_gate`` (``act(gate) * up`` of the packed gate/up
output) unless it defines its own. Every implementation but ``"eager"`` computes the
gated product through ``_apply_gate``; ``"eager"`` runs the class's own loop over experts.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = [
    "EAGER_EXPERTS",
    "EXPERTS_FLAGS",
    "experts_flags",
    "experts_implementation",
]

#: the flags ``use_experts_implementation`` sets on every instance of a decorated class
EXPERTS_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "has_post_expert_norm")
#: the implementation that runs the experts class's own ``forward``, not ``_apply_gate``
EAGER_EXPERTS = "eager"


def experts_flags(module: nn.Module) -> dict[str, bool] | None:
    """The decorator's flags of ``module`` (``{"has_gate": True, ...}``), ``None`` where
    ``module`` is not an instance of a class ``use_experts_implementation`` decorated (or
    it holds expert-parallel shards: ``_is_expert_parallel``)."""
    if not callable(getattr(type(module), "_apply_gate", None)):
        return None
    flags = {name: getattr(module, name, None) for name in EXPERTS_FLAGS}
    if not all(isinstance(value, bool) for value in flags.values()):
        return None
    if getattr(module, "_is_expert_parallel", False):
        return None
    return {name: bool(value) for name, value in flags.items()}


def experts_implementation(module: nn.Module) -> str | None:
    """The experts implementation ``module`` dispatches to now (its config's)."""
    found: Any = getattr(getattr(module, "config", None), "_experts_implementation", None)
    return found if isinstance(found, str) else None
