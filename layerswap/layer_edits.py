"""What was changed on a decoder layer object since its config built it.

The decoder slot builds each replacement from the model's config and the original's
classes, and carries over the weights (:func:`layerswap.layers.convert_layer`). Anything
else set on the layer object itself is not carried over: an attribute written on a module
of the layer (``self_attn.is_causal = False`` to make a decoder attend both ways, a
``scaling`` or ``variance_epsilon`` of its own), a module put in another's place
(``mlp.act_fn = nn.GELU()``), a ``forward`` set on the instance, or a hook registered on
one of its modules (those modules are not the replacement's), or a backward hook on the
layer (the swap carries its forward hooks over only). The first-use proof
cannot see them either: it builds its tiny model from the config. So a swap reads each
layer against one its config builds on the meta device and refuses, naming the first such
change, where one would be dropped.

What is read: every module of the layer, by name, against the one built in its place;
its class (a subclass of the built one's, such as a quantizer's linear layer, is the
quantizer's, not a change), and the plain values (numbers, strings, booleans, tuples,
``None``) both modules hold under one attribute name. Left out: ``training``, gradient
checkpointing's switch, private attributes (``_hf_hook``...), an attribute the built module
does not have, and a rotary embedding's cache of the longest sequence seen. A ``forward``
set on the instance is accelerate's where the module holds its ``_hf_hook`` (the swap
carries that hook over), and the class's own where it is that bound to the module (what
removing accelerate's hooks leaves).

Example::

    layer.self_attn.is_causal = False
    layer_edit(layer, built)   # "self_attn.is_causal is False on the layer, where its config builds True"
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["layer_edit"]

#: attributes a module's own machinery changes as it runs or trains, not its computation
_RUNTIME = frozenset(
    {
        "training",
        "gradient_checkpointing",
        "max_seq_len_cached",
        "original_max_seq_len",
        "attention_scaling",
    }
)
_PLAIN = (bool, int, float, str, tuple, type(None))


def layer_edit(layer: nn.Module, built: nn.Module) -> str | None:
    """The first change made on ``layer`` (a user's decoder layer) against ``built`` (one
    its config builds in its place), in a sentence; ``None`` where there is none."""
    fresh = dict(built.named_modules())
    for name, module in layer.named_modules():
        where = name or "the layer"
        own = fresh.pop(name, None)
        if own is None:
            return f"{where} ({type(module).__name__}) is a module its config does not build"
        if not isinstance(module, type(own)):
            return (
                f"{where} is a {type(module).__name__}, where its config builds a "
                f"{type(own).__name__}"
            )
        if _own_forward(module):
            return f"{where} has a forward set on the instance"
        # the layer's own forward hooks are carried over to its replacement, not others
        hook = _own_hook(module, _HOOKS if name else _BACKWARD)
        if hook is not None:
            return (
                f"{where} holds a hook of its own ({hook}), which the replacement would not "
                "run (remove it, and register it again after the swap)"
            )
        changed = _changed_value(module, own)
        if changed is not None:
            key, value, expected = changed
            prefix = f"{name}." if name else ""
            return f"{prefix}{key} is {value!r} on the layer, where its config builds {expected!r}"
    if fresh:
        name = next(iter(fresh))
        return f"{name} ({type(fresh[name]).__name__}) was removed from the layer"
    return None


def _own_forward(module: nn.Module) -> bool:
    """Whether ``module`` holds a ``forward`` of its own: not accelerate's (it holds the
    module's ``_hf_hook``), nor its class's bound to it (what removing accelerate's hooks
    leaves behind, as PEFT's loading does)."""
    forward = vars(module).get("forward")
    if forward is None or getattr(module, "_hf_hook", None) is not None:
        return False
    bound = getattr(forward, "__func__", None) is getattr(type(module), "forward", None)
    return not (bound and getattr(forward, "__self__", None) is module)


#: hook dictionaries of a module whose hooks run as it computes
_BACKWARD = ("_backward_pre_hooks", "_backward_hooks")
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", *_BACKWARD)
#: modules whose hooks the swap follows itself: transformers' output capture (installed on
#: the replacement as on the original) and layerswap's own
_FOLLOWED = ("transformers.utils.output_capturing", "layerswap")


def _own_hook(module: nn.Module, attributes: tuple[str, ...]) -> str | None:
    """The name of the first hook of ``attributes`` that ``module`` runs and the swap does
    not follow itself."""
    for attribute in attributes:
        for hook in getattr(module, attribute, {}).values():
            function = getattr(hook, "func", hook)  # a partial's
            function = getattr(function, "__func__", function)  # a bound method's
            made = getattr(function, "__module__", None) or type(function).__module__ or ""
            if not any(made == top or made.startswith(f"{top}.") for top in _FOLLOWED):
                return getattr(function, "__qualname__", type(function).__qualname__)
    return None


def _changed_value(module: nn.Module, built: nn.Module) -> tuple[str, Any, Any] | None:
    mine, theirs = vars(module), vars(built)
    for key, value in mine.items():
        if key.startswith("_") or key in _RUNTIME or key not in theirs:
            continue
        expected = theirs[key]
        if isinstance(value, _PLAIN) and isinstance(expected, _PLAIN) and value != expected:
            return key, value, expected
    return None
