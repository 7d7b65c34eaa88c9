"""Standalone tensor operations that substitutions are built from (pure PyTorch)."""

from __future__ import annotations

from layerswap.ops.linear_cross_entropy import LogitTransform, linear_cross_entropy

__all__ = ["LogitTransform", "linear_cross_entropy"]
