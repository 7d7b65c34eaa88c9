"""The behaviours of ``layerswap.patch`` that users rely on (SPEC 1.1)."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import threading
import warnings

import pytest
import torch

import layerswap
from layerswap.errors import (
    LayerswapError,
    PatchConflictWarning,
    PatchStateError,
    PatchTargetError,
    TargetAttributeError,
    TargetImportError,
    TargetTypeError,
)

MODULE_SOURCE = """
VALUE = "original"

def greet():
    return "hello"

class Base:
    attr = "base"

    def method(self):
        return "base-method"

    @staticmethod
    def static():
        return "static"

    @classmethod
    def klass(cls):
        return cls.__name__

    @property
    def prop(self):
        return "prop"

class Child(Base):
    pass
"""


@pytest.fixture
def mod(make_module):
    name = make_module("target", MODULE_SOURCE)
    __import__(name)
    return sys.modules[name]


# --- targets -------------------------------------------------------------------------


def test_colon_and_dotted_targets_patch_the_same_attribute(mod):
    with layerswap.patch(f"{mod.__name__}:VALUE", "colon"):
        assert mod.VALUE == "colon"
    with layerswap.patch(f"{mod.__name__}.VALUE", "dotted"):
        assert mod.VALUE == "dotted"
    with layerswap.patch(f"{mod.__name__}:Base.attr", "nested"):
        assert mod.Base.attr == "nested"
    with layerswap.patch(f"{mod.__name__}.Base.attr", "nested-dotted"):
        assert mod.Base.attr == "nested-dotted"
    assert mod.VALUE == "original" and mod.Base.attr == "base"


def test_target_is_resolved_at_start_not_at_creation(make_module):
    name = make_module("late", "X = 1\n")
    p = layerswap.patch(f"{name}:X", 2)
    assert name not in sys.modules  # creating the patch imported nothing
    with p:
        assert sys.modules[name].X == 2
    assert sys.modules[name].X == 1


def test_missing_attribute_error_suggests_the_closest_name():
    target = "transformers.models.llama.modeling_llama:LlamaDecoderLayr"
    with pytest.raises(TargetAttributeError, match="did you mean `LlamaDecoderLayer`") as info:
        layerswap.patch(target, object()).start()
    assert isinstance(info.value, AttributeError)
    assert isinstance(info.value, LayerswapError)
    assert isinstance(info.value, PatchTargetError)
    assert "create=True" in str(info.value)


def test_missing_intermediate_attribute_names_where_resolution_failed(mod):
    with pytest.raises(AttributeError, match=r"has no attribute 'Bsae'.*did you mean `Base`"):
        layerswap.patch(f"{mod.__name__}:Bsae.attr", 1).start()


def test_missing_module_is_an_import_error_with_suggestion():
    with pytest.raises(TargetImportError, match="did you mean `transformers`") as info:
        layerswap.patch("transformrs.models:LlamaModel", 1).start()
    assert isinstance(info.value, ImportError)


@pytest.mark.parametrize(
    "args",
    [
        pytest.param((123,), id="number-only"),
        pytest.param((123, "x"), id="object-without-new"),
        pytest.param(("json:dumps",), id="string-without-new"),
        pytest.param(("json:dumps", "x", "y"), id="string-with-two-values"),
        pytest.param((json, 5, "new"), id="attribute-not-a-string"),
        pytest.param(("json:",), id="malformed"),
    ],
)
def test_bad_call_is_a_type_error_and_changes_nothing(args):
    before = json.dumps
    with pytest.raises(TypeError) as info:
        layerswap.patch(*args).start()
    assert isinstance(info.value, TargetTypeError)
    assert json.dumps is before
    assert layerswap.active_patches() == []


def test_malformed_target_strings_are_rejected_early():
    for text in ["", "nodots", "pkg.mod:", ":Name", "a..b", "pkg:a..b"]:
        with pytest.raises(TargetTypeError):
            layerswap.patch(text, 1)


# --- create, exact restore ----------------------------------------------------------------


def test_missing_attribute_created_with_create_and_deleted_on_stop(mod):
    with layerswap.patch(mod, "NEW_NAME", 5, create=True):
        assert mod.NEW_NAME == 5
    assert not hasattr(mod, "NEW_NAME")


def test_restore_gives_back_the_very_same_object(mod):
    original = mod.greet
    with layerswap.patch(mod, "greet", lambda: "patched"):
        assert mod.greet() == "patched"
    assert mod.greet is original


@pytest.mark.parametrize("name", ["static", "klass", "prop"])
def test_undo_keeps_raw_descriptors(mod, name):
    raw = mod.Base.__dict__[name]
    with layerswap.patch(mod.Base, name, "replaced"):
        assert mod.Base.__dict__[name] == "replaced"
    assert mod.Base.__dict__[name] is raw  # the staticmethod/classmethod/property object itself
    assert type(mod.Base.__dict__[name]) is type(raw)


@pytest.mark.parametrize("owner", ["Base", "Child"], ids=["class", "subclass"])
def test_undo_inherited_attribute_is_deleted_not_copied_down(mod, owner):
    klass = getattr(mod, owner)
    had_own = "method" in klass.__dict__
    with layerswap.patch(klass, "method", lambda self: "patched"):
        assert klass().method() == "patched"
    assert ("method" in klass.__dict__) == had_own
    assert mod.Child().method() == "base-method"


def test_instance_patch_removed_so_class_method_shows_again(mod):
    obj = mod.Base()
    with layerswap.patch(obj, "method", lambda: "instance"):
        assert obj.method() == "instance"
        assert mod.Base().method() == "base-method"
    assert "method" not in vars(obj)
    assert obj.method() == "base-method"


def test_special_function_attributes_are_set_back_not_deleted():
    def f(a, b=1):
        """doc"""
        return a + b

    defaults, doc = f.__defaults__, f.__doc__
    with layerswap.patch(f, "__defaults__", (10,)), layerswap.patch(f, "__doc__", "patched"):
        assert f(1) == 11 and f.__doc__ == "patched"
    assert f.__defaults__ is defaults and f.__doc__ is doc
    assert f(1) == 2


def _module_with_children() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1), torch.nn.Tanh()
    )


@pytest.mark.parametrize("replacement", ["module", "function", "none"])
def test_nn_module_children_keep_identity_and_order(replacement):
    model = _module_with_children()
    children = list(model._modules.items())
    keys_before = list(model.state_dict())
    new = {"module": torch.nn.Identity(), "function": lambda x: x, "none": None}[replacement]
    with layerswap.patch(model, "1", new):
        assert getattr(model, "1") is new
    assert list(model._modules.items()) == children
    assert all(a is b for (_, a), (_, b) in zip(model._modules.items(), children, strict=True))
    assert "1" not in vars(model)
    assert list(model.state_dict()) == keys_before


def test_nn_module_parameters_keep_identity_and_order():
    layer = torch.nn.Linear(2, 2)
    params = list(layer._parameters.items())
    with layerswap.patch(layer, "weight", torch.nn.Parameter(torch.zeros(2, 2))):
        assert torch.equal(layer.weight, torch.zeros(2, 2))
        assert list(layer._parameters) == ["weight", "bias"]
    with layerswap.patch(layer, "weight", torch.zeros(2, 2)):  # a plain tensor: not a Parameter
        assert list(layer._parameters) == ["bias"]
    assert list(layer._parameters.items()) == params
    assert "weight" not in vars(layer)


def test_nn_module_buffer_restored_in_place():
    norm = torch.nn.BatchNorm1d(3)
    order = list(norm._buffers)
    mean = norm.running_mean
    with layerswap.patch(norm, "running_mean", torch.ones(3)):
        assert torch.equal(norm.running_mean, torch.ones(3))
    assert norm.running_mean is mean and list(norm._buffers) == order


# --- failure and exceptions ----------------------------------------------------------------


def test_failed_start_on_immutable_type_changes_nothing():
    with pytest.raises(TargetTypeError, match="cannot patch"):
        layerswap.patch(str, "upper", lambda self: "x").start()
    assert "a".upper() != "x"
    assert layerswap.active_patches() == []


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit, GeneratorExit, ValueError])
def test_exit_restores_on_every_base_exception_and_does_not_swallow(mod, error):
    with pytest.raises(error), layerswap.patch(mod, "VALUE", "patched"):
        raise error()
    assert mod.VALUE == "original"


def test_start_twice_raises_and_changes_nothing(mod):
    p = layerswap.patch(mod, "VALUE", "first").start()
    try:
        with pytest.raises(PatchStateError, match="already started"):
            p.start()
        assert mod.VALUE == "first"
    finally:
        p.stop()
    assert mod.VALUE == "original"


def test_stop_twice_is_a_noop_and_restart_works(mod):
    p = layerswap.patch(mod, "VALUE", "patched")
    p.stop()  # never started
    p.start()
    p.stop()
    p.stop()
    assert mod.VALUE == "original"
    p.start()
    assert mod.VALUE == "patched"
    p.stop()
    assert mod.VALUE == "original"


# --- decorator ------------------------------------------------------------------------------


def test_decorator_on_sync_function_and_recursion(mod):
    @layerswap.patch(mod, "VALUE", "decorated")
    def countdown(n):
        assert mod.VALUE == "decorated"
        return 0 if n == 0 else 1 + countdown(n - 1)

    assert countdown(5) == 5
    assert mod.VALUE == "original"
    assert countdown.__name__ == "countdown"


def test_decorator_on_async_function(mod):
    @layerswap.patch(mod, "VALUE", "async")
    async def read():
        await asyncio.sleep(0)
        return mod.VALUE

    assert asyncio.run(read()) == "async"
    assert mod.VALUE == "original"


def test_decorated_generator_is_patched_while_iterated_not_only_at_creation(mod):
    @layerswap.patch(mod, "VALUE", "gen")
    def values():
        yield mod.VALUE
        yield mod.VALUE

    gen = values()
    assert mod.VALUE == "original"  # creating the generator starts nothing
    seen = list(gen)
    assert seen == ["gen", "gen"]
    assert mod.VALUE == "original"


def test_decorated_generator_restores_when_closed_early(mod):
    @layerswap.patch(mod, "VALUE", "gen")
    def values():
        while True:
            yield mod.VALUE

    gen = values()
    assert next(gen) == "gen"
    gen.close()  # GeneratorExit inside the generator
    assert mod.VALUE == "original"


def test_decorated_async_generator_delegates_and_restores(mod):
    @layerswap.patch(mod, "VALUE", "agen")
    async def values():
        received = yield mod.VALUE
        yield received

    async def main():
        agen = values()
        first = await agen.asend(None)
        second = await agen.asend("sent")
        with pytest.raises(StopAsyncIteration):
            await agen.asend(None)
        return first, second

    assert asyncio.run(main()) == ("agen", "sent")
    assert mod.VALUE == "original"


def test_decorating_a_class_is_a_clear_error(mod):
    with pytest.raises(TypeError, match="functions, not classes"):
        layerswap.patch(mod, "VALUE", 1)(type("C", (), {}))


# --- layered stacks ---------------------------------------------------------------------------


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))), ids=str)
def test_non_lifo_stop_shows_top_live_layer_and_restores_original(mod, order):
    patches = [layerswap.patch(mod, "VALUE", f"layer{i}").start() for i in range(3)]
    live = [0, 1, 2]
    for index in order:
        patches[index].stop()
        live.remove(index)
        expected = f"layer{live[-1]}" if live else "original"
        assert expected == mod.VALUE
    assert "VALUE" in vars(mod) and mod.VALUE == "original"


def test_non_lifo_with_context_managers_mixed_with_start_stop(mod):
    outer = layerswap.patch(mod, "greet", lambda: "outer").start()
    with layerswap.patch(mod, "greet", lambda: "inner"):
        outer.stop()  # outer stopped first: inner stays visible
        assert mod.greet() == "inner"
    assert mod.greet() == "hello"


# --- foreign writes ---------------------------------------------------------------------------


def test_foreign_write_warns_and_still_restores(mod):
    expected = "VALUE.*rebound outside layerswap.*'foreign'"
    with pytest.warns(PatchConflictWarning, match=expected), layerswap.patch(mod, "VALUE", "x"):
        mod.VALUE = "foreign"
    assert mod.VALUE == "original"


def test_foreign_write_as_error_filter_still_restores(mod):
    with warnings.catch_warnings():
        warnings.simplefilter("error", PatchConflictWarning)
        with pytest.raises(PatchConflictWarning), layerswap.patch(mod, "VALUE", "patched"):
            mod.VALUE = "foreign"
    assert mod.VALUE == "original"


# --- aliases, lazy -------------------------------------------------------------------------------


def test_aliases_patches_every_module_global_bound_to_the_same_object(make_module):
    source = make_module("alias_src", "def helper():\n    return 'orig'\n")
    user = make_module(
        "alias_user", f"from {source} import helper\nfrom {source} import helper as renamed\n"
    )
    __import__(user)
    src_mod, user_mod = sys.modules[source], sys.modules[user]
    original = src_mod.helper

    def new():
        return "new"

    with layerswap.patch(f"{source}:helper", new, aliases=True) as p:
        assert src_mod.helper is new and user_mod.helper is new and user_mod.renamed is new
        touched = {(owner.__name__, name) for owner, name in p.sites}
        assert {(source, "helper"), (user, "helper"), (user, "renamed")} <= touched
    assert src_mod.helper is original and user_mod.helper is original
    assert user_mod.renamed is original


@pytest.mark.parametrize("older_first", [True, False], ids=["older-first", "newer-first"])
def test_a_name_imported_under_one_aliases_patch_and_taken_by_another_comes_back(
    make_module, older_first
):
    """A module imported while an ``aliases=True`` patch is live binds its replacement; a
    newer ``aliases=True`` patch then takes that name over. Whichever stops first, the
    name ends as the original, not as the older replacement."""
    source = make_module("late_src", "class Y:\n    pass\n")
    late = make_module("late_user", f"from {source} import Y\n")
    __import__(source)
    original = sys.modules[source].Y

    class A:
        pass

    class B:
        pass

    older = layerswap.patch(f"{source}:Y", A, aliases=True).start()
    __import__(late)  # binds A
    newer = layerswap.patch(f"{source}:Y", B, aliases=True).start()
    assert sys.modules[late].Y is B
    for p in (older, newer) if older_first else (newer, older):
        p.stop()
    assert sys.modules[source].Y is original and sys.modules[late].Y is original


def test_without_aliases_a_from_import_copy_is_not_patched(make_module):
    source = make_module("noalias_src", "def helper():\n    return 'orig'\n")
    user = make_module("noalias_user", f"from {source} import helper\n")
    __import__(user)
    with layerswap.patch(f"{source}:helper", lambda: "new"):
        assert sys.modules[user].helper() == "orig"


def test_lazy_patch_applies_when_the_module_is_imported(make_module):
    name = make_module("lazy", "VALUE = 'original'\n")
    with layerswap.patch(f"{name}:VALUE", "lazy", lazy=True) as p:
        assert name not in sys.modules
        assert "pending import" in repr(p)
        module = __import__(name)
        assert module.VALUE == "lazy"
    assert module.VALUE == "original"


def test_lazy_patch_stopped_before_import_is_cancelled(make_module):
    name = make_module("lazy_cancel", "VALUE = 'original'\n")
    p = layerswap.patch(f"{name}:VALUE", "lazy", lazy=True).start()
    p.stop()
    assert __import__(name).VALUE == "original"


def test_lazy_patch_of_imported_module_applies_at_once(mod):
    with layerswap.patch(f"{mod.__name__}:VALUE", "now", lazy=True):
        assert mod.VALUE == "now"


def test_lazy_needs_colon_form():
    with pytest.raises(TargetTypeError, match="colon form"):
        layerswap.patch("some.module.Name", 1, lazy=True)


# --- introspection ------------------------------------------------------------------------------


def test_active_patches_reports_target_and_origin_line(mod):
    p = layerswap.patch(f"{mod.__name__}:VALUE", "x")
    line = sys._getframe().f_lineno + 1
    p.start()
    try:
        (info,) = layerswap.active_patches()
        assert info.target == f"{mod.__name__}:VALUE"
        assert info.origin.endswith(f"test_patch.py:{line} in {sys._getframe().f_code.co_name}")
        assert info.started_with_start and info.patch is p
        assert f"test_patch.py:{line}" in repr(p)
    finally:
        p.stop()
    assert layerswap.active_patches() == []


def test_start_with_an_origin_reports_it_and_counts_as_started_with_start(mod):
    # what a helper that starts patches on its caller's behalf (the pytest fixture) does
    p = layerswap.patch(mod, "VALUE", "x").start(origin=("user_code.py", 7, "test_it"))
    (info,) = layerswap.active_patches()
    assert info.patch is p and info.origin == "user_code.py:7 in test_it"
    assert info.started_with_start
    assert "started at user_code.py:7 in test_it" in repr(p)
    with pytest.raises(PatchStateError, match=r"already started.*user_code\.py:7"):
        p.start(origin=("elsewhere.py", 1, "f"))
    assert layerswap.restore_all() == 1
    assert mod.VALUE == "original" and p.origin is None


def test_restore_all_stops_started_patches_lifo_and_leaves_with_blocks(mod):
    with layerswap.patch(mod, "greet", lambda: "with"):
        layerswap.patch(mod, "VALUE", "a").start()
        layerswap.patch(mod, "VALUE", "b").start()
        assert layerswap.restore_all() == 2
        assert mod.VALUE == "original"
        assert mod.greet() == "with"
    assert mod.greet() == "hello"


# --- context scope ----------------------------------------------------------------------------------


def test_context_scope_is_invisible_to_other_threads(mod):
    seen = {}

    def other():
        seen["other"] = mod.greet()

    with layerswap.patch(mod, "greet", lambda: "mine", scope="context"):
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert mod.greet() == "mine"
    assert seen["other"] == "hello"
    assert mod.greet() == "hello"


def test_context_scope_is_per_asyncio_task(mod):
    async def patched():
        with layerswap.patch(mod.Base, "method", lambda self: "task-a", scope="context"):
            await asyncio.sleep(0.01)
            return mod.Base().method()

    async def plain():
        await asyncio.sleep(0.005)
        return mod.Base().method()

    async def main():
        return await asyncio.gather(patched(), plain())

    assert asyncio.run(main()) == ["task-a", "base-method"]
    assert mod.Base().method() == "base-method"


def test_context_scope_rejects_non_callables(mod):
    with pytest.raises(TargetTypeError, match="functions and methods"):
        layerswap.patch(mod, "VALUE", "x", scope="context").start()
    assert mod.VALUE == "original"


# --- regressions: objects that decide where values live, lazy races, key spaces -------------


def test_object_with_its_own_setattr_is_patched_through_it():
    from transformers import GPT2Config

    config = GPT2Config()  # hidden_size is an attribute_map alias of n_embd
    with layerswap.patch(config, "hidden_size", 99):
        assert config.hidden_size == 99 and config.n_embd == 99
    assert config.hidden_size == 768 and config.n_embd == 768
    assert "hidden_size" not in vars(config)


def test_unset_slot_member_needs_create_and_is_unset_again_after():
    class Slotted:
        __slots__ = ("x",)

    obj = Slotted()
    with pytest.raises(TargetAttributeError, match="create=True"):
        layerswap.patch(obj, "x", 1).start()
    with layerswap.patch(obj, "x", 1, create=True):
        assert obj.x == 1
    assert not hasattr(obj, "x")


def test_new_child_module_created_on_a_module_is_registered_then_removed():
    model = torch.nn.Sequential(torch.nn.Linear(1, 1))
    extra = torch.nn.Linear(1, 1)
    with layerswap.patch(model, "extra", extra, create=True):
        assert dict(model.named_children())["extra"] is extra
    assert "extra" not in dict(model.named_children()) and not hasattr(model, "extra")


def test_dict_item_and_attribute_of_the_same_name_are_separate_places():
    class Record(dict):
        pass

    record = Record(a="item")
    record.a = "attribute"
    with layerswap.patch_dict(record, {"a": "item2"}), layerswap.patch(record, "a", "attr2"):
        assert (record["a"], record.a) == ("item2", "attr2")
    assert (record["a"], record.a) == ("item", "attribute")


def test_foreign_write_under_a_later_patch_still_warns(mod):
    first = layerswap.patch(mod, "VALUE", "first").start()
    mod.VALUE = "foreign"
    second = layerswap.patch(mod, "VALUE", "second").start()
    with pytest.warns(PatchConflictWarning, match="'foreign'") as seen:
        second.stop()
        first.stop()
    assert len(seen) == 1
    assert mod.VALUE == "original"


def test_context_scope_accepts_a_classmethod_replacement(mod):
    with layerswap.patch(mod.Base, "klass", classmethod(lambda cls: "ctx"), scope="context"):
        assert mod.Child.klass() == "ctx"
    assert mod.Child.klass() == "Child"


def test_warning_turned_error_does_not_replace_the_blocks_exception(mod):
    with warnings.catch_warnings():
        warnings.simplefilter("error", PatchConflictWarning)
        with pytest.raises(KeyboardInterrupt), layerswap.patch(mod, "VALUE", "x"):
            mod.VALUE = "foreign"
            raise KeyboardInterrupt
    assert mod.VALUE == "original"


def test_lazy_patch_that_cannot_apply_lets_the_import_succeed_and_warns(make_module):
    from layerswap.errors import LazyPatchWarning

    name = make_module("lazy_missing", "OTHER = 1\n")
    p = layerswap.patch(f"{name}:MISSING", "x", lazy=True).start()
    with pytest.warns(LazyPatchWarning, match="MISSING"):
        module = __import__(name)
    assert module.OTHER == 1 and not hasattr(module, "MISSING")
    assert not p.is_active and layerswap.active_patches() == []
    p.stop()  # a no-op


def test_lazy_patch_stopped_while_its_import_hook_runs_is_undone(make_module):
    entered, release = threading.Event(), threading.Event()
    name = make_module(
        "lazy_race",
        """
        import sys

        class Slow:
            attr = "original"

        def __getattr__(name):  # the hook resolves "Gate.attr": block it halfway
            if name == "Gate":
                sys.modules["ls_race_events"][0].set()
                sys.modules["ls_race_events"][1].wait(5)
                return Slow
            raise AttributeError(name)
        """,
    )
    sys.modules["ls_race_events"] = (entered, release)  # type: ignore[assignment]
    try:
        p = layerswap.patch(f"{name}:Gate.attr", "patched", lazy=True).start()
        importer = threading.Thread(target=__import__, args=(name,))
        importer.start()
        assert entered.wait(5)
        stopper = threading.Thread(target=p.stop)
        stopper.start()  # waits for the hook, then undoes what it applied
        release.set()
        importer.join(5)
        stopper.join(5)
        assert sys.modules[name].Slow.attr == "original"
        assert layerswap.active_patches() == []
    finally:
        sys.modules.pop("ls_race_events", None)


def test_the_decorator_above_a_staticmethod_or_classmethod_keeps_its_binding(mod):
    """``@patch`` written above ``@staticmethod``: called through an instance it takes
    no instance, and an async one runs patched (the patch lasts while it runs)."""

    class Tool:
        @layerswap.patch(mod, "VALUE", "patched")
        @staticmethod
        def read():
            return mod.VALUE

        @layerswap.patch(mod, "VALUE", "patched")
        @staticmethod
        async def read_later():
            await asyncio.sleep(0)
            return mod.VALUE

        @layerswap.patch(mod, "VALUE", "patched")
        @classmethod
        def owner(cls):
            return cls, mod.VALUE

    before = mod.VALUE
    assert Tool.read() == "patched" and Tool().read() == "patched"
    assert asyncio.run(Tool.read_later()) == "patched"
    assert Tool().owner() == (Tool, "patched")
    assert before == mod.VALUE


@pytest.mark.parametrize("stops", list(itertools.permutations(range(3))))
def test_children_and_parameters_come_back_in_order_whatever_order_the_patches_stop(stops):
    """Children (and parameters) replaced by values of another kind leave the module's
    containers; they go back where they sat, whichever left first and returns first."""
    model = torch.nn.Sequential()
    for name in "abcd":
        model.add_module(name, torch.nn.Linear(1, 1))
    children = dict(model.named_children())
    linear = model.a
    params = dict(linear.named_parameters())
    patches = [layerswap.patch(model, name, lambda x: x) for name in "abc"]
    patches += [layerswap.patch(linear, "weight", torch.zeros(1, 1))]
    for p in patches:
        p.start()
    assert list(model._modules) == ["d"]
    for index in stops:
        patches[index].stop()
    patches[3].stop()
    assert list(model._modules) == list("abcd")
    assert all(model._modules[name] is child for name, child in children.items())
    assert list(linear._parameters) == ["weight", "bias"]
    assert all(linear._parameters[n] is p for n, p in params.items())


def test_a_child_moved_by_a_foreign_write_goes_back_where_it_sat():
    model = torch.nn.Sequential()
    for name in "abc":
        model.add_module(name, torch.nn.Identity())
    original = model.a
    with pytest.warns(PatchConflictWarning), layerswap.patch(model, "a", lambda x: x):
        del model.__dict__["a"]
        model.a = torch.nn.ReLU()  # registered anew: at the end
    assert list(model._modules) == ["a", "b", "c"] and model.a is original


def test_readers_never_see_a_module_without_its_children_while_patches_come_and_go():
    model = torch.nn.Sequential()
    for index in range(50):
        model.add_module(f"l{index}", torch.nn.Identity())
    done, missing = threading.Event(), []

    def read() -> None:
        while not done.is_set():
            if not hasattr(model, "l49"):
                missing.append(1)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(2000):
            with layerswap.patch(model, "l0", lambda x: x):
                pass
    finally:
        done.set()
        reader.join()
    assert missing == [] and next(iter(model._modules)) == "l0"


def test_unpatched_sees_past_a_patch_of_an_inherited_attribute():
    from layerswap.patching.stack import unpatched

    class Base:
        def method(self):
            return "base"

    class Child(Base):
        pass

    child = Child()
    with layerswap.patch(Child, "method", lambda self: "new", create=True):
        assert unpatched(Child, "method") is Base.method
    with layerswap.patch(child, "method", lambda: "new", create=True):
        assert unpatched(child, "method")() == "base"
