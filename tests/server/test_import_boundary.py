"""The server process never imports torch/diffusers/transformers (checked at run time; tests/test_layers.py checks
every import statically)."""

import subprocess
import sys

HEAVY = ("torch", "diffusers", "transformers", "accelerate", "peft")


def _loaded_after(code: str) -> list[str]:
    probe = code + f"\nimport sys\nprint(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return [m for m in out.stdout.strip().split(",") if m]


def test_the_probe_sees_heavy_imports():
    """Control: in this environment the probe does see torch & co. once something imports them, so the checks
    below cannot pass merely because the ML stack is missing."""
    assert set(_loaded_after("import simpletuner.training.trainer")) == set(HEAVY)


def test_server_app_imports_no_torch(tmp_path):
    code = (
        "import simpletuner.server.app as a, simpletuner.server.cli, simpletuner.server.client\n"
        "from simpletuner.server.settings import ServerSettings\n"
        f"a.create_app(ServerSettings(data_dir={str(tmp_path)!r}, accelerators=[]))\n"
    )
    assert _loaded_after(code) == []


def test_wire_contract_and_webhook_client_are_torch_free():
    assert _loaded_after("import simpletuner.config.events, simpletuner.training.webhooks") == []
