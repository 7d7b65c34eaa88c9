"""Write the command-line output shown in docs/cli.md and README.md by running it.

A block of shown output is announced by a comment naming the commands::

    <!-- cli: patch --model llama -->
    ```
    $ layerswap patch --model llama
    ...what it printed...
    ```

Commands are separated by ``;;``; each runs in process (``layerswap.cli.main``) with
its stdout and stderr piped, as a user's shell shows them, and a non-zero exit code of a
block's single command is shown with ``echo $?``. ``llama.decoder.broken`` (a
substitution whose layer 2 is 1% off) is registered for the examples of a failing
verification, and the commands run in a temporary directory holding ``my-llama`` (a tiny
bfloat16 checkpoint), two damaged copies of it, ``my-fused-adapter`` (a LoRA adapter
saved by hand under a swapped model's fused names) and ``my_patches.py`` (two hand-written
patch functions for ``verify --adopt``, one of them wrong).

``tests/test_docs.py`` checks that the docs are fresh (``stale``): a block is its fresh
run up to the error figures and cosines its tolerance cannot tell apart, which the
machine's BLAS decides (``shown_output.same_output``); ``cli volatile:`` marks output
with timings or versions, compared with every number masked.

    python scripts/gen_cli_docs.py
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import shlex
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

# the sibling module, whether this runs as a script or by runpy (tests/test_docs.py)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from shown_output import masked, same_output

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PAGES = (ROOT / "docs" / "cli.md", ROOT / "README.md")
MARKER = re.compile(r"<!-- cli( volatile)?: (.+?) -->\n```\n.*?```\n", re.DOTALL)


@contextlib.contextmanager
def broken_substitution() -> Iterator[None]:
    """``llama.decoder.broken`` registered: the fused layer, layer 2's output 1% too large."""
    import layerswap
    from layerswap.registry import unregister

    fused = layerswap.get("llama.decoder.fused")

    class BrokenLayer(fused.replacement_class()):  # type: ignore[misc]
        def __init__(self, config: object, layer_idx: int) -> None:
            super().__init__(config, layer_idx)
            if layer_idx == 2:
                self.self_attn.o_proj.register_forward_hook(lambda m, a, out: out * 1.01)

    broken = dataclasses.replace(
        fused, name="llama.decoder.broken", backend="broken", replacement=BrokenLayer
    )
    layerswap.register(broken)
    try:
        yield
    finally:
        unregister(broken.name)


def checkpoints(directory: Path) -> None:
    """The checkpoints the examples load: ``my-llama`` (bfloat16) and two damaged copies."""
    import torch
    from safetensors.torch import load_file, save_file

    import layerswap

    llama = layerswap.get_family("llama")
    model = llama.build(llama.tiny_config(num_hidden_layers=2), seed=0).to(torch.bfloat16)
    model.save_pretrained(directory / "my-llama")
    for damaged in ("my-llama-missing", "my-llama-truncated"):
        shutil.copytree(directory / "my-llama", directory / damaged)
    weights = directory / "my-llama-missing" / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    truncated = directory / "my-llama-truncated" / "model.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:4096])
    fused_adapter(directory / "my-fused-adapter")
    (directory / "my_patches.py").write_text(PATCHES)


#: the patch functions ``verify --adopt`` is shown with (docs/adopting.md has the same)
PATCHES = """\
import torch
from torch import nn
from transformers.models.llama import modeling_llama


class FastRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        shape = (hidden_states.shape[-1],)
        return nn.functional.rms_norm(hidden_states, shape, self.weight, self.variance_epsilon)


def fast_rms_norm():
    modeling_llama.LlamaRMSNorm = FastRMSNorm


def forgot_epsilon():
    modeling_llama.LlamaRMSNorm = lambda hidden_size, eps=1e-6: FastRMSNorm(hidden_size, 0.1)
"""


def fused_adapter(directory: Path) -> None:
    """A LoRA adapter of a swapped Llama saved by hand under the fused names."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save_file

    import layerswap

    llama = layerswap.get_family("llama")
    model = llama.build(llama.tiny_config(num_hidden_layers=2), seed=0)
    handle = layerswap.swap(model, backend="fused")
    peft_model = get_peft_model(model, LoraConfig(target_modules="all-linear", r=2))
    peft_model.peft_config["default"].save_pretrained(str(directory))
    state = get_peft_model_state_dict(peft_model)
    save_file(
        {k: v.contiguous() for k, v in state.items()}, directory / "adapter_model.safetensors"
    )
    del peft_model, handle


def run(command: str, exit_code: bool = True) -> str:
    """``$ layerswap COMMAND`` and what it prints, as a terminal shows it piped.

    ``COMMAND | grep PATTERN`` keeps the lines of the output that match ``PATTERN``.
    """
    from layerswap.cli import main

    command, _, pattern = command.partition(" | grep ")
    out, err = io.StringIO(), io.StringIO()
    broken = broken_substitution() if "broken" in command else contextlib.nullcontext()
    with broken, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(shlex.split(command))
            code = 0
        except SystemExit as exited:
            code = exited.code if isinstance(exited.code, int) else 0
    printed = out.getvalue() + err.getvalue()
    if pattern:
        kept = [line for line in printed.splitlines() if re.search(pattern.strip("'"), line)]
        printed = "".join(line + "\n" for line in kept)
        command = f"{command} | grep {pattern}"
    shown = f"$ layerswap {command}\n{printed}"
    return shown + (f"$ echo $?\n{code}\n" if code and exit_code and not pattern else "")


def block(commands: str) -> str:
    """The output of ``;;``-separated commands; the exit code only for a single one."""
    several = ";;" in commands
    shown = [run(c.strip(), exit_code=not several) for c in commands.split(";;")]
    return "```\n" + "".join(shown) + "```\n"


def render(pages: tuple[Path, ...] = PAGES) -> dict[Path, str]:
    """Every page with its output blocks regenerated: path -> text."""
    import torch

    from layerswap import verdicts

    # one thread, as in the test suite: float sums come out the same on every machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    here, store = Path.cwd(), os.environ.get("LAYERSWAP_CACHE")
    rendered = {}
    with tempfile.TemporaryDirectory() as workdir:
        checkpoints(Path(workdir))
        # no family proven yet; coverage answers (a minute to compute) shared both ways
        known = verdicts.directory() / "coverage"
        os.environ["LAYERSWAP_CACHE"] = str(Path(workdir) / "proofs")
        here_known = verdicts.directory() / "coverage"
        if known.is_dir():
            shutil.copytree(known, here_known)
        os.chdir(workdir)
        try:
            for page in pages:
                rendered[page] = MARKER.sub(
                    lambda m: f"<!-- cli{m.group(1) or ''}: {m.group(2)} -->\n" + block(m.group(2)),
                    page.read_text(),
                )
        finally:
            if here_known.is_dir():
                shutil.copytree(here_known, known, dirs_exist_ok=True)
            torch.set_num_threads(threads)
            os.chdir(here)
            if store is None:
                os.environ.pop("LAYERSWAP_CACHE", None)
            else:
                os.environ["LAYERSWAP_CACHE"] = store
    return rendered


def stale(rendered: dict[Path, str]) -> list[str]:
    """The blocks whose output differs from a fresh run: up to rounding-level figures,
    volatile ones up to every number."""
    found = []
    for page, fresh in rendered.items():
        shown = {m.group(2): m.group(0) for m in MARKER.finditer(page.read_text())}
        for m in MARKER.finditer(fresh):
            old = shown.get(m.group(2), "")
            same = masked(old) == masked(m.group(0)) if m.group(1) else same_output(old, m.group(0))
            if not same:
                found.append(f"{page.name}: {m.group(2)}")
    return found


if __name__ == "__main__":
    for path, text in render().items():
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
