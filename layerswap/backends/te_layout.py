"""The ``te`` weight layout's former name: this module is :mod:`layerswap.backends.te.layout`."""

from __future__ import annotations

import sys

from layerswap.backends.te import layout

sys.modules[__name__] = layout
