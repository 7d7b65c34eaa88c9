"""The ``te`` declaration's former name: this module is
:mod:`layerswap.backends.te.declaration`."""

from __future__ import annotations

import sys

from layerswap.backends.te import declaration

sys.modules[__name__] = declaration
