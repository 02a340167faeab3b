"""Configs written by `simpletuner configure` (config/config.json + config/multidatabackend.json in the server's
working dir) show up on the server and import as they are."""

from __future__ import annotations

import json
import subprocess
import sys


def test_a_wizard_config_imports_as_it_is(client, workdir):
    wizard = subprocess.run(
        [sys.executable, "-m", "simpletuner.cli", "configure", "--family", "flux", "--flavour", "tiny", "--steps",
         "3", "--data", "imgs", "--caption-strategy", "textfile", "--resolution", "64", "--output-dir", "out",
         "--yes"], cwd=workdir, capture_output=True, text=True, timeout=120)
    assert wizard.returncode == 0, wizard.stdout + wizard.stderr
    files = client.get("/api/configs/files").json()
    assert [(f["path"], f["suggested_name"]) for f in files] == [("config/config.json", "config")]
    r = client.post("/api/configs/import", json={"name": "from-wizard", "path": "config/config.json"})
    assert r.status_code == 201, r.text
    latest = client.get("/api/configs/from-wizard").json()["latest"]
    assert latest["train_config"]["max_train_steps"] == 3 and latest["comment"] == "imported from config/config.json"
    assert latest["data_backends"][0]["instance_data_dir"] == "imgs"  # read from its multidatabackend.json
    assert [c["name"] for c in client.get("/api/configs").json()] == ["from-wizard"]

    # beside it, without data_backend_config, as SimpleTuner users keep them
    config = json.loads((workdir / "config" / "config.json").read_text())
    del config["data_backend_config"]
    (workdir / "config" / "config.json").write_text(json.dumps({f"--{k}": v for k, v in config.items()}))
    r = client.post("/api/configs/import", json={"name": "beside", "path": "config/config.json"})
    assert r.status_code == 201, r.text
    assert client.get("/api/configs/beside").json()["latest"]["data_backends"][0]["id"] == "imgs"

    bad = client.post("/api/configs/import", json={"name": "etc", "path": "/etc/passwd"})
    assert bad.status_code == 422 and bad.json()["errors"][0]["path"] == "path"
    missing = client.post("/api/configs/import", json={"name": "nope", "path": "config/none.json"})
    assert missing.status_code == 422 and "not found" in missing.json()["errors"][0]["message"]
