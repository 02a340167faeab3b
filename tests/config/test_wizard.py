"""`simpletuner configure` in-process: the question loop with scripted answers, flags that answer questions, what it
refuses and re-asks, the dataset folder's facts, and the two files it writes (tests/e2e/test_wizard_e2e.py drives the
same wizard in a terminal and trains what it wrote)."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest

from simpletuner.config import load_data_backends, load_train_config, wizard
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
                                                ("///", "my-dataset"), ("a_b-c", "a_b-c")])
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
