"""The ``layerswap`` command line: thin, it parses, calls the library and renders.

Commands: ``list``, ``patch``, ``verify``, ``bench``, ``doctor``. Exit codes: 0 passed,
1 verification failed, 2 a usage or environment problem, reported as one line on
stderr without a traceback. ``--json`` puts only JSON on stdout. Progress goes to stderr
and only when stderr is a terminal; output to a pipe has no colours.

One module per concern: ``commands`` (the commands and :func:`main`), ``options`` (the
options ``patch``, ``verify`` and ``bench`` share), ``models`` (choosing the substitution
and building the model), ``runs`` (what ``patch`` and ``bench`` run of the library),
``render`` (tables and lines for people), ``output`` (stdout, progress), ``problems``
(usage problems: exit code 2) and ``doctor``.

Example::

    $ layerswap patch --model llama
    $ layerswap verify --model qwen3 --backward --generate 4 --json | jq .passed
"""

from __future__ import annotations

from layerswap.cli.commands import app, main

__all__ = ["app", "main"]
