"""Backends as declarations: the registry derives family x slot x backend from them."""

from __future__ import annotations

import dataclasses
import importlib
import runpy
from pathlib import Path

import pytest
import torch
from fresh import run_json

import layerswap
from layerswap import Backend, Implementation, Variant
from layerswap.backends import fused
from layerswap.errors import SubstitutionError, UnknownBackendError, UnsupportedFamilyError
from layerswap.registry import unregister_backend, unregister_family
from layerswap.weights import Converter

ROOT = Path(__file__).resolve().parent.parent


def _identity(family: layerswap.Family) -> Converter:
    return Converter()


def _only_llama(family: layerswap.Family) -> str | None:
    return None if family.name.startswith("llama") else "this backend knows llama only"


MINE = Backend(
    name="mine",
    description="the fused layer under another name",
    slots={
        "decoder": Implementation(
            replacement=fused.layer_class, converter=fused.converter_for, supports=_only_llama
        )
    },
)


@pytest.fixture
def mine() -> Backend:
    added = layerswap.register_backend(MINE)
    yield MINE
    unregister_backend("mine")
    assert not [s for s in added if s.name in {x.name for x in layerswap.substitutions()}]


def test_the_builtin_backends_are_declared() -> None:
    assert {"fused", "te", "liger"} <= set(layerswap.backends())
    te = layerswap.get_backend("te")
    assert te.names() == ("te", "te_fp8")
    assert set(layerswap.get_backend("fused").slots) == {
        "decoder",
        "head",
        "norm",
        "mlp",
        "experts",
        "qkv",
        "rotary",
    }
    assert layerswap.get_backend("liger").devices == ("cuda",)


def test_every_builtin_substitution_is_derived_from_a_declaration() -> None:
    for sub in layerswap.substitutions():
        backend = layerswap.registry.backend_of(sub)
        assert backend is not None, sub.name
        family = layerswap.get_family(sub.family)
        variant = sub.backend.removeprefix(backend.name).removeprefix("_") or None
        assert backend.substitution(family, sub.slot, variant=variant) == sub


def test_a_backend_registered_later_covers_every_family_it_supports(mine: Backend) -> None:
    names = {s.name for s in layerswap.substitutions(backend="mine")}
    assert names == {"llama.decoder.mine"}
    report = layerswap.verify(layerswap.get_family("llama").build(), "llama.decoder.mine")
    assert report.passed


def test_a_family_registered_later_gets_every_backends_substitutions(mine: Backend) -> None:
    later = dataclasses.replace(layerswap.get_family("llama"), name="llama-later")
    try:
        added = {s.name for s in layerswap.register_family(later)}
        assert {"llama-later.decoder.fused", "llama-later.head.fused"} <= added
        assert "llama-later.decoder.mine" in added
        assert {"llama-later.decoder.te", "llama-later.decoder.te_fp8"} <= added
    finally:
        unregister_family("llama-later")
    assert layerswap.substitutions(family="llama-later") == []


def test_an_unsupported_family_is_refused_with_the_backends_reason(mine: Backend) -> None:
    qwen3 = layerswap.get_family("qwen3")
    assert mine.unsupported(qwen3) == "this backend knows llama only"
    with pytest.raises(UnsupportedFamilyError, match=r"qwen3\.decoder\.mine: this backend knows"):
        mine.substitution(qwen3)
    assert mine.unsupported(qwen3, "head") == "the mine backend has no head implementation"


def test_unknown_backend_names_close_ones() -> None:
    with pytest.raises(UnknownBackendError, match="did you mean 'fused'") as caught:
        layerswap.get_backend("fusd")
    assert isinstance(caught.value, LookupError)


def test_registering_a_different_backend_under_a_taken_name_changes_nothing(mine: Backend) -> None:
    before = layerswap.substitutions()
    other = dataclasses.replace(MINE, description="another")
    with pytest.raises(SubstitutionError, match="already registered as 'mine'"):
        layerswap.register_backend(other)
    assert layerswap.substitutions() == before
    assert layerswap.get_backend("mine") is MINE


def test_a_backend_whose_names_clash_with_a_variant_is_refused() -> None:
    clash = dataclasses.replace(MINE, name="te_fp8")
    before = layerswap.substitutions()
    with pytest.raises(SubstitutionError, match="'te_fp8', which the 'te' backend names"):
        layerswap.register_backend(clash)
    assert layerswap.substitutions() == before


def test_a_declaration_with_an_unknown_slot_or_variant_slot_is_refused() -> None:
    implementation = MINE.slots["decoder"]
    with pytest.raises(SubstitutionError, match="unknown slots \\['tail'\\]"):
        Backend(name="bad", slots={"tail": implementation})
    with pytest.raises(SubstitutionError, match="names slots \\['head'\\]"):
        Backend(
            name="bad",
            slots={"decoder": implementation},
            variants=(Variant(name="v", context=torch.no_grad, slots=("head",)),),
        )


def test_a_variant_is_a_forward_context_with_options_on_the_same_layers() -> None:
    base = layerswap.get("llama.decoder.te")
    fp8 = layerswap.get("llama.decoder.te_fp8")
    assert (fp8.replacement, fp8.converter) == (base.replacement, base.converter)
    assert fp8.variant is not None and fp8.variant.options == {"recipe": "auto"}
    assert fp8.precision == "fp8" and base.precision is None
    delayed = fp8.with_options(recipe="delayed")
    assert delayed.variant is not None and delayed.variant.options == {"recipe": "delayed"}
    assert fp8.variant.options == {"recipe": "auto"}  # derived, not changed
    with pytest.raises(SubstitutionError, match="has no option 'recipes'"):
        fp8.with_options(recipes="delayed")
    with pytest.raises(SubstitutionError, match="has no variant"):
        base.with_options(recipe="delayed")


def test_a_variant_context_is_entered_around_the_forward() -> None:
    entered: list[dict[str, object]] = []

    class Context:
        def __init__(self, **options: object) -> None:
            self.options = options

        def __enter__(self) -> None:
            entered.append(self.options)

        def __exit__(self, *exc: object) -> None:
            return None

    counted = dataclasses.replace(
        MINE, name="counted", variants=(Variant(name="ctx", context=Context, options={"n": 1}),)
    )
    sub = counted.substitution(layerswap.get_family("llama"), variant="ctx")
    assert sub.name == "llama.decoder.counted_ctx" and sub.backend == "counted_ctx"
    report = layerswap.verify(layerswap.get_family("llama").build(), sub)
    assert report.passed and {"n": 1} in entered


def test_the_import_graph_has_no_cycles_and_no_private_reaches() -> None:
    graph = runpy.run_path(str(ROOT / "scripts" / "module_graph.py"))
    edges, private = graph["graph"]()
    assert graph["cycles"](edges) == []
    assert private == []
    # the script sees a cycle when there is one
    assert graph["cycles"]({"a": {"b"}, "b": {"a"}}) == [["a", "b"]]
    # the families sit below the registry: no chain of imports reaches it from them
    assert graph["layering"](edges) == []
    upward = {
        "layerswap.families.x": {"layerswap.family", "layerswap.verify"},
        "layerswap.verify": {"layerswap.registry"},
    }
    assert graph["layering"](upward) == [
        ("layerswap.families.x", ["layerswap.families.x", "layerswap.verify", "layerswap.registry"])
    ]


def test_no_hand_written_module_or_function_outgrows_its_size(tmp_path: Path) -> None:
    """No module of the package is over 600 lines, and no function over 80; a generated
    module (the inferred families' data) is its data's size."""
    graph = runpy.run_path(str(ROOT / "scripts" / "module_graph.py"))
    assert graph["oversized"](graph["modules"]()) == []
    package = tmp_path / "layerswap"
    package.mkdir()
    (package / "__init__.py").write_text("")
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    (package / "long.py").write_text(f"def f():\n{body}")
    (package / "data.py").write_text('"""Rows (generated: do not edit)."""\n' + "x = 1\n" * 700)
    (package / "big.py").write_text("x = 1\n" * 601)
    assert graph["oversized"](graph["modules"](package)) == [
        "layerswap.big (601 lines)",
        "layerswap.long.f (81 lines)",
    ]


def test_no_cycle_runs_through_the_imports_written_for_type_checkers(tmp_path: Path) -> None:
    """Types that name each other (a substitution and its slot) live in one module: an
    import under ``if TYPE_CHECKING:`` that closes a circle is a cycle the check reports,
    but a package naming its own submodules' exports for type checkers is not."""
    graph = runpy.run_path(str(ROOT / "scripts" / "module_graph.py"))
    known = graph["modules"]()
    edges, _ = graph["graph"](known)
    assert graph["cycles"](graph["_typed_edges"](known, edges)) == []
    package = tmp_path / "layerswap"
    (package / "face").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from layerswap.{} import X\n"
    (package / "a.py").write_text("from layerswap.b import Y\n")
    (package / "b.py").write_text(typed.format("a"))
    (package / "face" / "__init__.py").write_text(typed.format("face.inner"))
    (package / "face" / "inner.py").write_text("from layerswap.a import Z\nimport layerswap.face\n")
    known = graph["modules"](package)
    edges, _ = graph["graph"](known)
    assert graph["cycles"](edges) == []
    assert graph["cycles"](graph["_typed_edges"](known, edges)) == [["layerswap.a", "layerswap.b"]]
    assert graph["main"](["--check", "--root", str(package)]) == 1


@pytest.mark.parametrize(
    ("former", "now"),
    [
        ("layerswap.backends.head_fused", "layerswap.backends.fused.head"),
        ("layerswap.backends.head_liger", "layerswap.backends.liger.head"),
        ("layerswap.backends.liger_runtime", "layerswap.backends.liger.runtime"),
        ("layerswap.backends.te_runtime", "layerswap.backends.te.runtime"),
        ("layerswap.backends.te_layout", "layerswap.backends.te.layout"),
        ("layerswap.backends.declarations.fused", "layerswap.backends.fused.declaration"),
        ("layerswap.backends.declarations.liger", "layerswap.backends.liger.declaration"),
        ("layerswap.backends.declarations.te", "layerswap.backends.te.declaration"),
    ],
)
def test_a_builtin_backends_module_imports_under_its_former_name(former: str, now: str) -> None:
    assert importlib.import_module(former) is importlib.import_module(now)


def test_a_backends_package_gives_its_modules_names() -> None:
    from layerswap.backends import liger, te
    from layerswap.backends.fused import FusedLlamaDecoderLayer, converter_for, declaration
    from layerswap.backends.fused.decoder import layer_class

    assert FusedLlamaDecoderLayer is layer_class(layerswap.get_family("llama"))
    assert converter_for is fused.decoder.converter_for and fused.BACKEND is declaration.BACKEND
    assert liger.unsupported is liger.declaration.unsupported
    assert te.fp8_autocast is te.runtime.fp8_autocast
    with pytest.raises(AttributeError, match="NoSuchName"):
        fused.NoSuchName  # noqa: B018


@pytest.mark.slow  # a fresh interpreter
def test_a_backends_declaration_is_read_through_its_package_without_torch(
    tmp_path: Path,
) -> None:
    found = run_json(
        """
        import json, sys
        from layerswap.backends import fused, liger, te
        from layerswap.backends.declarations import te as former
        reasons = [liger.unsupported.__name__, te.unexpressible.__name__, former.BACKEND.name]
        print(json.dumps([fused.BACKEND.name, *reasons, "torch" in sys.modules]))
        """,
        tmp_path,
    )
    assert found == ["fused", "unsupported", "unexpressible", "te", False]


def test_a_private_module_is_its_folders_and_its_subfolders_alone(tmp_path: Path) -> None:
    """A backend's package uses the backends' shared ``_layer``; a sibling folder's private
    module is a private reach."""
    graph = runpy.run_path(str(ROOT / "scripts" / "module_graph.py"))
    package = tmp_path / "layerswap"
    for folder in ("shared", "shared/one", "other"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "shared" / "_base.py").write_text("")
    (package / "shared" / "one" / "_own.py").write_text("")
    (package / "shared" / "one" / "layer.py").write_text(
        "from layerswap.shared import _base\nfrom layerswap.shared.one import _own\n"
    )
    (package / "other" / "layer.py").write_text("from layerswap.shared import _base\n")
    (package / "shared" / "user.py").write_text("from layerswap.shared.one import _own\n")
    _, private = graph["graph"](graph["modules"](package))
    assert sorted(private) == [
        ("layerswap.other.layer", "layerswap.shared", "_base"),
        ("layerswap.shared.user", "layerswap.shared.one", "_own"),
    ]


def test_every_module_named_for_a_later_import_exists(tmp_path: Path) -> None:
    """A declaration names its layers by string (``Lazy("layerswap.backends.fused.decoder:...")``),
    imported when called; the graph counts those names and each must resolve, or a
    renamed function would surface only when a user first asks for the substitution."""
    graph = runpy.run_path(str(ROOT / "scripts" / "module_graph.py"))
    targets = graph["named_targets"]()
    assert (
        "layerswap.backends.fused.decoder:layer_class"
        in targets["layerswap.backends.fused.declaration"]
    )
    assert graph["unresolved"](targets, graph["modules"]()) == []
    package = tmp_path / "layerswap"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def made(): ...\n")
    (package / "b.py").write_text(
        'Lazy("layerswap.a:made")\nLazy("layerswap.a:gone")\nimport_module("layerswap.c")\n'
    )
    known = graph["modules"](package)
    assert graph["unresolved"](graph["named_targets"](known), known) == [
        ("layerswap.b", "layerswap.a:gone"),
        ("layerswap.b", "layerswap.c"),
    ]


@pytest.mark.slow  # a fresh interpreter
def test_a_layer_of_a_family_nobody_registered_loads_from_a_pickle_in_a_fresh_process(
    tmp_path: Path,
) -> None:
    """A per-family class is pickled as its recipe (backends.per_family): the factory, the
    base and the family's declaration, so a process where the family is not registered
    makes the class again, holding the layer's weights."""
    import subprocess
    import sys

    family = dataclasses.replace(layerswap.get_family("llama"), name="llama_pickled")
    config = family.tiny_config()
    torch.manual_seed(0)
    layer = fused.layer_class(family)(config, 0).eval()
    state = {key: value.clone() for key, value in layer.state_dict().items()}
    torch.save({"layer": layer, "state": state}, tmp_path / "layer.pt")
    script = (
        "import torch, layerswap\n"
        f"saved = torch.load(r'{tmp_path / 'layer.pt'}', weights_only=False)\n"
        "layer = saved['layer']\n"
        "assert 'llama_pickled' not in layerswap.families()\n"
        "assert type(layer).__qualname__ == 'FusedLlamaPickledDecoderLayer'\n"
        "assert type(layer).family.name == 'llama_pickled'\n"
        "held = layer.state_dict()\n"
        "print(held.keys() == saved['state'].keys()"
        " and all(torch.equal(held[k], v) for k, v in saved['state'].items()))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


@pytest.mark.slow  # a fresh interpreter
def test_a_head_class_imported_by_its_name_first_is_made_from_the_registrys_family(
    tmp_path: Path,
) -> None:
    """The head slot names its classes (``FusedLlamaForCausalLM``); the backends import
    nothing above them, so the registry gives them its families when it loads, and an
    import of the class by name before anything loaded the registry loads it then."""
    found = run_json(
        """
        import json, sys
        before = "layerswap.registry" in sys.modules
        from layerswap.backends.head_fused import FusedLlamaForCausalLM as made
        from transformers import LlamaForCausalLM
        print(json.dumps([before, made.__qualname__, issubclass(made, LlamaForCausalLM)]))
        """,
        tmp_path,
    )
    assert found == [False, "FusedLlamaForCausalLM", True]


def test_two_threads_making_a_familys_classes_get_the_same_ones() -> None:
    """Per-family classes are made once (backends.per_family): two threads swapping the
    same new family at once get one layer class and one head class, as a pickle names."""
    import threading

    from layerswap.backends._layer import family_layer_class
    from layerswap.backends.head import head_class
    from layerswap.backends.head_fused import FusedHead

    family = dataclasses.replace(layerswap.get_family("llama"), name="llama_threads")
    start = threading.Barrier(8)
    made: list[tuple[type, type]] = []

    def make() -> None:
        start.wait()
        made.append(
            (family_layer_class(fused.FusedDecoderLayer, family), head_class(FusedHead, family))
        )

    threads = [threading.Thread(target=make) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(made) == 8 and len(set(made)) == 1
    layer, head = made[0]
    assert layer.__qualname__ == "FusedLlamaThreadsDecoderLayer"
    assert fused.FusedLlamaThreadsDecoderLayer is layer  # set in its module, by its name
    assert head.__qualname__ == "FusedLlamaForCausalLM" and head.__name__ == "LlamaForCausalLM"


def test_a_gpu_backends_requirements_are_asked_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from layerswap.backends._runtime import GpuPackage

    def hint(error: BaseException) -> str:
        return " (try this)"

    package = GpuPackage(
        distribution="json",
        kernels="json.no_such_kernels",
        not_installed="not installed",
        no_cuda="needs CUDA",
        broken="installed but broken",
        hint=hint,
    )
    missing = GpuPackage("no_such_package_here", "x", "not installed", "needs CUDA", "broken")
    assert missing.unmet_requirement() == "not installed"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert package.unmet_requirement() == "needs CUDA"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    reason = package.unmet_requirement()
    assert reason is not None
    assert reason.startswith("installed but broken: No module named") and reason.endswith(
        "(try this)"
    )
    good = GpuPackage("json", "json.decoder", "not installed", "needs CUDA", "broken")
    assert good.unmet_requirement() is None
