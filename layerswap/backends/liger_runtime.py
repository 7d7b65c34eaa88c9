"""The former name of what the ``liger`` backend needs at run time: this module is
:mod:`layerswap.backends.liger.runtime`."""

from __future__ import annotations

import sys

from layerswap.backends.liger import runtime

sys.modules[__name__] = runtime
