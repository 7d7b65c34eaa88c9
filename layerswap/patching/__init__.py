"""The patching engine: scoped, exception-safe, nestable, thread-safe replacement."""

from __future__ import annotations

from layerswap.patching.wraps import safe_update_wrapper, safe_wraps

__all__ = ["safe_update_wrapper", "safe_wraps"]
