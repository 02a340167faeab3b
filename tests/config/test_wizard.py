"""`simpletuner configure` in-process: the question loop with scripted answers, flags that answer questions, what it
refuses and re-asks, the dataset folder's facts, and the two files it writes (tests/e2e/test_wizard_e2e.py drives the
same wizard in a terminal and trains what it wrote)."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest

from simpletuner.config import load_data_backends, load_train_config, wizard
from simpletuner.config.errors import FieldError
from simpletuner.config.versions import CURRENT_CONFIG_VERSION
from tests.conftest import REPO


@pytest.fixture
def pics(tmp_path, monkeypatch):
    """A copy of the sample dataset (12 captioned images) in a fresh working directory."""
    shutil.copytree(REPO / "datasets" / "sample", tmp_path / "my pics")
    monkeypatch.chdir(tmp_path)
    return tmp_path / "my pics"


class Session:
    """Scripted typing: each prompt takes the next answer; what the wizard prints is kept."""

    def __init__(self, answers: list[str]):
        self.answers, self.prompts, self.printed = list(answers), [], []

    def read(self, prompt: str) -> str:
        self.prompts.append(prompt)
        if not self.answers:
            raise EOFError
        return self.answers.pop(0)

    def wizard(self, **kw) -> wizard.Wizard:
        return wizard.Wizard(read=self.read, write=self.printed.append, **kw)


TYPED = ["", "tiny", "", "4", "2", "1e-3", "", "my pics", "", "", "out"]


def test_typed_answers_and_enter_for_each_default(pics):
    session = Session(TYPED)
    answers, entry = session.wizard().run()
    assert answers == {"model_family": "flux", "model_flavour": "tiny", "model_type": "lora", "lora_rank": 4,
                       "max_train_steps": 2, "learning_rate": 1e-3, "mixed_precision": "no", "resolution": 64,
                       "output_dir": "out"}
    assert entry == {"instance_data_dir": "my pics", "caption_strategy": "textfile"}
    assert session.prompts[0].startswith("Model family (") and session.prompts[0].endswith(") [flux]: ")
    assert session.prompts[1:] == [
        "Flavour (" + ", ".join(wizard.get_family("flux").flavours) + ") [krea]: ",
        "Model type (lora, full) [lora]: ", "LoRA rank [16]: ", "Training steps [1000]: ", "Learning rate [1e-4]: ",
        "Mixed precision (no, bf16, fp16) [no]: ", "Dataset folder (images) [datasets/my-images]: ",
        "Caption strategy (filename, textfile, instanceprompt) [textfile]: ", "Resolution (pixels) [64]: ",
        "Output folder [output/models]: "]
    assert session.printed == ["  found 12 images, 12 with a .txt caption"]


def test_an_invalid_answer_says_why_and_is_asked_again(pics):
    session = Session(["fluxx", "", "tiny", "", "-3", "4", "2", "1e-3", "", "nowhere", "my pics/00_orange_circle.png",
                       "my pics", "sideways", "", "", "out"])
    answers, entry = session.wizard().run()
    assert answers["model_family"] == "flux" and answers["lora_rank"] == 4 and entry["caption_strategy"] == "textfile"
    invalid = [line for line in session.printed if line.startswith("  invalid: ")]
    assert invalid[0].startswith("  invalid: 'fluxx' is not a known model family; available: ")
    assert "lora_rank" not in invalid[1] and "-3" in invalid[1]
    assert invalid[2:4] == ["  invalid: folder 'nowhere' does not exist",
                            "  invalid: 'my pics/00_orange_circle.png' is not a folder"]
    assert invalid[4].startswith("  invalid: ") and "sideways" in invalid[4] and len(invalid) == 5
    assert session.prompts.count("LoRA rank [16]: ") == 2


def test_a_full_model_asks_no_rank_and_defaults_to_a_lower_learning_rate(pics):
    session = Session(["", "tiny", "full", "2", "", "", "my pics", "", "", ""])
    answers, _ = session.wizard().run()
    assert answers["model_type"] == "full" and "lora_rank" not in answers
    assert answers["learning_rate"] == 1e-5 and "Learning rate [1e-5]: " in session.prompts


def test_an_empty_folder_and_uncaptioned_images(pics, tmp_path):
    (tmp_path / "empty").mkdir()
    bare = tmp_path / "bare"
    bare.mkdir()
    for image in pics.glob("*.png"):
        shutil.copy(image, bare / image.name)
    assert wizard.folder_facts(str(tmp_path / "empty")) == "folder '" + str(tmp_path / "empty") + \
        "' holds no images (.png .jpg .jpeg .webp .bmp)"
    assert wizard.folder_facts(str(bare)) == (12, 0)
    assert wizard.folder_facts(str(pics)) == (12, 12)
    session = Session(["", "tiny", "", "", "", "", "", str(tmp_path / "empty"), str(bare), "", "", ""])
    _, entry = session.wizard().run()
    assert "  found 12 images, 0 with a .txt caption" in session.printed
    assert entry["caption_strategy"] == "filename"  # nothing to read from .txt files: the suggestion follows


def test_instanceprompt_asks_for_the_prompt(pics):
    session = Session(["", "tiny", "", "", "", "", "", "my pics", "instanceprompt", "", "a photo of sks", "", ""])
    _, entry = session.wizard().run()
    assert entry == {"instance_data_dir": "my pics", "caption_strategy": "instanceprompt",
                     "instance_prompt": "a photo of sks"}
    assert session.prompts.count("Instance prompt (caption of every image) []: ") == 2  # Enter: none, asked again
    assert session.printed[-1] == "  invalid: is required for caption_strategy 'instanceprompt'"


def test_flags_answer_their_questions_and_a_bad_flag_stops_naming_it(pics):
    given = {"model_family": "flux", "model_flavour": "tiny", "model_type": "lora", "lora_rank": "4",
             "max_train_steps": "2", "learning_rate": "1e-3", "mixed_precision": "no", "instance_data_dir": "my pics",
             "caption_strategy": "textfile", "instance_prompt": None, "resolution": "64", "output_dir": "out"}
    session = Session([])
    answers, entry = session.wizard(given=given).run()
    assert session.prompts == [] and answers["lora_rank"] == 4 and entry["instance_data_dir"] == "my pics"
    assert "LoRA rank: 4 (--lora-rank)" in session.printed and "Dataset folder (images): my pics (--data)" in \
        session.printed
    with pytest.raises(wizard.Aborted) as info:
        Session([]).wizard(given={**given, "lora_rank": " -3 "}).run()
    assert str(info.value).startswith("--lora-rank '-3': ")
    with pytest.raises(wizard.Aborted, match="^--data 'nowhere': folder 'nowhere' does not exist$"):
        Session([]).wizard(given={**given, "instance_data_dir": "nowhere"}).run()


def test_accepting_every_default_stops_at_the_first_invalid_one(pics):
    session = Session([])
    with pytest.raises(wizard.Aborted) as info:
        session.wizard(accept_defaults=True, given={"model_flavour": "tiny"}).run()
    assert str(info.value) == ("the default for 'Dataset folder (images)' is invalid: folder 'datasets/my-images' "
                               "does not exist")
    assert session.prompts == [] and "Model type (lora, full) [lora]: lora" in session.printed
    answers, entry = Session([]).wizard(accept_defaults=True, given={"model_flavour": "tiny",
                                                                     "instance_data_dir": "my pics"}).run()
    assert (answers["lora_rank"], answers["max_train_steps"], answers["resolution"]) == (16, 1000, 64)


def test_input_that_ends_aborts():
    with pytest.raises(wizard.Aborted):
        Session(["", "tiny"]).wizard().run()

    def interrupted(prompt):
        raise KeyboardInterrupt

    with pytest.raises(wizard.Aborted):
        wizard.Wizard(read=interrupted, write=lambda line: None).run()


@pytest.mark.parametrize("folder, dataset_id", [("my pics", "my-pics"), ("data/cats/", "cats"), ("ünï", "n"),
                                                ("///", "my-dataset"), ("a_b-c", "a_b-c"), ("My Pics", "My-Pics"),
                                                ("Xmas-X", "Xmas-X")])
def test_the_dataset_id_is_the_folder_name_made_safe(folder, dataset_id):
    assert wizard._dataset_id(folder) == dataset_id


def test_build_files_makes_both_files(pics):
    answers, entry = Session(TYPED).wizard().run()
    config, backends = wizard.build_files(answers, entry, "config/multidatabackend.json")
    assert config == {"config_version": CURRENT_CONFIG_VERSION, **answers,
                      "data_backend_config": "config/multidatabackend.json", "checkpointing_steps": 500}
    assert backends == [
        {"id": "my-pics", "type": "local", "dataset_type": "image", "instance_data_dir": "my pics",
         "caption_strategy": "textfile", "resolution": 64, "resolution_type": "pixel_area", "repeats": 0,
         "cache_dir_vae": "cache/vae/flux/my-pics"},
        {"id": "text-embeds", "dataset_type": "text_embeds", "type": "local", "default": True,
         "cache_dir": "cache/text/flux"}]
    config, _ = wizard.build_files({**answers, "checkpointing_steps": 10}, entry, "x.json")
    assert config["checkpointing_steps"] == 10


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    wizard.add_arguments(parser)
    return parser.parse_args(list(argv))


FLAGS = ["--family", "flux", "--flavour", "tiny", "--model-type", "lora", "--lora-rank", "4", "--steps", "2",
         "--learning-rate", "1e-3", "--mixed-precision", "no", "--data", "my pics", "--caption-strategy", "textfile",
         "--resolution", "64", "--output-dir", "out"]


def test_run_writes_both_files_and_validates_them(pics, tmp_path, capsys):
    assert wizard.run(_args(*FLAGS)) == 0
    out = capsys.readouterr().out
    assert "wrote config/config.json and config/multidatabackend.json" in out
    assert out.rstrip().endswith("OK\nnext: simpletuner train --config config/config.json")
    text = (tmp_path / "config" / "config.json").read_text()
    assert text.endswith("}\n") and load_train_config(tmp_path / "config" / "config.json").config.lora_rank == 4
    backends = load_data_backends(tmp_path / "config" / "multidatabackend.json")
    assert [d.id for d in backends.datasets] == ["my-pics"]
    assert sorted(p.name for p in (tmp_path / "config").iterdir()) == ["config.json", "multidatabackend.json"]


def test_run_never_overwrites_without_force(pics, tmp_path, capsys):
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.json").write_text("{}")
    assert wizard.run(_args(*FLAGS)) == 1
    assert capsys.readouterr().err == ("error: config/config.json already exist; use --force to overwrite\n")
    assert (tmp_path / "config" / "config.json").read_text() == "{}"
    (tmp_path / "config" / "multidatabackend.json").write_text("[]")
    assert wizard.run(_args(*FLAGS)) == 1
    assert "config/config.json and config/multidatabackend.json already exist" in capsys.readouterr().err
    assert wizard.run(_args(*FLAGS, "--force")) == 0
    assert json.loads((tmp_path / "config" / "config.json").read_text())["lora_rank"] == 4


def test_run_with_other_paths_and_an_aborted_session_writes_nothing(pics, tmp_path, capsys):
    args = _args(*FLAGS, "--config", "a/c.json", "--data_backend_config", "b/d.json")
    assert wizard.run(args) == 0
    assert load_train_config(tmp_path / "a" / "c.json").config.data_backend_config == "b/d.json"
    assert "simpletuner train --config a/c.json" in capsys.readouterr().out
    bad = _args(*FLAGS[:-2], "--output-dir", "out", "--config-dir", "elsewhere", "--resolution", "-5")
    assert wizard.run(bad) == 1
    err = capsys.readouterr().err
    assert err.startswith("\nerror: --resolution '-5': ") and err.endswith("; nothing written\n")
    assert not (tmp_path / "elsewhere").exists()


def test_a_video_family_counts_videos_and_a_real_flavour_suggests_real_settings(tmp_path, monkeypatch):
    shutil.copytree(REPO / "datasets" / "sample_video", tmp_path / "clips")
    monkeypatch.chdir(tmp_path)
    session = Session(["ltxvideo", "", "", "", "", "", "no", "clips", "", "", ""])
    answers, entry = session.wizard().run()
    assert wizard.folder_facts("clips", video=True) == (7, 7) and wizard.folder_facts("clips") != (7, 7)
    assert session.printed == ["  found 7 videos and images, 7 with a .txt caption"]
    assert session.prompts[0] == f"Model family ({', '.join(wizard.family_names())}) [flux]: "
    assert "Mixed precision (no, bf16, fp16) [bf16]: " in session.prompts  # real weights: bf16 at 1024
    assert "Resolution (pixels) [1024]: " in session.prompts
    assert answers["model_flavour"] == "0.9.5" and answers["resolution"] == 1024 and entry["instance_data_dir"] == "clips"


def test_with_no_captions_the_prompt_suggests_filename(pics, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(next(pics.glob("*.png")), bare / "only.png")
    session = Session(["", "tiny", "", "", "", "", "", "bare", "", "", ""])
    session.wizard().run()
    assert "Caption strategy (filename, textfile, instanceprompt) [filename]: " in session.prompts


def test_the_instance_prompt_can_come_from_its_flag(pics):
    given = {"model_flavour": "tiny", "instance_data_dir": "my pics", "caption_strategy": "instanceprompt",
             "instance_prompt": "a photo of sks"}
    session = Session(["", "", "", "", "", "", "", ""])
    _, entry = session.wizard(given=given).run()
    assert entry["instance_prompt"] == "a photo of sks"
    assert "Instance prompt (caption of every image): a photo of sks (--instance-prompt)" in session.printed
    assert not [p for p in session.prompts if p.startswith("Instance prompt")]


def test_checks_parse_a_value_alone_and_name_only_their_own_errors():
    assert wizard.check_train_field({}, "lora_rank", "4") == (4, None)  # parsed, with a family filled in
    assert wizard.check_train_field({}, "max_train_steps", "5") == (5, None)
    assert wizard.check_dataset_field({}, "repeats", "3") == (3, None)
    value, error = wizard.check_train_field({}, "lora_rank", "four")
    assert value is None and error and "four" in error
    errors = [FieldError("a", "one"), FieldError("a.b", "two"), FieldError("a[0]", "three"),
              FieldError("ab", "not a's"), FieldError("b.a", "not a's either")]
    assert wizard._matching(errors, "a") == ["one", "two", "three"]


@pytest.mark.parametrize("tty", [True, False])
def test_a_piped_answer_is_echoed_so_the_session_reads_as_typed(monkeypatch, capsys, tty):
    import sys

    asked = []
    monkeypatch.setattr("builtins.input", lambda prompt: asked.append(prompt) or "my answer")
    monkeypatch.setattr(sys.stdin, "isatty", lambda: tty, raising=False)
    assert wizard._read_line("Question [x]: ") == "my answer" and asked == ["Question [x]: "]
    assert capsys.readouterr().out == ("" if tty else "my answer\n")


def test_run_with_yes_stops_at_an_invalid_default_and_typed_input_that_ends(pics, tmp_path, capsys, monkeypatch):
    assert wizard.run(_args("--yes", "--flavour", "tiny")) == 1
    assert capsys.readouterr().err == ("\nerror: the default for 'Dataset folder (images)' is invalid: folder "
                                       "'datasets/my-images' does not exist; nothing written\n")
    monkeypatch.setattr(wizard.Wizard, "__init__", _reading_nothing(wizard.Wizard.__init__))
    assert wizard.run(_args("--flavour", "tiny")) == 1
    assert capsys.readouterr().err == "\nerror: input ended before the wizard finished; nothing written\n"
    assert not (tmp_path / "config").exists()


def _reading_nothing(init):
    def patched(self, *args, **kw):
        init(self, *args, **kw)

        def ended(prompt):
            raise EOFError

        self.read = ended

    return patched


def test_run_refuses_answers_that_do_not_form_a_valid_config_and_reports_a_failed_validation(pics, tmp_path, capsys,
                                                                                             monkeypatch):
    import simpletuner.config.cli as cli

    real_build = wizard.build_files

    def clashing(answers, entry, path):  # two datasets with one id: each answer was fine, together they are not
        config, backends = real_build(answers, entry, path)
        return config, [backends[0], dict(backends[0]), backends[1]]

    monkeypatch.setattr(wizard, "build_files", clashing)
    assert wizard.run(_args(*FLAGS)) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: the answers do not form a valid config:\n") and "my-pics" in err
    assert not (tmp_path / "config").exists()
    monkeypatch.setattr(wizard, "build_files", real_build)

    real_validate = cli.validate_files

    def failing(config_path, data_path):
        report = real_validate(config_path, data_path)
        report.errors.append(("multidatabackend.json", "datasets[my-pics]: a problem only the full check sees"))
        return report

    monkeypatch.setattr(cli, "validate_files", failing)
    assert wizard.run(_args(*FLAGS)) == 1
    out = capsys.readouterr().out
    assert "simpletuner validate --config config/config.json" in out
    assert out.rstrip().endswith("fix the errors above, then: simpletuner train --config config/config.json")
    assert (tmp_path / "config" / "config.json").read_text().startswith('{\n  "config_version": ')


def test_every_option_spelling_and_the_help(capsys):
    args = _args("--config-dir", "a", "--data-backend-config", "b.json", "-y", "--force")
    assert (args.config_dir, args.data_backend_config, args.yes, args.force, args.config) == ("a", "b.json", True,
                                                                                                True, None)
    args = _args("--config_dir", "c", "--data_backend_config", "d.json", "--yes", "--config", "e.json")
    assert (args.config_dir, args.data_backend_config, args.yes, args.force, args.config) == ("c", "d.json", True,
                                                                                                False, "e.json")
    defaults = _args()
    assert (defaults.config_dir, defaults.yes, defaults.force) == ("config", False, False)
    assert all(getattr(defaults, f"answer_{key}") is None for key in wizard.FLAGS)
    with pytest.raises(SystemExit):
        _args("--help")
    shown = " ".join(capsys.readouterr().out.split())
    assert "answers: each answers one question, which is then not asked" in shown
    assert "--family MODEL_FAMILY model family (model_family)" in shown
    assert "config.json path (default: CONFIG_DIR/config.json)" in shown
    assert "multidatabackend.json path (default: CONFIG_DIR/multidatabackend.json)" in shown
    assert "folder for config.json and multidatabackend.json (default: config)" in shown
    assert "--force overwrite existing files" in shown and "--yes, -y accept every default without asking" in shown
