"""A model's config, unwrapped once: the config as the user gave it, the text config its
decoder layers read, and the dtype that names.

A swap reads the user's config at many steps: the call contract and structure, the
first-use proof, each layer's conversion. :class:`ModelConfig` is made once where a
swap starts and handed down, so no step unwraps the config again, and none changes it
(transformers' ``get_text_config()`` gives the text part of a composite model; a
``dtype`` left as a name by ``save_pretrained`` is read as the torch dtype it names, on
a shallow copy).

A :class:`ModelConfig` is read where a transformers config is unwrapped
(:func:`layerswap.hf_internals.text_config_of` and :func:`layerswap.model.layer_config`
give its :attr:`~ModelConfig.text`), so a function that takes either takes it too; any
other field is read off the model's config (``view.model_type``), as a slot handed the
config itself reads it.

Example::

    view = ModelConfig.of(llava.config)
    view.text is layer_config(view)            # True: unwrapped once, here
    view.config is llava.config                # True: the user's, unchanged
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from layerswap import hf_internals

__all__ = ["ModelConfig"]

#: the config a swap has unwrapped, while it hands the config itself to a step
_CURRENT: contextvars.ContextVar[ModelConfig | None] = contextvars.ContextVar(
    "layerswap_model_config", default=None
)


@dataclass(frozen=True, eq=False)
class ModelConfig:
    """A model's ``config`` (never changed) and its ``text`` config, unwrapped once."""

    #: the config as the model holds it
    config: Any
    #: the config its decoder layers read: a composite model's text config, else
    #: ``config`` (a shallow copy where its ``dtype`` was a name)
    text: Any
    #: the text config object itself, never a copy: what a watcher of later changes
    #: to it reads (:mod:`layerswap.placement_guard`)
    text_object: Any

    @classmethod
    def of(cls, config: Any) -> ModelConfig:
        """``config`` unwrapped (a :class:`ModelConfig` is returned as it is, and so is the
        one :meth:`current` holds for this very config)."""
        if isinstance(config, ModelConfig):
            return config
        held = _CURRENT.get()
        if held is not None and held.config is config:
            return held
        text_object = hf_internals.text_config_object(config)
        return cls(config, hf_internals.torch_dtyped(text_object), text_object)

    @contextmanager
    def current(self) -> Iterator[ModelConfig]:
        """Inside, :meth:`of` of this config (``self.config``) is this object: a step handed
        the model's config itself (a slot's ``prepare``, which another library's slot may
        override and read as a config) unwraps nothing again."""
        token = _CURRENT.set(self)
        try:
            yield self
        finally:
            _CURRENT.reset(token)

    @property
    def dtype(self) -> torch.dtype | None:
        """The torch dtype the text config names, ``None`` where it names none."""
        return hf_internals.torch_dtype_of(self.text)

    def __getattr__(self, name: str) -> Any:
        # any other field is the model's config's, read as the config was before it was
        # unwrapped (a slot of another library reading ``config.hidden_size``)
        if name.startswith("__") or name in ("config", "text", "text_object"):
            raise AttributeError(name)
        return getattr(self.config, name)

    def get_text_config(self, *args: Any, **kwargs: Any) -> Any:
        """:attr:`text`: read as transformers reads a composite config's text part."""
        return self.text

    def __repr__(self) -> str:
        return f"ModelConfig({type(self.config).__name__}, text={type(self.text).__name__})"
