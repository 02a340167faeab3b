"""The layer table of DESIGN.md holds: every import in every module (including imports inside functions) points
down the table, the config layer is pure pydantic, and the server never imports the ML stack.

    config (pydantic only) <- models, data <- evaluation (models) <- training (recipes) <- interface (cli)
    config, webui <- server (never torch);  webui imports nothing of ours
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# layer -> the simpletuner layers it may import (itself always allowed)
ALLOWED = {
    "config": set(),
    "models": {"config"},
    "data": {"config"},
    "evaluation": {"models", "config"},
    "training": {"models", "data", "evaluation", "config"},
    "server": {"config", "webui"},  # it serves the front end's files
    "interface": {"config", "models", "data", "evaluation", "training", "server"},
    "webui": set(),
}
# third-party packages a layer may not import at all
ML_STACK = {"torch", "diffusers", "transformers", "accelerate", "peft", "optimum", "safetensors", "lycoris",
            "bitsandbytes", "torchvision", "torchao", "numpy", "PIL", "av"}
CONFIG_THIRD_PARTY = {"pydantic", "pydantic_core"}


def layer_of(module: str) -> str | None:
    """``simpletuner.models.flux`` -> ``models``; the package root and its entry points are the interface."""
    parts = module.split(".")
    if parts[0] == "webui":
        return "webui"
    if parts[0] != "simpletuner":
        return None
    if len(parts) == 1 or parts[1] in ("cli", "train", "__main__"):
        return "interface"
    return parts[1] if parts[1] in ALLOWED else "interface"


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path, root: Path) -> list[tuple[int, str]]:
    """Every (line, absolute module) ``path`` imports, anywhere in the file."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
                found += [(node.lineno, n) for n in names]
            else:
                found.append((node.lineno, node.module or ""))
    return found


def violations(root: Path) -> list[str]:
    """``file:line: layer imports module`` for every import that breaks the table under ``root``."""
    out = []
    files = sorted((root / "simpletuner").rglob("*.py")) + sorted((root / "webui").rglob("*.py"))
    for path in files:
        layer = layer_of(module_name(path, root))
        for line, target in imports_of(path, root):
            top = target.split(".")[0]
            where = f"{path.relative_to(root)}:{line}"
            target_layer = layer_of(target)
            if target_layer is not None and target_layer != layer and target_layer != "interface":
                if target_layer not in ALLOWED[layer]:
                    out.append(f"{where}: {layer} imports {target} ({target_layer})")
            elif target_layer == "interface" and target != "simpletuner" and layer != "interface":
                out.append(f"{where}: {layer} imports the interface module {target}")
            elif target_layer is None and top not in sys.stdlib_module_names and top != "__future__":
                if layer == "config" and top not in CONFIG_THIRD_PARTY:
                    out.append(f"{where}: config imports {target} (the config layer is pure pydantic)")
                if layer in ("server", "webui") and top in ML_STACK:
                    out.append(f"{where}: {layer} imports {target} (it must stay free of the ML stack)")
    return out


def test_the_layer_table_holds():
    assert violations(REPO) == []


def test_the_check_catches_a_bad_import(tmp_path):
    """The scan is not vacuous: a bad import anywhere (top level, inside a function, relative) is reported."""
    for folder in ("simpletuner/models", "simpletuner/server/routes", "simpletuner/config", "simpletuner/training",
                   "webui"):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "simpletuner/__init__.py").write_text("")
    (tmp_path / "simpletuner/models/bad.py").write_text(
        "import torch\n\ndef f():\n    from simpletuner.training import trainer\n    return trainer\n")
    (tmp_path / "simpletuner/server/routes/bad.py").write_text(
        "def g():\n    import torch.nn\n    from ...training.lora import add_lora\n")
    (tmp_path / "simpletuner/config/bad.py").write_text("import numpy\nfrom simpletuner.models import base\n")
    (tmp_path / "simpletuner/training/fine.py").write_text("import torch\nfrom simpletuner.models import base\n")
    found = violations(tmp_path)
    assert found == [
        "simpletuner/config/bad.py:1: config imports numpy (the config layer is pure pydantic)",
        "simpletuner/config/bad.py:2: config imports simpletuner.models (models)",
        "simpletuner/models/bad.py:4: models imports simpletuner.training (training)",
        "simpletuner/server/routes/bad.py:2: server imports torch.nn (it must stay free of the ML stack)",
        "simpletuner/server/routes/bad.py:3: server imports simpletuner.training.lora (training)",
    ]
