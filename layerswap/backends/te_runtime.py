"""The former name of what the ``te`` backend needs at run time: this module is
:mod:`layerswap.backends.te.runtime`."""

from __future__ import annotations

import sys

from layerswap.backends.te import runtime

sys.modules[__name__] = runtime
