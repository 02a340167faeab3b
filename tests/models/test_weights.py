"""Weight sources are checked before anything is cached or written, and every failure is one error naming the field,
the id or path, and the fix.

Local folders are checked in-process. Hub repositories are checked by the real Hugging Face client, in a
subprocess whose ``HF_ENDPOINT`` is a small Hub stand-in served over real HTTP here: it answers ``model_info`` and
file downloads as the Hub does, with the Hub's error headers (``X-Error-Code: GatedRepo`` ...).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

import pytest

from simpletuner.models.weights import WeightLoadError, WeightSource, check_weight_sources
from tests.conftest import REPO

SHA = "0123456789abcdef0123456789abcdef01234567"
FLUX_FILES = {  # the layout FluxPipeline loads, with small sizes
    "model_index.json": 10, "scheduler/scheduler_config.json": 10,
    "transformer/config.json": 10, "transformer/diffusion_pytorch_model.safetensors": 100,
    "vae/config.json": 10, "vae/diffusion_pytorch_model.safetensors": 100,
    "text_encoder/config.json": 10, "text_encoder/model.safetensors": 100,
    "text_encoder_2/config.json": 10, "text_encoder_2/model.safetensors": 100,
    "tokenizer/vocab.json": 10, "tokenizer_2/spiece.model": 10,
}
REPOS = {
    "acme/flux": dict(FLUX_FILES),
    "acme/flux-no-vae": {k: v for k, v in FLUX_FILES.items() if not k.startswith("vae/")},
    "acme/flux-huge": {**FLUX_FILES, "transformer/diffusion_pytorch_model.safetensors": 10**16},
    "acme/flux-gated-files": dict(FLUX_FILES),
}


class _Hub(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def _error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _ok(self, body: bytes, content_type: str = "application/octet-stream") -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("ETag", '"etag-%d"' % len(body))
        self.send_header("X-Repo-Commit", SHA)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self):
        parts = unquote(urlparse(self.path).path).strip("/").split("/")
        if parts[:2] == ["api", "models"]:
            repo = "/".join(parts[2:4])
            revision = parts[5] if len(parts) > 5 else "main"
            if repo == "acme/gated":
                return self._error(401, "GatedRepo", "Access to model acme/gated is restricted.")
            if repo not in REPOS:
                return self._error(401, "RepoNotFound", "Repository not found")
            if revision not in ("main", SHA):
                return self._error(404, "RevisionNotFound", "Invalid rev id")
            siblings = [{"rfilename": name, "size": size} for name, size in REPOS[repo].items()]
            return self._ok(json.dumps({"id": repo, "sha": SHA, "siblings": siblings}).encode(), "application/json")
        repo, filename = "/".join(parts[:2]), "/".join(parts[4:])  # owner/name/resolve/<rev>/<file>
        if repo == "acme/flux-gated-files":
            return self._error(403, "GatedRepo", "Access to model acme/flux-gated-files is restricted.")
        if repo not in REPOS or filename not in REPOS[repo]:
            return self._error(404, "EntryNotFound", "Entry not found")
        return self._ok(b"{}")

    do_HEAD = do_GET


@pytest.fixture(scope="module")
def hub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


CHECK = """
import json, sys
import torch
from simpletuner.config import load_train_config
from simpletuner.models.registry import create_adapter
from simpletuner.models.weights import WeightLoadError

out = {}
for repo, revision in json.loads(sys.argv[1]):
    config = load_train_config({"model_family": "flux", "model_flavour": "dev", "pretrained_model_name_or_path": repo,
                                "revision": revision}).config
    try:
        create_adapter(config, device=torch.device("cpu"), weight_dtype=torch.float32).check_weights()
        out[repo] = None
    except WeightLoadError as exc:
        out[repo] = str(exc)
print(json.dumps(out))
"""


def check_on_hub(hub, tmp_path, cases, token=None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub, HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_TELEMETRY="1",
               PYTHONPATH=str(REPO))
    if token:
        env["HF_TOKEN"] = token
    proc = subprocess.run([sys.executable, "-c", CHECK, json.dumps(cases)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_hub_failures_each_name_the_field_the_id_and_the_fix(hub, tmp_path):
    found = check_on_hub(hub, tmp_path, [["acme/flux", None], ["acme/gated", None], ["acme/nope", None],
                                         ["acme/flux-no-vae", None], ["acme/flux-huge", None],
                                         ["acme/flux-gated-files", None]])
    assert found["acme/flux"] is None  # the whole layout is listed and its small files fetched
    assert (tmp_path / "hf" / "hub" / "models--acme--flux" / "snapshots" / SHA / "model_index.json").is_file()
    assert not list((tmp_path / "hf").rglob("diffusion_pytorch_model.safetensors"))  # weights are not downloaded

    assert found["acme/gated"].startswith("pretrained_model_name_or_path: 'acme/gated' is a gated repository and "
                                          "no Hugging Face token is set")
    assert "set HF_TOKEN" in found["acme/gated"]
    assert found["acme/nope"].startswith("pretrained_model_name_or_path: 'acme/nope' is not a repository on the "
                                         "Hugging Face Hub; a private repository needs HF_TOKEN")
    assert found["acme/flux-no-vae"].startswith("pretrained_model_name_or_path: 'acme/flux-no-vae' has no VAE in "
                                                "vae/ (config.json)")
    assert "its folders with a config.json: text_encoder, text_encoder_2, transformer" in found["acme/flux-no-vae"]
    assert "needs 10000000.0 GB more in the Hugging Face cache" in found["acme/flux-huge"]
    assert "point HF_HOME at a larger disk" in found["acme/flux-huge"]
    assert "'acme/flux-gated-files' is a gated repository" in found["acme/flux-gated-files"]


def test_hub_failures_with_a_token(hub, tmp_path):
    found = check_on_hub(hub, tmp_path, [["acme/gated", None], ["acme/flux", "v9"]], token="hf_notgranted")
    assert "the Hugging Face token in use (HF_TOKEN or `hf auth login`) has not been granted access" in \
        found["acme/gated"]
    assert found["acme/flux"].startswith("revision: 'v9' does not exist in 'acme/flux'")


# ---- local folders and files, in-process ----------------------------------------------------------------------
def test_local_layouts(tmp_path, tiny_flux_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_flux_path, model)
    transformer = WeightSource("pretrained_model_name_or_path", str(model), "transformer",
                               subfolder_field="pretrained_transformer_subfolder", what="transformer")
    check_weight_sources([transformer])  # the tiny checkpoint holds it

    with pytest.raises(WeightLoadError, match=r"pretrained_transformer_subfolder to the folder that holds the "
                                              r"transformer \('none' for the top level\)"):
        check_weight_sources([WeightSource("pretrained_model_name_or_path", str(model), "unet",
                                           subfolder_field="pretrained_transformer_subfolder", what="transformer")])
    for weights in (model / "vae").glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(WeightLoadError, match=r"vae' holds no weight files .* for the VAE"):
        check_weight_sources([WeightSource("pretrained_vae_model_name_or_path", str(model), "vae", what="VAE")])
    with pytest.raises(WeightLoadError, match=r"pretrained_transformer_model_name_or_path: file .*flux1.safetensors"
                                              r"' does not exist"):
        check_weight_sources([WeightSource("pretrained_transformer_model_name_or_path",
                                           str(tmp_path / "flux1.safetensors"))])
    with pytest.raises(WeightLoadError, match=r"folder '\./nowhere' does not exist \(and it is not a Hugging Face "
                                              r"repo id"):
        check_weight_sources([WeightSource("pretrained_model_name_or_path", "./nowhere", "transformer")])


def test_a_disk_full_while_loading_is_explained(tmp_path):
    from simpletuner.models.weights import explained

    source = WeightSource("pretrained_model_name_or_path", "acme/flux", "transformer")
    with pytest.raises(WeightLoadError, match=r"no space left on the device while storing 'acme/flux'"):
        with explained(source):
            raise OSError(28, "No space left on device")
    with pytest.raises(KeyError):  # not a weights problem: passes through unchanged
        with explained(source):
            raise KeyError("a bug")
