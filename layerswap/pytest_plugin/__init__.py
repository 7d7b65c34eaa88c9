"""pytest plugin: the ``layerswap`` fixture and marker, ``--layerswap``, and the leak guard.

Installed with the package (entry point ``pytest11``, name ``layerswap``, value
``layerswap.pytest_plugin``), so every pytest run in an environment with layerswap has it:

* fixture ``layerswap`` (``fixture.py``): ``.patch``, ``.patch_dict``, ``.wrap``,
  ``.use``, ``.swap``, all undone at teardown, newest first (like ``monkeypatch``);
* marker ``@pytest.mark.layerswap("llama.decoder.fused", ...)`` and option
  ``--layerswap=NAME[,NAME...]`` (``session.py``): one test, its fixtures included, or
  the whole session runs with those substitutions applied;
* leak guard (``guard.py``): a test that leaves a layerswap patch active errors at
  teardown, naming the patch and the line that started it; the patch is stopped so
  that later tests see the original (ini option ``layerswap_leak_guard = false``
  turns it off).

This module is the plugin pytest registers: it holds the hooks and the fixture of the
three modules (one plugin, so ``-p no:layerswap`` turns all of it off), and the names
users import. The plugin imports torch and transformers only when a substitution is
used, so a suite that does not use it pays nothing for it. See docs/pytest.md.

Example (in a ``conftest.py``)::

    from layerswap.pytest_plugin import session_substitutions

    def pytest_report_header(config):
        return f"decoder: {session_substitutions(config) or 'original'}"
"""

from __future__ import annotations

from layerswap.pytest_plugin.fixture import LayerswapFixture, layerswap
from layerswap.pytest_plugin.guard import (
    pytest_addoption_leak_guard,
    pytest_fixture_post_finalizer,
    pytest_fixture_setup,
    pytest_runtest_setup,
    pytest_runtest_teardown,
)
from layerswap.pytest_plugin.session import (
    pytest_addoption,
    pytest_configure,
    pytest_report_header,
    pytest_runtest_setup_marker,
    pytest_runtest_teardown_marker,
    pytest_unconfigure,
    session_substitutions,
)

__all__ = [
    # for users
    "LayerswapFixture",
    "session_substitutions",
    # for pytest, which finds a plugin's fixtures and hooks among its module's names
    "layerswap",
    "pytest_addoption",
    "pytest_addoption_leak_guard",
    "pytest_configure",
    "pytest_fixture_post_finalizer",
    "pytest_fixture_setup",
    "pytest_report_header",
    "pytest_runtest_setup",
    "pytest_runtest_setup_marker",
    "pytest_runtest_teardown",
    "pytest_runtest_teardown_marker",
    "pytest_unconfigure",
]
