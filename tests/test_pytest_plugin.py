"""The pytest plugin, end to end: each test runs a small pytest session with ``pytester``.

Sessions run in this process (fast) except where isolation is the point (xdist, entry
points). The modules those sessions use are imported here first, so that pytester's
module snapshot keeps them: pytester forgets modules first imported by an inner
session, and a second copy of ``layerswap.patching`` would keep a second registry of
live patches (the leak guard would look at one, the tests patch through the other).
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
import textwrap
from pathlib import Path

import pytest
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3

import layerswap

# loaded here, outside the in-process inner sessions, which unload what they import first:
# the fused layers and the decoder-layer contract stay the same objects for every test
import layerswap.backends._layer
import layerswap.backends.fused.decoder
import layerswap.distributed
import layerswap.patching
import layerswap.pytest_plugin
import layerswap.swap

pytest_plugins = ["pytester"]

DOWNSTREAM = Path(__file__).resolve().parent.parent / "examples" / "downstream"
ORIGINAL_DECODER = modeling_llama.LlamaDecoderLayer
ORIGINAL_QWEN2_DECODER = modeling_qwen2.Qwen2DecoderLayer
ORIGINAL_QWEN3_DECODER = modeling_qwen3.Qwen3DecoderLayer


def _plugin_args() -> list[str]:
    """How an inner session loads the plugin.

    Once layerswap is installed with its ``pytest11`` entry point, pytest loads the
    plugin by itself, and ``-p layerswap.pytest_plugin`` would register the same
    module a second time under another name, which pluggy refuses. ``-p`` with the
    entry point's name is deduplicated, and also works with autoloading turned off.
    """
    for entry_point in importlib.metadata.entry_points(group="pytest11"):
        if entry_point.value == "layerswap.pytest_plugin":
            return ["-p", entry_point.name]
    return ["-p", "layerswap.pytest_plugin"]


PLUGIN = _plugin_args()
# Inner sessions use neither the cache nor hypothesis (whose plugin costs about a
# second per session) nor pytest-benchmark (which warns when xdist runs this file).
INNER = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:benchmark")


@pytest.fixture(autouse=True)
def no_patch_outlives_the_inner_sessions():
    before = [info.patch for info in layerswap.active_patches()]
    yield
    after = [info for info in layerswap.active_patches() if info.patch not in before]
    assert after == []


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    # In this process layerswap is already imported, so pytest cannot rewrite its asserts
    # for the inner session, and says so; that is expected here.
    quiet = ("-W", "ignore::pytest.PytestAssertRewriteWarning")
    return pytester.runpytest_inprocess(*PLUGIN, *INNER, *quiet, *args)


@pytest.fixture
def target_module(pytester: pytest.Pytester) -> None:
    """``target_mod``: something for inner tests to patch."""
    pytester.makepyfile(
        target_mod="""
        VALUE = "original"
        LOG = []

        class LoggingMapping(dict):
            def __init__(self, name):
                super().__init__()
                self.name = name

            def __setitem__(self, key, value):
                LOG.append(f"{self.name}: set {key}")
                super().__setitem__(key, value)

            def __delitem__(self, key):
                LOG.append(f"{self.name}: del {key}")
                super().__delitem__(key)

            def pop(self, key, *default):
                LOG.append(f"{self.name}: del {key}")
                return super().pop(key, *default)

        FIRST = LoggingMapping("first")
        SECOND = LoggingMapping("second")
        """
    )


# --- the fixture ---------------------------------------------------------------------------


def test_fixture_undoes_its_changes_at_teardown_newest_first(pytester, target_module):
    pytester.makepyfile(
        """
        import target_mod

        def test_patches(layerswap):
            layerswap.patch_dict(target_mod.FIRST, {"k": 1})
            layerswap.patch_dict(target_mod.SECOND, {"k": 2})
            layerswap.patch(target_mod, "VALUE", "patched")
            assert target_mod.VALUE == "patched"
            target_mod.LOG.clear()

        def test_after():
            assert target_mod.VALUE == "original"
            assert dict(target_mod.FIRST) == {} and dict(target_mod.SECOND) == {}
            assert target_mod.LOG == ["second: del k", "first: del k"]
        """
    )
    run(pytester).assert_outcomes(passed=2)


def test_patches_stopped_in_the_test_in_any_order_leave_the_original(pytester, target_module):
    pytester.makepyfile(
        """
        import target_mod

        def test_stops_out_of_order(layerswap):
            bottom = layerswap.patch(target_mod, "VALUE", "bottom")
            middle = layerswap.patch(target_mod, "VALUE", "middle")
            top = layerswap.patch(target_mod, "VALUE", "top")
            bottom.stop()
            assert target_mod.VALUE == "top"
            top.stop()
            assert target_mod.VALUE == "middle"
            assert middle.is_active   # teardown stops it

        def test_after():
            assert target_mod.VALUE == "original"
        """
    )
    run(pytester).assert_outcomes(passed=2)


def test_fixture_patches_report_the_line_of_the_test_that_started_them(pytester, target_module):
    pytester.makepyfile(
        test_origin="""
        import layerswap as ls
        import target_mod

        def test_origin(layerswap):
            layerswap.wrap(target_mod.LoggingMapping, "__setitem__", lambda w, i, a, k: w(*a, **k))
            (info,) = [i for i in ls.active_patches() if "LoggingMapping" in i.target]
            assert info.origin.endswith("test_origin.py:5 in test_origin"), info.origin
        """
    )
    run(pytester).assert_outcomes(passed=1)


def test_fixture_use_builds_replacement_layers_only_inside_the_test(pytester):
    pytester.makepyfile(
        """
        from transformers.models.llama import modeling_llama
        import layerswap as ls

        def build():
            config = ls.families()["llama"].tiny_config(num_hidden_layers=1)
            return modeling_llama.LlamaForCausalLM(config)

        def test_use(layerswap):
            layerswap.use("llama.decoder.fused")
            assert type(build().model.layers[0]).__name__ == "FusedLlamaDecoderLayer"

        def test_after():
            assert type(build().model.layers[0]) is modeling_llama.LlamaDecoderLayer
        """
    )
    run(pytester).assert_outcomes(passed=2)


def test_fixture_swap_and_undo_put_the_original_weights_back(pytester):
    pytester.makepyfile(
        """
        import pytest
        import torch
        import layerswap as ls
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        @pytest.fixture(scope="module")
        def model():
            return ls.families()["llama"].build(ls.families()["llama"].tiny_config(num_hidden_layers=2))

        @pytest.fixture(scope="module")
        def weights(model):
            return {k: v.clone() for k, v in model.state_dict().items()}

        def test_swap(layerswap, model, weights):
            handle = layerswap.swap(model, "llama.decoder.fused")
            assert len(handle) == 2
            assert type(model.model.layers[0]).__name__ == "FusedLlamaDecoderLayer"

        def test_undo_in_the_test(layerswap, model, weights):
            layerswap.swap(model, backend="fused")
            layerswap.undo()
            assert type(model.model.layers[0]) is LlamaDecoderLayer

        def test_after(model, weights):
            assert all(type(layer) is LlamaDecoderLayer for layer in model.model.layers)
            state = model.state_dict()
            assert all(torch.equal(state[k], v) for k, v in weights.items())
        """
    )
    run(pytester).assert_outcomes(passed=3)


# --- monkeypatch together with layerswap -------------------------------------------------


@pytest.mark.parametrize("fixtures", ["monkeypatch, layerswap", "layerswap, monkeypatch"])
def test_monkeypatch_and_layerswap_on_one_attribute_unwind_in_any_order(
    pytester, target_module, fixtures
):
    pytester.makepyfile(
        f"""
        import target_mod

        def test_monkeypatch_below({fixtures}):
            monkeypatch.setattr(target_mod, "VALUE", "monkeypatch")
            layerswap.patch(target_mod, "VALUE", "layerswap")
            assert target_mod.VALUE == "layerswap"

        def test_after_1():
            assert target_mod.VALUE == "original"

        def test_monkeypatch_on_top({fixtures}):
            layerswap.patch(target_mod, "VALUE", "layerswap")
            monkeypatch.setattr(target_mod, "VALUE", "monkeypatch")
            assert target_mod.VALUE == "monkeypatch"

        def test_after_2():
            assert target_mod.VALUE == "original"

        def test_interleaved({fixtures}):
            monkeypatch.setattr(target_mod, "VALUE", "monkeypatch 1")
            layerswap.patch(target_mod, "VALUE", "layerswap 1")
            monkeypatch.setitem(target_mod.FIRST, "k", "monkeypatch")
            monkeypatch.setattr(target_mod, "VALUE", "monkeypatch 2")
            layerswap.patch(target_mod, "VALUE", "layerswap 2")
            layerswap.patch_dict(target_mod.FIRST, {{"k": "layerswap"}})
            assert target_mod.VALUE == "layerswap 2"

        def test_after_3():
            assert target_mod.VALUE == "original"
            assert "k" not in target_mod.FIRST
        """
    )
    # a foreign write seen by either side would warn; none may happen
    result = run(pytester, "-W", "error::layerswap.errors.PatchConflictWarning")
    result.assert_outcomes(passed=6)


# --- the marker ----------------------------------------------------------------------------


def test_marker_applies_before_fixtures_and_is_undone_after_teardown(pytester):
    pytester.makepyfile(
        """
        import pytest
        from transformers.models.llama import modeling_llama
        import layerswap as ls

        seen_at_teardown = []

        @pytest.fixture
        def model():
            config = ls.families()["llama"].tiny_config(num_hidden_layers=1)
            yield modeling_llama.LlamaForCausalLM(config)
            seen_at_teardown.append(modeling_llama.LlamaDecoderLayer.__name__)

        @pytest.mark.layerswap("llama.decoder.fused")
        def test_marked(model):
            assert type(model.model.layers[0]).__name__ == "FusedLlamaDecoderLayer"

        class TestMarkedClass:
            pytestmark = pytest.mark.layerswap("llama.decoder.fused")

            def test_method(self, model):
                assert type(model.model.layers[0]).__name__ == "FusedLlamaDecoderLayer"

        def test_unmarked(model):
            assert seen_at_teardown == ["FusedLlamaDecoderLayer"] * 2
            assert type(model.model.layers[0]) is modeling_llama.LlamaDecoderLayer
        """
    )
    run(pytester, "--strict-markers").assert_outcomes(passed=3)


def test_marker_with_an_unknown_name_errors_with_the_closest_names(pytester):
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.layerswap("llama.decoder.fusd")
        def test_typo():
            pass

        def test_next():
            pass
        """
    )
    result = run(pytester)
    result.assert_outcomes(errors=1, passed=1)
    result.stdout.fnmatch_lines(
        ["*no substitution named 'llama.decoder.fusd'; did you mean 'llama.decoder.fused'*"]
    )


# --- the option ----------------------------------------------------------------------------


def test_option_applies_substitutions_to_the_whole_session(pytester):
    pytester.makepyfile(
        """
        from transformers.models.llama import modeling_llama
        from transformers.models.qwen2 import modeling_qwen2

        def test_llama(layerswap):
            assert modeling_llama.LlamaDecoderLayer.__name__ == "FusedLlamaDecoderLayer"
            assert layerswap.session_substitutions == ("llama.decoder.fused", "qwen2.decoder.fused")

        def test_qwen2():
            assert modeling_qwen2.Qwen2DecoderLayer.__name__ == "FusedQwen2DecoderLayer"
        """
    )
    result = run(pytester, "--layerswap=llama.decoder.fused", "--layerswap", "qwen2.decoder.fused")
    result.assert_outcomes(passed=2)  # no leak error: session patches are not the tests'
    result.stdout.fnmatch_lines(
        [
            "layerswap: whole session runs with llama.decoder.fused "
            "(LlamaDecoderLayer -> FusedLlamaDecoderLayer), qwen2.decoder.fused*"
        ]
    )
    # stopped at unconfigure
    assert modeling_llama.LlamaDecoderLayer is ORIGINAL_DECODER
    assert modeling_qwen2.Qwen2DecoderLayer is ORIGINAL_QWEN2_DECODER


def test_option_takes_a_comma_separated_list(pytester):
    pytester.makepyfile(
        """
        from layerswap.pytest_plugin import session_substitutions

        def test_names(pytestconfig):
            assert session_substitutions(pytestconfig) == ("llama.decoder.fused", "qwen3.decoder.fused")
        """
    )
    run(pytester, "--layerswap=llama.decoder.fused,qwen3.decoder.fused").assert_outcomes(passed=1)
    assert modeling_qwen3.Qwen3DecoderLayer is ORIGINAL_QWEN3_DECODER


def test_option_with_an_unknown_name_is_a_usage_error(pytester):
    pytester.makepyfile("def test_never_runs(): pass")
    result = run(pytester, "--layerswap=llama.decoder.fusd")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "*--layerswap: no substitution named 'llama.decoder.fusd'; did you mean 'llama.decoder.fused'*"
        ]
    )


def test_without_the_option_the_header_says_nothing(pytester):
    pytester.makepyfile("def test_nothing(): pass")
    result = run(pytester)
    result.assert_outcomes(passed=1)
    assert not [line for line in result.outlines if line.startswith("layerswap:")]


# --- the leak guard ------------------------------------------------------------------------


def test_leaked_patch_errors_at_teardown_naming_it_and_later_tests_see_the_original(
    pytester, target_module
):
    pytester.makepyfile(
        test_leaky="""
        import layerswap as ls
        import target_mod

        def test_leaks():
            ls.patch(target_mod, "VALUE", "leaked").start()

        def test_after():
            assert target_mod.VALUE == "original"
        """
    )
    result = run(pytester)
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_leaks*",
            "*test_leaky.py::test_leaks left 1 layerswap patch active:",
            "*target_mod.VALUE -> 'leaked', started at test_leaky.py:5 in test_leaks (left by the test)",
        ]
    )


def test_a_leaked_adoption_is_undone_whole_and_named_where_it_was_adopted(pytester):
    """An adoption's changes are more than patches (a dict entry, a function's code): the
    guard undoes the adoption, not only the patches behind its rebindings."""
    pytester.makepyfile(
        test_leaky_adoption="""
        import layerswap as ls
        from transformers.activations import ACT2FN
        from transformers.models.llama import modeling_llama

        NORM, CODE = modeling_llama.LlamaRMSNorm, modeling_llama.rotate_half.__code__

        class Other:
            pass

        def my_patch():
            modeling_llama.LlamaRMSNorm = Other
            ACT2FN["leaked_act"] = ACT2FN["silu"]
            modeling_llama.rotate_half.__code__ = (lambda x: x).__code__

        def test_leaks():
            ls.adopt(my_patch, prove=False)

        def test_after():
            assert modeling_llama.LlamaRMSNorm is NORM
            assert "leaked_act" not in ACT2FN
            assert modeling_llama.rotate_half.__code__ is CODE
        """
    )
    result = run(pytester)
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*test_leaky_adoption.py::test_leaks left 1 layerswap patch active:",
            "*layerswap.adopt(my_patch), adopted at test_leaky_adoption.py:16 in test_leaks "
            "(left by the test)",
        ]
    )


def test_a_leaked_use_is_named_by_its_substitution(pytester):
    pytester.makepyfile(
        test_leaky_use="""
        import layerswap as ls
        from transformers.models.llama import modeling_llama

        def test_leaks():
            ls.use("llama.decoder.fused").start()

        def test_after():
            assert modeling_llama.LlamaDecoderLayer.__name__ == "LlamaDecoderLayer"
        """
    )
    result = run(pytester)
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        ["*layerswap.use('llama.decoder.fused'), started at test_leaky_use.py:5 in test_leaks*"]
    )


def test_patches_held_by_wider_fixtures_are_theirs_not_the_tests(pytester, target_module):
    pytester.makepyfile(
        helpers="""
        import layerswap as ls
        import target_mod

        def start_patch(value):
            # started away from the fixture's own code: ownership is by when, not where
            return ls.patch(target_mod, "VALUE", value).start()
        """,
        test_wide="""
        import pytest
        import helpers
        import target_mod

        @pytest.fixture(scope="module")
        def patched():
            patch = helpers.start_patch("module")
            yield
            patch.stop()

        @pytest.fixture(scope="session", autouse=True)
        def forgetful():
            helpers.start_patch("session")

        def test_one(patched):
            assert target_mod.VALUE == "module"

        def test_two(patched):
            assert target_mod.VALUE == "module"
        """,
    )
    result = run(pytester)
    # the module fixture stops its patch: fine; the session fixture never does: reported
    # at the teardown where it is finalized, naming the fixture
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_two*",
            "*target_mod.VALUE -> 'session', started at helpers.py:6 in start_patch "
            "(left by fixture 'forgetful' (session scope))",
        ]
    )


def test_leak_guard_can_be_turned_off(pytester, target_module):
    pytester.makeini("[pytest]\nlayerswap_leak_guard = false\n")
    pytester.makepyfile(
        """
        import layerswap as ls
        import target_mod

        def test_leaks():
            target_mod.LEAKED = ls.patch(target_mod, "VALUE", "leaked").start()

        def test_after():
            assert target_mod.VALUE == "leaked"
            target_mod.LEAKED.stop()
        """
    )
    run(pytester).assert_outcomes(passed=2)


# --- installation, xdist, a downstream repository ----------------------------------------


@pytest.mark.slow  # a fresh interpreter
def test_the_entry_point_loads_the_plugin_once(pytester, monkeypatch):
    # an installed layerswap as pytest sees it: a distribution with the pytest11 entry point
    dist_info = pytester.path / "site" / "layerswap_entry_point-0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: layerswap-entry-point\nVersion: 0\n"
    )
    (dist_info / "entry_points.txt").write_text("[pytest11]\nlayerswap = layerswap.pytest_plugin\n")
    monkeypatch.setenv("PYTHONPATH", str(dist_info.parent))
    pytester.makepyfile(
        """
        def test_fixture_is_there(layerswap, pytestconfig):
            assert pytestconfig.pluginmanager.has_plugin("layerswap")
        """
    )
    # autoloaded; and named by -p, which pytest then does not load a second time
    pytester.runpytest_subprocess(*INNER).assert_outcomes(passed=1)
    pytester.runpytest_subprocess("-p", "layerswap", *INNER).assert_outcomes(passed=1)


@pytest.mark.slow  # three fresh interpreters that import torch and transformers
def test_every_xdist_worker_applies_the_session_substitutions(pytester):
    pytest.importorskip("xdist")
    pytester.makepyfile(
        textwrap.dedent(
            """
            import os
            import pytest
            from transformers.models.llama import modeling_llama

            @pytest.mark.parametrize("n", range(4))
            def test_layer_class(n):
                cls = modeling_llama.LlamaDecoderLayer
                print(f"RAN {os.environ['PYTEST_XDIST_WORKER']} {cls.__name__}")
                assert cls.__name__ == "FusedLlamaDecoderLayer"
            """
        )
    )
    result = pytester.runpytest_subprocess(
        *PLUGIN, *INNER, "-n", "2", "--layerswap=llama.decoder.fused", "-rP"
    )
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["layerswap: whole session runs with llama.decoder.fused*"])
    workers = set(re.findall(r"RAN (gw\d) FusedLlamaDecoderLayer", result.stdout.str()))
    assert workers == {"gw0", "gw1"}


@pytest.mark.slow  # a spawned interpreter that imports torch and transformers
def test_a_process_a_test_spawns_builds_the_session_substitutions(pytester):
    pytester.makepyfile(
        textwrap.dedent(
            """
            import torch.multiprocessing as mp


            def build(rank, path):
                from transformers import LlamaConfig, LlamaForCausalLM

                config = LlamaConfig(
                    hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                )
                layer = LlamaForCausalLM(config).model.layers[0]
                with open(path, "w") as out:
                    out.write(type(layer).__name__)


            def test_spawned_rank(tmp_path):
                path = tmp_path / "layer.txt"
                mp.spawn(build, args=(str(path),), nprocs=1)
                print("SPAWNED BUILT", path.read_text())
            """
        )
    )
    swapped = pytester.runpytest_subprocess(
        *PLUGIN, *INNER, "--layerswap=llama.decoder.fused", "-rP"
    )
    swapped.assert_outcomes(passed=1)
    swapped.stdout.fnmatch_lines(["SPAWNED BUILT FusedLlamaDecoderLayer"])
    plain = pytester.runpytest_subprocess(*PLUGIN, *INNER, "-rP")
    plain.assert_outcomes(passed=1)
    plain.stdout.fnmatch_lines(["SPAWNED BUILT LlamaDecoderLayer"])


@pytest.mark.slow  # a spawned interpreter that imports torch and transformers
def test_a_multiprocessing_child_of_a_test_gets_the_session_substitutions(pytester):
    # multiprocessing (not torch's): the child re-imports the test module, which imports
    # layerswap, which reads LAYERSWAP_SUBSTITUTIONS (layerswap.distributed.propagate)
    pytester.makepyfile(
        textwrap.dedent(
            """
            import multiprocessing

            import layerswap


            def build(queue):
                from transformers import LlamaForCausalLM

                config = layerswap.get_family("llama").tiny_config(num_hidden_layers=1)
                queue.put(type(LlamaForCausalLM(config).model.layers[0]).__name__)


            def test_spawned_child():
                context = multiprocessing.get_context("spawn")
                queue = context.Queue()
                process = context.Process(target=build, args=(queue,))
                process.start()
                print("CHILD BUILT", queue.get(timeout=120))
                process.join()
            """
        )
    )
    swapped = pytester.runpytest_subprocess(
        *PLUGIN, *INNER, "--layerswap=llama.decoder.fused", "-rP"
    )
    swapped.assert_outcomes(passed=1)
    swapped.stdout.fnmatch_lines(["CHILD BUILT FusedLlamaDecoderLayer"])
    plain = pytester.runpytest_subprocess(*PLUGIN, *INNER, "-rP")
    plain.assert_outcomes(passed=1)
    plain.stdout.fnmatch_lines(["CHILD BUILT LlamaDecoderLayer"])


def _downstream(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return run(pytester, str(DOWNSTREAM), "-rP", *args)


def test_downstream_suite_passes_with_original_and_with_swapped_layers(pytester):
    plain = _downstream(pytester)
    plain.assert_outcomes(passed=7)
    plain.stdout.fnmatch_lines(["decoder layer class: LlamaDecoderLayer"])

    swapped = _downstream(pytester, "--layerswap=llama.decoder.fused")
    swapped.assert_outcomes(passed=7)
    swapped.stdout.fnmatch_lines(
        [
            "layerswap: whole session runs with llama.decoder.fused*",
            "decoder layer class: FusedLlamaDecoderLayer",
        ]
    )
    assert modeling_llama.LlamaDecoderLayer is ORIGINAL_DECODER
    assert "tinylm" not in sys.modules  # the example ran in its own module namespace
