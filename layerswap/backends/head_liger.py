"""The ``liger`` head's former name: this module is :mod:`layerswap.backends.liger.head`."""

from __future__ import annotations

import sys

from layerswap.backends.liger import head

sys.modules[__name__] = head
