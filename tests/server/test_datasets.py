"""Datasets over the REST API: uploads (type-checked by content, size-limited, never written outside the dataset
folder, zips unpacked safely), captions edited in place, files removed, a folder allowed by path (with the
--allowed-root hint when it is outside the roots), the scan summary; and the config check reporting missing
captions, too-small images and missing folders before a job starts."""

from __future__ import annotations

import io
import stat
import zipfile

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from simpletuner.server.app import create_app
from tests.server.helpers import LOOPBACK, data_backends, train_config


def png(size=(64, 64), color="red") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def jpeg(size=(80, 48)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, "blue").save(buf, "JPEG")
    return buf.getvalue()


def make_zip(members: dict[str, bytes], links: dict[str, str] | None = None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        for name, target in (links or {}).items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            zf.writestr(info, target)
    return buf.getvalue()


@pytest.fixture
def dataset(client):
    r = client.post("/api/datasets", json={"name": "cats"})
    assert r.status_code == 201, r.text
    return r.json()


def upload(client, name, *files):
    return client.post(f"/api/datasets/{name}/files", files=[("files", f) for f in files])


def test_upload_images_and_captions_then_edit_and_remove(client, dataset, tmp_path):
    folder = tmp_path / "data" / "datasets" / "cats"
    assert dataset["path"] == str(folder) and dataset["uploaded"] and folder.is_dir()
    r = upload(client, "cats", ("a.png", png(), "image/png"), ("a.txt", b"a red cat", "text/plain"),
               ("b.jpg", jpeg(), "image/jpeg"))
    assert r.status_code == 200, r.text
    assert sorted(r.json()["saved"]) == ["a.png", "a.txt", "b.jpg"] and r.json()["skipped"] == []
    detail = client.get("/api/datasets/cats").json()
    assert detail["total"] == 2 and detail["files"] == 2 and detail["captioned"] == 1
    items = {i["path"]: i for i in detail["items"]}
    assert items["a.png"]["caption"] == "a red cat" and (items["a.png"]["width"], items["a.png"]["height"]) == (64, 64)
    assert items["b.jpg"]["caption"] is None and (items["b.jpg"]["width"], items["b.jpg"]["height"]) == (80, 48)
    scan = detail["scan"]["datasets"][0]
    assert scan["images"] == 2 and scan["captioned"] == 1 and scan["caption_strategy"] == "textfile"
    assert "textfile" in " ".join(e["message"] for e in detail["scan"]["errors"])  # b.jpg lacks its caption

    r = client.put("/api/datasets/cats/captions/b.jpg", json={"caption": "a blue dog"})
    assert r.status_code == 200 and r.json()["caption"] == "a blue dog"
    assert (folder / "b.txt").read_text() == "a blue dog\n"
    detail = client.get("/api/datasets/cats").json()
    assert detail["scan"]["errors"] == [] and detail["captioned"] == 2

    image = client.get("/api/datasets/cats/files/a.png")
    assert image.status_code == 200 and image.headers["content-type"] == "image/png" and image.content == png()
    assert client.delete("/api/datasets/cats/files/a.png").status_code == 204
    assert not (folder / "a.png").exists() and not (folder / "a.txt").exists()
    assert client.get("/api/datasets/cats/files/a.png").status_code == 404
    assert [d["name"] for d in client.get("/api/datasets").json()] == ["cats"]


def test_uploads_are_checked_by_content(client, dataset, tmp_path):
    r = upload(client, "cats", ("fake.png", b"<script>alert(1)</script>", "image/png"),
               ("real.png", png(), "text/plain"),  # the browser's content type does not matter
               ("renamed.png", jpeg(), "image/png"),  # a JPEG named .png: a readable image, kept
               ("notes.exe", b"MZ...", "application/octet-stream"),
               ("caption.txt", b"\xff\xfe\x00bad", "text/plain"))
    body = r.json()
    assert sorted(body["saved"]) == ["real.png", "renamed.png"]
    reasons = {s["name"]: s["reason"] for s in body["skipped"]}
    assert "not a readable PNG image" in reasons["fake.png"]
    assert "not a dataset file" in reasons["notes.exe"]
    assert "UTF-8" in reasons["caption.txt"]
    folder = tmp_path / "data" / "datasets" / "cats"
    assert sorted(p.name for p in folder.iterdir()) == ["real.png", "renamed.png"]  # no temporary file left


def test_names_never_escape_the_dataset_folder(client, dataset, tmp_path):
    r = upload(client, "cats", ("../../escape.png", png(), "image/png"), ("/etc/evil.png", png(), "image/png"),
               ("sub/dir/ok.png", png(), "image/png"))
    body = r.json()
    assert body["saved"] == ["etc/evil.png", "sub/dir/ok.png"]
    assert "'..'" in body["skipped"][0]["reason"]
    assert not (tmp_path / "data" / "escape.png").exists() and not (tmp_path / "escape.png").exists()
    # a symlinked sub-folder pointing outside is not written through
    folder = tmp_path / "data" / "datasets" / "cats"
    outside = tmp_path / "outside"
    outside.mkdir()
    (folder / "link").symlink_to(outside)
    r = upload(client, "cats", ("link/x.png", png(), "image/png"))
    assert r.json()["saved"] == [] and "outside the dataset folder" in r.json()["skipped"][0]["reason"]
    assert list(outside.iterdir()) == []
    assert client.put("/api/datasets/cats/captions/..%2F..%2Fx.png", json={"caption": "x"}).status_code == 404
    assert client.get("/api/datasets/cats/files/..%2F..%2Fsimpletuner.db").status_code == 404


def test_zips_unpack_safely(client, dataset, tmp_path):
    archive = make_zip({"set/a.png": png(), "set/a.txt": b"an a", "set/b.png": png((96, 64)),
                        "../../zipslip.png": png(), "__MACOSX/set/._a.png": b"junk", "set/bad.png": b"nope"},
                       links={"set/link.png": "/etc/passwd"})
    r = upload(client, "cats", ("pics.zip", archive, "application/zip"))
    body = r.json()
    assert sorted(body["saved"]) == ["set/a.png", "set/a.txt", "set/b.png"]
    reasons = " | ".join(s["reason"] for s in body["skipped"])
    assert "'..'" in reasons and "a link inside the zip is refused" in reasons and "not a readable PNG" in reasons
    assert not (tmp_path / "data" / "zipslip.png").exists()
    assert not (tmp_path / "data" / "datasets" / "cats" / "set" / "link.png").exists()
    r = upload(client, "cats", ("broken.zip", b"PK\x03\x04 not really", "application/zip"))
    assert r.json()["skipped"][0]["reason"] == "broken.zip: not a zip file"


def test_uploads_are_size_limited(settings_factory, tmp_path):
    app = create_app(settings_factory(run_scheduler=False, max_upload_bytes=4096))
    with TestClient(app, client=LOOPBACK, base_url="http://127.0.0.1") as c:
        assert c.post("/api/datasets", json={"name": "big"}).status_code == 201
        r = upload(c, "big", ("huge.png", png((512, 512), "white") + b"\0" * 8192, "image/png"))
        assert r.status_code == 413 and "4096" in r.json()["detail"]
        r = upload(c, "big", ("small.png", png((8, 8)), "image/png"))
        assert r.status_code == 200 and r.json()["saved"] == ["small.png"]
        # a body of unannounced length (chunked) is refused before it is read
        chunked = c.post("/api/datasets/big/files", content=iter([b"--x\r\n", b"0" * 10_000]),
                         headers={"Content-Type": "multipart/form-data; boundary=x"})
        assert chunked.status_code == 411
    assert sorted(p.name for p in (tmp_path / "data" / "datasets" / "big").iterdir()) == ["small.png"]


def test_allowing_a_folder(client, workdir, tmp_path):
    r = client.post("/api/datasets", json={"name": "mine", "path": "imgs"})
    assert r.status_code == 201, r.text
    assert r.json()["path"] == str(workdir / "imgs") and not r.json()["uploaded"] and r.json()["files"] == 2
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    r = client.post("/api/datasets", json={"name": "theirs", "path": str(outside)})
    assert r.status_code == 422
    (error,) = r.json()["errors"]
    assert error["path"] == "path" and f"--allowed-root {outside}" in error["message"]
    assert client.post("/api/datasets", json={"name": "mine"}).status_code == 409
    r = client.post("/api/datasets", json={"name": "gone", "path": "nowhere"})
    assert r.status_code == 422 and "does not exist" in r.json()["errors"][0]["message"]


def test_scan_summary_follows_the_resolution_settings(client, dataset):
    upload(client, "cats", ("small.png", png((32, 32)), "image/png"), ("small.txt", b"s", "text/plain"),
           ("big.png", png((256, 128)), "image/png"), ("big.txt", b"b", "text/plain"))
    scan = client.get("/api/datasets/cats", params={"resolution": 64, "resolution_type": "pixel",
                                                    "minimum_image_size": 48}).json()["scan"]
    d = scan["datasets"][0]
    assert d["too_small"] == 1 and d["buckets"] == {"128x64": 1} and d["batches"] == 1
    assert any("smaller than 48" in w for w in scan["warnings"])
    bad = client.get("/api/datasets/cats", params={"resolution": 99999})  # found by schemathesis: was a 500
    assert bad.status_code == 422 and bad.json()["errors"][0]["path"] == "resolution"
    assert client.get("/api/datasets/cats", params={"model_family": "nope"}).status_code == 422


def _validate(client, backends):
    return client.post("/api/configs/validate", json={"train_config": train_config(), "data_backends": backends})


def test_validate_reports_data_problems_before_a_job_starts(client, workdir):
    """No captions, too-small images and a missing folder: each a field error from the API (and a job with them
    is refused at submission, so nothing starts)."""
    uncaptioned = workdir / "uncaptioned"
    uncaptioned.mkdir()
    (uncaptioned / "x.png").write_bytes(png())
    small = workdir / "small"
    small.mkdir()
    (small / "s.png").write_bytes(png((16, 16)))
    (small / "s.txt").write_text("s")
    cases = {
        "uncaptioned": ("data_backends[d].caption_strategy", "1 of 1 file(s) have no .txt caption"),
        "small": ("data_backends[d].minimum_image_size", "all 1 image(s) are smaller than 32"),
        "nowhere": ("data_backends[d].instance_data_dir", "does not exist"),
    }
    for folder, (path, message) in cases.items():
        backends = data_backends(folder)
        backends[0]["minimum_image_size"] = 32
        r = _validate(client, backends)
        assert r.status_code == 200 and not r.json()["valid"], folder
        errors = {e["path"]: e["message"] for e in r.json()["errors"]}
        assert message in errors[path], (folder, errors)
        job = client.post("/api/jobs", json={"train_config": train_config(), "data_backends": backends})
        assert job.status_code == 422 and path in {e["path"] for e in job.json()["errors"]}
    assert client.get("/api/jobs").json()["total"] == 0
    ok = _validate(client, data_backends())
    assert ok.json()["valid"] and ok.json()["data"]["datasets"][0]["images"] == 2
