"""The ``fused`` declaration's former name: this module is
:mod:`layerswap.backends.fused.declaration`."""

from __future__ import annotations

import sys

from layerswap.backends.fused import declaration

sys.modules[__name__] = declaration
