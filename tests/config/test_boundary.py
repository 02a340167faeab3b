"""The config layer imports only the standard library, pydantic and itself (DESIGN.md: layers import down)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import simpletuner.config

PACKAGE = Path(simpletuner.config.__file__).parent
ALLOWED = {"pydantic", "pydantic_core"}


def test_config_imports_only_stdlib_and_pydantic():
    offenders = []
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules = [node.module or ""]
            else:
                continue  # relative imports stay inside the package
            for module in modules:
                top = module.split(".")[0]
                if module.startswith("simpletuner.config") or top == "__future__":
                    continue
                if top not in ALLOWED and top not in sys.stdlib_module_names:
                    offenders.append(f"{path.name}: {module}")
    assert offenders == []
