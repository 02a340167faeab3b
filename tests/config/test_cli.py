"""``simpletuner validate`` and ``simpletuner configure``: in real subprocesses (marked e2e), and in-process through
the same entry point (what mutation testing can see: scripts/mutation.sh leaves e2e tests out)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def simpletuner(*args: str, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "simpletuner.cli", *args],
        cwd=cwd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def project(tmp_path, make_config, make_backends):
    """A folder laid out like a SimpleTuner checkout: config/config.json + config/multidatabackend.json."""
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.json").write_text(json.dumps(make_config()))
    (tmp_path / "config" / "multidatabackend.json").write_text(json.dumps(make_backends("datasets/pics")))
    picture(tmp_path / "datasets" / "pics" / "a.png", caption="a cat")
    return tmp_path


def picture(path: Path, size=(64, 64), caption: str | None = None) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, "teal").save(path)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption)


@pytest.mark.e2e
def test_validate_ok(project):
    result = simpletuner("validate", cwd=project)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        f"datasets[pics] (image): 1 image in {project / 'datasets' / 'pics'}; 1 with captions (caption_strategy "
        "textfile); buckets 1024x1024: 1; 3 batches per epoch",
        "warning: config/config.json: flux_schedule_shift: renamed to flow_schedule_shift",
        "OK",
    ]


@pytest.mark.e2e
def test_validate_reports_every_error_with_its_path(project, make_config, make_backends):
    config = make_config(**{"--lr_scheduler": "cosin", "--lora_rank": "0"})
    (project / "config" / "config.json").write_text(json.dumps(config))
    (project / "config" / "multidatabackend.json").write_text(json.dumps(make_backends(crop_style="middle")))
    result = simpletuner("validate", "--config", "config/config.json", cwd=project)
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert "config/config.json: lr_scheduler: 'cosin' is not one of constant, constant_with_warmup, linear, " \
           "cosine, cosine_with_restarts, polynomial" in lines
    assert "config/config.json: lora_rank: must be >= 1, got 0" in lines
    assert "config/multidatabackend.json: datasets[pics].crop_style: 'middle' is not one of center, random, " \
           "corner" in lines
    assert "OK" not in lines
    assert "3 errors" in result.stderr


@pytest.mark.e2e
def test_validate_reports_data_problems_before_anything_trains(project, make_backends):
    """A missing folder, images without captions and images too small for minimum_image_size: each an error with
    its path; --no-scan checks the files alone (for a config that trains on another machine)."""
    backends = make_backends("datasets/nowhere")
    backends.insert(1, {**backends[0], "id": "uncaptioned", "instance_data_dir": "datasets/uncaptioned"})
    backends.insert(2, {**backends[0], "id": "small", "instance_data_dir": "datasets/small",
                        "minimum_image_size": 512})
    picture(project / "datasets" / "uncaptioned" / "x.png")
    picture(project / "datasets" / "uncaptioned" / "y.png")
    picture(project / "datasets" / "small" / "s.png", size=(32, 32), caption="small")
    (project / "config" / "multidatabackend.json").write_text(json.dumps(backends))
    result = simpletuner("validate", cwd=project)
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    where = "config/multidatabackend.json: datasets"
    assert (f"{where}[pics].instance_data_dir: folder 'datasets/nowhere' "
            f"({project / 'datasets' / 'nowhere'}) does not exist") in lines
    assert (f"{where}[uncaptioned].caption_strategy: textfile: 2 of 2 file(s) have no .txt caption beside them, "
            "e.g. x.png, y.png; add the captions or set caption_strategy 'filename'") in lines
    assert f"{where}[small].minimum_image_size: all 1 image(s) are smaller than 512, e.g. s.png (32x32)" in lines
    assert "3 errors" in result.stderr
    report = json.loads(simpletuner("validate", "--json", cwd=project).stdout)
    assert [d["id"] for d in report["data"]["datasets"]] == ["pics", "uncaptioned", "small"]
    assert report["data"]["datasets"][1]["images"] == 2 and report["data"]["datasets"][1]["captioned"] == 0
    skipped = simpletuner("validate", "--no-scan", cwd=project)
    assert skipped.returncode == 0 and skipped.stdout.splitlines()[-1] == "OK"


@pytest.mark.e2e
def test_validate_data_backend_from_the_command_line(project, make_config, make_backends):
    config = make_config()
    del config["--data_backend_config"]
    (project / "config" / "config.json").write_text(json.dumps(config))
    beside = project / "config" / "multidatabackend.json"
    assert beside.is_file()
    result = simpletuner("validate", cwd=project)  # not set: the file beside the config is used, in one line
    assert result.returncode == 0
    assert result.stdout.splitlines()[0] == ("data_backend_config: not set; using config/multidatabackend.json, "
                                             "found beside config/config.json")
    beside.rename(project / "elsewhere.json")
    result = simpletuner("validate", cwd=project)
    assert result.returncode == 1
    assert "config/config.json: data_backend_config: not set" in result.stdout
    (project / "other.json").write_text(json.dumps(make_backends("datasets/pics")))
    result = simpletuner("validate", "--data_backend_config", "other.json", "--json", cwd=project)
    assert result.returncode == 0
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["errors"] == [] and report["datasets"] == ["pics"]
    assert report["config"]["model_family"] == "flux"


@pytest.mark.e2e
def test_validate_json_errors_and_bad_json(project):
    (project / "config" / "config.json").write_text('{"model_family": "flux",,}')
    result = simpletuner("validate", "--json", cwd=project)
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["ok"] is False
    (error,) = report["errors"]
    assert error["source"] == "config/config.json" and "line 1, column 25" in error["message"]


@pytest.mark.e2e
def test_validate_does_not_import_torch(project):
    code = textwrap.dedent(
        """
        import sys
        from simpletuner.cli import main
        rc = main(["validate", "--config", "config/config.json"])
        heavy = [m for m in ("torch", "diffusers", "transformers", "simpletuner.models",
                             "simpletuner.training", "simpletuner.server", "simpletuner.data")
                 if m in sys.modules]
        print("HEAVY", heavy)
        sys.exit(rc)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=project, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "HEAVY []" in result.stdout


# --- configure -------------------------------------------------------------------------------------------------

ANSWERS = [
    "omnigen",  # planned family: re-asked
    "flux",
    "tiny",
    "",  # model type: default lora
    "8",
    "200",
    "-1",  # invalid learning rate: re-asked
    "2e-4",
    "",  # mixed precision: "no" for the tiny flavour
    "datasets/nowhere",  # a folder that does not exist: re-asked
    "datasets/cats",
    "bogus",  # invalid caption strategy: re-asked
    "instanceprompt",
    "",  # instance prompt is required for instanceprompt: re-asked
    "a photo of a cat",
    "512",
    "out/cats",
]


@pytest.mark.e2e
def test_configure_with_piped_answers(tmp_path):
    picture(tmp_path / "datasets" / "cats" / "0.png")
    picture(tmp_path / "datasets" / "cats" / "1.png", caption="a cat")
    result = simpletuner("configure", cwd=tmp_path, stdin="\n".join(ANSWERS) + "\n")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "invalid: 'omnigen' is a SimpleTuner family that is planned" in result.stdout
    assert "invalid: must be > 0" in result.stdout
    assert "invalid: folder 'datasets/nowhere' does not exist" in result.stdout
    assert "found 2 images, 1 with a .txt caption" in result.stdout
    assert "Caption strategy (filename, textfile, instanceprompt) [textfile]: " in result.stdout  # from the folder
    assert "invalid: 'bogus' is not one of filename, textfile, instanceprompt" in result.stdout
    assert "invalid: is required for caption_strategy 'instanceprompt'" in result.stdout
    config = json.loads((tmp_path / "config" / "config.json").read_text())
    assert config["model_flavour"] == "tiny" and config["lora_rank"] == 8 and config["max_train_steps"] == 200
    assert config["learning_rate"] == pytest.approx(2e-4) and config["output_dir"] == "out/cats"
    assert config["data_backend_config"] == "config/multidatabackend.json" and config["mixed_precision"] == "no"
    backends = json.loads((tmp_path / "config" / "multidatabackend.json").read_text())
    assert backends[0]["instance_data_dir"] == "datasets/cats" and backends[0]["resolution"] == 512
    assert backends[0]["instance_prompt"] == "a photo of a cat"
    assert backends[1]["dataset_type"] == "text_embeds"
    # it ends with validate's summary of what it wrote
    tail = result.stdout.splitlines()
    assert tail[-2:] == ["OK", "next: simpletuner train --config config/config.json"]
    assert any(line.startswith("datasets[cats] (image): 2 images in ") for line in tail)

    validated = simpletuner("validate", cwd=tmp_path)
    assert validated.returncode == 0, validated.stdout

    # it refuses to overwrite without --force
    again = simpletuner("configure", cwd=tmp_path, stdin="\n" * 20)
    assert again.returncode == 1 and "already exist; use --force" in again.stderr
    forced = simpletuner("configure", "--force", "--data", "datasets/cats", "--caption-strategy", "filename",
                         cwd=tmp_path, stdin="\n" * 20)
    assert forced.returncode == 0, forced.stderr
    assert json.loads((tmp_path / "config" / "config.json").read_text())["model_flavour"] == "krea"


@pytest.mark.e2e
def test_configure_by_flags_asks_nothing(tmp_path):
    picture(tmp_path / "imgs" / "a.png", caption="a teal square")
    flags = ["--family", "flux", "--flavour", "tiny", "--model-type", "lora", "--lora-rank", "4", "--steps", "3",
             "--learning-rate", "1e-3", "--mixed-precision", "no", "--data", "imgs", "--caption-strategy",
             "textfile", "--resolution", "64", "--output-dir", "out"]
    result = simpletuner("configure", *flags, cwd=tmp_path, stdin="")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Dataset folder (images): imgs (--data)" in result.stdout and "[" not in result.stdout.split("wrote")[0]
    config = json.loads((tmp_path / "config" / "config.json").read_text())
    assert (config["lora_rank"], config["max_train_steps"], config["resolution"]) == (4, 3, 64)
    # a bad flag stops with its name; a missing folder is refused
    bad = simpletuner("configure", "--force", *flags, "--lora-rank", "0", cwd=tmp_path, stdin="")
    assert bad.returncode == 1 and "--lora-rank '0': must be >= 1" in bad.stderr
    missing = simpletuner("configure", "--force", "--yes", "--data", "nowhere", cwd=tmp_path)
    assert missing.returncode == 1 and "--data 'nowhere': folder 'nowhere' does not exist" in missing.stderr


@pytest.mark.e2e
def test_configure_custom_paths_and_early_eof(tmp_path):
    result = simpletuner("configure", "--config_dir", "cfg", cwd=tmp_path, stdin="flux\n")
    assert result.returncode == 1 and "nothing written" in result.stderr
    assert not (tmp_path / "cfg").exists()
    picture(tmp_path / "datasets" / "my-images" / "a.png")
    result = simpletuner("configure", "--config_dir", "cfg", "--yes", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    config = json.loads((tmp_path / "cfg" / "config.json").read_text())
    assert config["data_backend_config"] == "cfg/multidatabackend.json"


@pytest.mark.e2e
def test_config_keys_as_simpletuner_flags_override_the_file(project):
    """`--key=value`, `--key value` and a bare `--flag` work as on SimpleTuner's command line (validate and train
    parse them the same way), winning over the file; a flag that is no config key is reported, not swallowed."""
    result = simpletuner("validate", "--json", "--lora_rank=4", "--seed", "42", "--gradient_checkpointing",
                         "--optimizer_config=d_coef=0.5", "--lora_rnk=8", cwd=project)
    report = json.loads(result.stdout)
    assert report["ok"], report
    config = report["config"]
    assert config["lora_rank"] == 4 and config["seed"] == 42 and config["gradient_checkpointing"] is True
    assert config["optimizer_config"] == {"d_coef": 0.5}
    assert any("lora_rnk: unknown key, ignored; did you mean 'lora_rank'?" in w for w in report["warnings"])


def test_train_overrides_from_flags_and_set():
    from simpletuner.training.cli import launch_command, parse_overrides
    from tests.helpers import namespace

    flags = ["--lora_rank=4", "--max_train_steps", "10", "--gradient_checkpointing", "--learning_rate", "1e-3"]
    assert parse_overrides(["max_train_steps=20"], flags) == {"lora_rank": "4", "max_train_steps": "20",
                                                               "gradient_checkpointing": True, "learning_rate": "1e-3"}
    with pytest.raises(SystemExit, match="unexpected argument 'stray'"):
        parse_overrides([], ["stray", "--seed", "1"])
    # `accelerate launch` runs of several processes receive the same flags
    args = namespace(num_processes=2, config="c.json", data_backend_config=None, set=["seed=1"], config_flags=flags)
    assert launch_command(args)[-len(flags):] == flags


@pytest.mark.e2e
def test_validate_names_the_extra_a_missing_package_comes_with(project, make_config):
    from simpletuner.config.requirements import missing_packages

    errors = missing_packages({"optimizer": "bnb-adamw8bit", "lora_type": "lycoris", "model_type": "lora",
                               "report_to": "wandb", "base_model_precision": "int8-torchao"})
    installed = {e.path for e in errors}
    import importlib.util

    assert ("optimizer" in installed) == (importlib.util.find_spec("bitsandbytes") is None)
    bnb = [e for e in errors if e.path == "optimizer"]
    if bnb:
        assert "pip install 'simpletuner[bnb]'" in bnb[0].message
    assert "report_to" not in installed  # wandb is a core dependency
    config = make_config(**{"--optimizer": "bnb-adamw8bit"})
    (project / "config" / "config.json").write_text(json.dumps(config))
    result = simpletuner("validate", cwd=project)
    if bnb:  # refused before training starts, with the extra that installs it
        assert result.returncode == 1 and "simpletuner[bnb]" in result.stdout


# --- the same command in-process (what the subprocess tests above cannot show mutation testing) ---------------


def validate_in_process(*argv: str, cwd: Path, capsys, monkeypatch) -> tuple[int, str, str]:
    """``simpletuner validate ARGV`` through the real entry point, in this process: (exit status, stdout, stderr)."""
    from simpletuner.cli import main

    monkeypatch.chdir(cwd)
    capsys.readouterr()
    code = main(["validate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_validate_in_process_reports_and_counts(project, make_config, capsys, monkeypatch):
    code, out, err = validate_in_process(cwd=project, capsys=capsys, monkeypatch=monkeypatch)
    assert code == 0 and out.splitlines()[-1] == "OK" and err == ""
    assert "warning: config/config.json: flux_schedule_shift: renamed to flow_schedule_shift" in out.splitlines()
    (project / "config" / "config.json").write_text(json.dumps(make_config(**{"--lora_rank": "0"})))
    code, out, err = validate_in_process(cwd=project, capsys=capsys, monkeypatch=monkeypatch)
    assert code == 1 and "OK" not in out.splitlines()
    assert "config/config.json: lora_rank: must be >= 1, got 0" in out.splitlines()
    assert err.strip() == "1 error"  # singular
    (project / "config" / "config.json").write_text(
        json.dumps(make_config(**{"--lora_rank": "0", "--lr_scheduler": "cosin"})))
    code, out, err = validate_in_process(cwd=project, capsys=capsys, monkeypatch=monkeypatch)
    assert code == 1 and err.strip() == "2 errors"


def test_validate_in_process_set_and_flags(project, capsys, monkeypatch):
    code, out, _ = validate_in_process("--json", "--set", "lora_rank=8", "--set", " seed =7", "--lora_alpha=2",
                                       cwd=project, capsys=capsys, monkeypatch=monkeypatch)
    report = json.loads(out)
    assert code == 0 and report["ok"] is True
    assert (report["config"]["lora_rank"], report["config"]["seed"], report["config"]["lora_alpha"]) == (8, 7, 2.0)
    assert report["datasets"] == ["pics"] and report["notes"] == [] and report["errors"] == []
    assert "config/config.json: flux_schedule_shift: renamed to flow_schedule_shift" in report["warnings"]
    for bad in ("lora_rank", "=8"):
        code, out, err = validate_in_process("--set", bad, cwd=project, capsys=capsys, monkeypatch=monkeypatch)
        assert code == 2 and out == "" and f"--set {bad!r}: expected KEY=VALUE" in err


def test_validate_in_process_json_errors(project, make_config, make_backends, capsys, monkeypatch):
    (project / "config" / "config.json").write_text(json.dumps(make_config(**{"--lora_rank": "0"})))
    (project / "config" / "multidatabackend.json").write_text(json.dumps(make_backends(crop_style="middle")))
    code, out, err = validate_in_process("--json", cwd=project, capsys=capsys, monkeypatch=monkeypatch)
    report = json.loads(out)
    assert code == 1 and report["ok"] is False and err == "" and report["config"] is None
    assert {(e["source"], e["path"]) for e in report["errors"]} == {
        ("config/config.json", "lora_rank"), ("config/multidatabackend.json", "datasets[pics].crop_style")}


def test_validate_in_process_finds_the_backends_beside_the_config(project, make_config, make_backends, capsys,
                                                                  monkeypatch):
    config = make_config()
    del config["--data_backend_config"]
    (project / "config" / "config.json").write_text(json.dumps(config))
    code, out, _ = validate_in_process("--json", cwd=project, capsys=capsys, monkeypatch=monkeypatch)
    report = json.loads(out)
    assert code == 0 and report["datasets"] == ["pics"]
    assert report["notes"] == ["data_backend_config: not set; using config/multidatabackend.json, found beside "
                               "config/config.json"]
    code, out, _ = validate_in_process(cwd=project, capsys=capsys, monkeypatch=monkeypatch)
    assert out.splitlines()[0] == report["notes"][0] and out.splitlines()[-1] == "OK"
    # a config that does not load still gets its backends checked, from its own setting or beside it
    (project / "config" / "config.json").write_text(json.dumps({**config, "--lora_rank": "0"}))
    (project / "config" / "multidatabackend.json").write_text(json.dumps(make_backends(crop_style="middle")))
    code, out, _ = validate_in_process("--json", cwd=project, capsys=capsys, monkeypatch=monkeypatch)
    report = json.loads(out)
    assert code == 1 and {e["path"] for e in report["errors"]} == {"lora_rank", "datasets[pics].crop_style"}
    (project / "config" / "multidatabackend.json").unlink()
    code, out, _ = validate_in_process("--json", cwd=project, capsys=capsys, monkeypatch=monkeypatch)
    report = json.loads(out)
    assert [(e["source"], e["path"]) for e in report["errors"]] == [
        ("config/config.json", "lora_rank"), ("config/config.json", "data_backend_config")]
    # an unreadable config file: its own error, plus the backends named on the command line; none beside it
    (project / "config" / "config.json").write_text("{not json")
    code, out, _ = validate_in_process("--json", "--data-backend-config", "nowhere.json", cwd=project,
                                       capsys=capsys, monkeypatch=monkeypatch)
    report = json.loads(out)
    assert code == 1 and [(e["source"], e["message"].split(":")[0]) for e in report["errors"]] == [
        ("config/config.json", "not valid JSON"), ("nowhere.json", "file not found")]
    (project / "config" / "multidatabackend.json").write_text(json.dumps(make_backends(crop_style="middle")))
    code, out, _ = validate_in_process("--json", cwd=project, capsys=capsys, monkeypatch=monkeypatch)
    report = json.loads(out)
    assert [e["source"] for e in report["errors"]] == ["config/config.json"] and report["notes"] == []


def test_validate_in_process_tiny_flavour_with_other_weights(project, make_config, capsys, monkeypatch):
    config = make_config(**{"--model_flavour": "tiny", "--base_model_precision": "no_change"})
    (project / "config" / "config.json").write_text(json.dumps(config))
    code, out, _ = validate_in_process("--json", cwd=project, capsys=capsys, monkeypatch=monkeypatch)
    report = json.loads(out)
    assert code == 1
    (error,) = report["errors"]
    assert error["path"] == "pretrained_model_name_or_path" and "the Hub model" in error["message"]


def test_validate_in_process_a_broken_config_still_names_its_backends(project, make_config, make_backends, capsys,
                                                                       monkeypatch):
    """A config that does not load still has its data_backend_config read (from the file or from --set), so the
    backends' errors are reported in the same run."""
    (project / "other.json").write_text(json.dumps(make_backends(crop_style="middle")))
    config = make_config(**{"--lora_rank": "0", "--data_backend_config": "other.json"})
    (project / "config" / "config.json").write_text(json.dumps(config))
    (project / "config" / "multidatabackend.json").unlink()
    code, out, _ = validate_in_process("--json", cwd=project, capsys=capsys, monkeypatch=monkeypatch)
    report = json.loads(out)
    assert code == 1 and [(e["source"], e["path"]) for e in report["errors"]] == [
        ("config/config.json", "lora_rank"), ("other.json", "datasets[pics].crop_style")]
    (project / "third.json").write_text(json.dumps(make_backends(crop_style="sideways")))
    code, out, _ = validate_in_process("--json", "--set", "data_backend_config=third.json", cwd=project,
                                       capsys=capsys, monkeypatch=monkeypatch)
    assert [e["source"] for e in json.loads(out)["errors"]] == ["config/config.json", "third.json"]


def test_validate_in_process_set_value_may_hold_an_equals_sign(project, capsys, monkeypatch):
    code, out, _ = validate_in_process("--json", "--set", "validation_prompt=a=b", cwd=project, capsys=capsys,
                                       monkeypatch=monkeypatch)
    assert code == 0 and json.loads(out)["config"]["validation_prompt"] == "a=b"
    assert out.startswith('{\n  "ok": true,\n  "errors": []')  # indented for people, one key a line
