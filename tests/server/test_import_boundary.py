"""The server process never imports torch/diffusers/transformers (checked at run time; tests/test_layers.py checks
every import statically).

The probe records every *attempt* to import a heavy package (a finder placed first on ``sys.meta_path``), so the
check means the same whether or not the ML stack is installed: on a machine without torch, a server module that
tries ``import torch`` (even inside ``try: ... except ImportError``) is still caught.
"""

import subprocess
import sys

import pytest

HEAVY = ("torch", "diffusers", "transformers", "accelerate", "peft")

_RECORDER = """
import sys
_heavy = set({heavy!r})
_attempted = []

class _Recorder:
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in _heavy:
            if top not in _attempted:
                _attempted.append(top)
            if {missing!r}:  # behave as a machine without the ML stack
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None  # let the real finders decide

sys.meta_path.insert(0, _Recorder())
try:
{code}
finally:
    print("HEAVY:" + ",".join(sorted(_attempted)))
"""


def _attempted_after(code: str, *, missing: bool = False) -> list[str]:
    """The heavy top-level packages ``code`` tried to import; with ``missing`` every such import fails as it would
    on a machine without the ML stack."""
    body = "\n".join("    " + line for line in code.strip().splitlines())
    probe = _RECORDER.format(heavy=HEAVY, code=body, missing=missing)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    line = next(line for line in out.stdout.splitlines() if line.startswith("HEAVY:"))
    return [m for m in line.removeprefix("HEAVY:").split(",") if m]


def test_the_probe_sees_heavy_imports():
    """Control: the probe sees torch & co. once something imports them, so the checks below cannot pass merely
    because the probe is blind."""
    assert set(_attempted_after("import simpletuner.training.trainer")) == set(HEAVY)


def test_the_probe_sees_an_attempt_even_when_the_package_is_missing():
    """Control for a machine without the ML stack: a guarded import of a package that is not there is still seen
    (so the checks below are not trivially true on such a machine)."""
    code = "try:\n    import torch\nexcept ImportError:\n    pass"
    assert _attempted_after(code, missing=True) == ["torch"]


@pytest.mark.parametrize("missing", [False, True], ids=["ml-stack-installed", "ml-stack-missing"])
def test_server_app_imports_no_torch(tmp_path, missing):
    code = (
        "import simpletuner.server.app as a, simpletuner.server.cli, simpletuner.server.client\n"
        "from simpletuner.server.settings import ServerSettings\n"
        f"a.create_app(ServerSettings(data_dir={str(tmp_path)!r}, accelerators=[]))\n"
    )
    assert _attempted_after(code, missing=missing) == []


def test_wire_contract_and_webhook_client_are_torch_free():
    assert _attempted_after("import simpletuner.config.events, simpletuner.training.webhooks") == []
