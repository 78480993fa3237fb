"""The library (the specsot_mq/ folder) never imports the app layer: stages/, transports/, cli/ and
server/, installed as specsot_mq.stages, specsot_mq.transports, specsot_mq.cli and specsot_mq.server."""

import ast
from pathlib import Path

import pytest

LIBRARY = Path(__file__).parent.parent / "specsot_mq"
APP = ("stages", "transports", "cli", "server")


def app_imports(source: str) -> list[str]:
    """The modules of the app layer that `source` imports (at any depth: in functions too)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            # `from specsot_mq import cli` and `from . import stages` name the package in the aliases.
            names = [module] + [f"{module}.{alias.name}" for alias in node.names]
            if node.level:
                names += [alias.name for alias in node.names] + [module]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if (parts[0] == "specsot_mq" and len(parts) > 1 and parts[1] in APP) or parts[0] in APP:
                found.append(name)
    return found


@pytest.mark.parametrize(
    "source, bad",
    [
        ("from specsot_mq.stages.base import RunSpec", True),
        ("def f():\n    from specsot_mq.transports import TOPOLOGIES", True),
        ("import specsot_mq.cli.app", True),
        ("from specsot_mq import stages", True),
        ("from .stages import base", True),
        ("from specsot_mq.sot.engine import SoTEngine", False),
        ("from specsot_mq import messages", False),
    ],
)
def test_app_imports_are_found_in_any_form(source, bad):
    assert bool(app_imports(source)) == bad


def test_the_library_never_imports_the_app_layer():
    files = sorted(LIBRARY.rglob("*.py"))
    assert files
    offenders = {str(p.relative_to(LIBRARY)): found for p in files if (found := app_imports(p.read_text()))}
    assert offenders == {}


LEAN = ["specsot_mq.stages.gateway", "specsot_mq.stages.parse", "specsot_mq.stages.schedule", "specsot_mq.stages.merge"]


@pytest.mark.parametrize("module", LEAN)
def test_the_stages_without_a_model_never_import_torch_or_transformers(module):
    """Each in a fresh interpreter, with what its start() imports (the model's folder, the tokenizer)."""
    import subprocess
    import sys

    code = (f"import sys, {module}, specsot_mq.pull, specsot_mq.tokenizer; "
            "print(' '.join(sorted({'torch', 'transformers'} & set(sys.modules))))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"{module} imported {out.stdout.strip()}"


def test_loading_a_model_imports_neither_torch_compile_nor_transformers(default_model_dir):
    """A device stage's load (model, draft head, tokenizer) leaves out torch._dynamo, which a meta-device
    module's random init imports (torch's compiler stack, resident from then on), sympy, which a
    meta-device arange imports (a slower start: benchmarks/startup.py), and transformers."""
    import subprocess
    import sys

    code = (f"import sys; from specsot_mq.loader import load_generator; load_generator({str(default_model_dir)!r}); "
            "print(' '.join(sorted({'torch._dynamo', 'sympy', 'transformers'} & set(sys.modules))))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"loading a model imported {out.stdout.strip()}"
