"""The ``fused`` head's former name: this module is :mod:`layerswap.backends.fused.head`."""

from __future__ import annotations

import sys

from layerswap.backends.fused import head

sys.modules[__name__] = head
