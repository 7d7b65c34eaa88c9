"""What PEFT puts in a model in a module's place: its tuner layers.

A LoRA wraps a projection in a ``peft`` ``Linear`` (``base_layer`` inside); a
``modules_to_save`` module is a ``ModulesToSaveWrapper``. A swap that converts or calls a
module's own weights must see that the module is no longer the model's own.

Example::

    from layerswap.adapter_layers import is_adapter_layer

    is_adapter_layer(peft_model.base_model.model.model.layers[0].self_attn.q_proj)   # True
"""

from __future__ import annotations

from torch import nn

__all__ = ["is_adapter_layer"]


def is_adapter_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a PEFT tuner layer or ``modules_to_save`` wrapper (its class, or
    a base of it, is one of PEFT's)."""
    return any(klass.__module__.startswith("peft.") for klass in type(module).__mro__)
