"""The ``liger`` declaration's former name: this module is
:mod:`layerswap.backends.liger.declaration`."""

from __future__ import annotations

import sys

from layerswap.backends.liger import declaration

sys.modules[__name__] = declaration
