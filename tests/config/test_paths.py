"""``simpletuner.config.paths`` function by function: how a path is resolved, when it is inside the roots, and
what each field kind accepts (the server-level matrix is tests/security/test_path_matrix.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from simpletuner.config import DatasetBackend, TrainConfig, paths


@pytest.fixture
def tree(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    (root / "out-link").symlink_to(outside)
    (root / "org").mkdir()
    (root / "org" / "local-model").mkdir()
    return root, outside


def test_resolve_expands_home_joins_relative_paths_and_follows_links(tree, monkeypatch):
    root, outside = tree
    monkeypatch.setenv("HOME", str(outside))
    assert paths.resolve("~/x", root) == str(outside / "x")
    assert paths.resolve("sub/../sub/x", root) == str(root / "sub" / "x")
    assert paths.resolve("out-link/x", root) == str(outside / "x")
    assert paths.resolve(str(outside / "y"), root) == str(outside / "y")  # absolute: the base is not used
    with pytest.raises(ValueError, match="NUL byte"):
        paths.resolve("a\x00b", root)


def test_within_is_the_root_itself_or_below_it_never_a_sibling_with_the_same_prefix(tmp_path):
    roots = [tmp_path / "data", tmp_path / "work"]
    assert paths.within(str(tmp_path / "data"), roots)
    assert paths.within(str(tmp_path / "work" / "a" / "b"), roots)
    assert not paths.within(str(tmp_path / "data-other" / "x"), roots)
    assert not paths.within(str(tmp_path / "dat"), roots)
    assert not paths.within(str(tmp_path), roots)
    assert not paths.within(str(tmp_path / "x"), [])
    assert paths.within("/anything", [Path("/")])


@pytest.mark.parametrize("value", ["org/name", "name", "a", "org/a.b-c_d", "A1/B2"])
def test_hub_ids(value):
    assert paths.is_hub_id(value)


@pytest.mark.parametrize("value", ["org/../name", "org--x/name", "-org/name", "org/name-", ".org/name", "org/name.",
                                   "a/b/c", "/name", "org/", "", "org/na me", "org/a..b", "org/a--b"])
def test_not_hub_ids(value):
    assert not paths.is_hub_id(value)


def test_problem_by_kind(tree, tmp_path):
    root, outside = tree
    roots = [root]
    assert paths.problem(None, roots, root) is None and paths.problem("", roots, root) is None
    assert paths.problem("sub", roots, root) is None
    assert paths.problem(str(root), roots, root) is None
    assert "outside the allowed roots" in paths.problem("../outside", roots, root)
    assert paths.problem("../outside", roots, root) == (
        f"'../outside' resolves to {outside}, outside the allowed roots ({root})")
    assert paths.problem("out-link/x", roots, root).startswith("'out-link/x' resolves to")
    assert paths.problem(5, roots, root) == "expected a path string, got int"
    assert paths.problem({"a": 1}, roots, root, "json") is None and paths.problem([1], roots, root, "json") is None
    assert paths.problem({"a": 1}, roots, root, "webhook") == "expected a path string, got dict"
    assert paths.problem({"a": 1}, roots, root, "dir") == "expected a path string, got dict"
    for kind in ("webhook", "json"):
        assert paths.problem('  {"url": "x"}', roots, root, kind) is None
        assert paths.problem("[1]", roots, root, kind) is None
        assert "outside" in paths.problem("../outside/hook.json", roots, root, kind)
    assert "outside" in paths.problem("{/../../outside", roots, root, "file")  # only JSON kinds take inline JSON
    assert "not a usable path" in paths.problem("a\x00b", roots, root)
    assert "not a usable path (contains a NUL byte)" in paths.problem("a\x00b", roots, root)


def test_model_kind_takes_hub_ids_unless_a_local_folder_has_that_name(tree):
    root, outside = tree
    assert paths.problem("org/remote", [root], root, "model") is None  # nothing local: a repo id
    assert paths.problem("org/local-model", [root], root, "model") is None  # local, inside
    (root / "org" / "escape").symlink_to(outside)
    assert "outside the allowed roots" in paths.problem("org/escape", [root], root, "model")
    (root / "org" / "dangling").symlink_to(outside / "gone")  # lexists: a dangling link is local too
    assert "outside the allowed roots" in paths.problem("org/dangling", [root], root, "model")
    assert "outside the allowed roots" in paths.problem("org/remote", [root / "sub"], root, "dir")  # not a model
    assert paths.problem("org/remote", [root / "sub"], root, "model") is None


@pytest.mark.parametrize("value", ["../x", "a/../../x", "/abs", "~/x", "~user", "a\\..\\x", "a\x00b", "\u2025/x",
                                   "a/\uff0e\uff0e/x"])
def test_a_subfolder_must_be_a_plain_relative_name(tree, value):
    root, _ = tree
    message = paths.problem(value, [root], root, "subfolder")
    assert message == f"{value!r} must be a plain relative name (no '..', no leading '/' or '~')"


@pytest.mark.parametrize("value", ["transformer", "a/b", "a..b", "a/.x", "\uff41"])  # fullwidth "a" folds to "a"
def test_plain_subfolders_are_accepted(tree, value):
    root, _ = tree
    assert paths.problem(value, [tree[0] / "nowhere"], root, "subfolder") is None  # a name, not resolved


def test_a_lookalike_is_judged_by_what_it_folds_into(tree):
    root, outside = tree
    assert paths.problem("sub/\u2025/sub", [root], root) is None  # folds to sub/../sub: still inside
    message = paths.problem("\u2025/outside", [root], root)  # a folder named "‥" inside; folded, it climbs out
    assert message == f"'\u2025/outside' looks like '../outside', which is outside the allowed roots ({root})"
    assert paths.problem("\uff53ub", [root], root) is None  # fullwidth "sub"


def test_field_problem_reads_each_base_the_trainer_may_read_from(tree, tmp_path):
    root, outside = tree
    out = root / "runs" / "out"
    (out / "checkpoint-5").mkdir(parents=True)
    spec = paths.PathField("resume_from_checkpoint", "dir", "either")
    assert paths.field_problem(spec, "latest", [root], root, out) is None
    assert paths.field_problem(spec, "checkpoint-5", [root], root, out) is None
    # inside from the working dir, outside from the output folder: refused (the trainer may read either)
    assert "outside" in paths.field_problem(spec, "x", [root / "sub"], root / "sub", out)
    assert "outside" in paths.field_problem(spec, "x", [root / "sub"], out, root / "sub")
    assert paths.field_problem(paths.PathField("init_lora", "file"), "x", [root / "sub"], root / "sub", out) is None
    logging = paths.PathField("logging_dir", "dir", "output_dir")
    assert paths.field_problem(logging, "../../x", [root], tmp_path / "elsewhere", out) is None  # root/x
    assert "outside" in paths.field_problem(logging, "../../../x", [root], root, out)
    assert paths.field_problem(logging, "../../../x", [root], root, None) is None  # no output folder yet
    latest = paths.PathField("output_dir", "dir")
    assert "outside" in paths.field_problem(latest, "latest", [root / "sub"], root, out)  # only resume's "latest"
    assert paths.field_problem(latest, "sub", [root], root, out) is None


def test_resume_latest_is_the_keyword_even_where_a_file_of_that_name_leads_outside(tree):
    root, outside = tree
    out = root / "runs" / "out"
    out.mkdir(parents=True)
    (root / "latest").symlink_to(outside)
    (out / "latest").symlink_to(outside)
    resume = paths.PathField("resume_from_checkpoint", "dir", "either")
    assert paths.field_problem(resume, "latest", [root], root, out) is None  # the newest checkpoint, not the link
    assert "outside" in paths.field_problem(resume, "latest/", [root], root, out)


def test_field_problem_judges_a_field_by_its_kind(tree):
    root, _ = tree
    name = paths.PathField("pretrained_transformer_subfolder", "subfolder")
    # inside the roots as a folder, but a subfolder name may not climb
    assert paths.problem("sub/../org", [root], root, "dir") is None
    assert "plain relative name" in paths.field_problem(name, "sub/../org", [root], root, None)


@pytest.mark.parametrize("call", [
    lambda root: paths.problem("x", [root], root, "flie"),
    lambda root: paths.check("output_dir", "x", [root], root, "folder"),
    lambda root: paths.PathField("output_dir", "directory"),
])
def test_an_unknown_path_kind_is_a_programming_error_not_a_folder(tree, call):
    with pytest.raises(ValueError, match="unknown path kind '[a-z]+'; one of dir, file, model, webhook, json, "
                                         "subfolder"):
        call(tree[0])


def test_an_unknown_path_base_is_refused():
    with pytest.raises(ValueError, match="logging_dir: unknown path base 'output'; one of workdir, output_dir, either"):
        paths.PathField("logging_dir", "dir", "output")


def test_check_raises_naming_the_field(tree):
    root, _ = tree
    paths.check("output_dir", "sub", [root], root)
    with pytest.raises(paths.PathOutsideRoots) as caught:
        paths.check("output_dir", "../outside", [root], root)
    assert caught.value.field == "output_dir" and caught.value.message.startswith("'../outside' resolves to")
    assert str(caught.value).startswith("output_dir: '../outside' resolves to")
    with pytest.raises(paths.PathOutsideRoots, match="plain relative name"):
        paths.check("tracker_run_name", "../x", [root], root, "subfolder")


def test_roots_from_env(tree, monkeypatch):
    root, outside = tree
    assert paths.roots_from_env({}) is None and paths.roots_from_env({paths.ROOTS_ENV: ""}) is None
    value = paths.roots_env_value([root, root / "out-link"])
    assert json.loads(value) == [str(root), str(root / "out-link")]
    assert paths.roots_from_env({paths.ROOTS_ENV: value}) == [root, outside]  # resolved
    for bad in ('"a"', '[1]', '{"a": 1}', '["a", 2]'):
        with pytest.raises(ValueError, match="SIMPLETUNER_ALLOWED_ROOTS must be a JSON list of folders"):
            paths.roots_from_env({paths.ROOTS_ENV: bad})
    monkeypatch.setenv(paths.ROOTS_ENV, json.dumps([str(root)]))
    assert paths.roots_from_env() == [root]  # the process environment by default


def test_guard_open_checks_only_in_a_server_job(tree, monkeypatch):
    root, outside = tree
    monkeypatch.delenv(paths.ROOTS_ENV, raising=False)
    paths.guard_open("output_dir", outside)  # no roots: the user's own files
    monkeypatch.setenv(paths.ROOTS_ENV, json.dumps([str(root)]))
    monkeypatch.chdir(root)
    paths.guard_open("output_dir", "sub")
    paths.guard_open("output_dir", Path("sub"))
    with pytest.raises(paths.PathOutsideRoots, match="^init_lora: 'out-link/x' resolves to"):
        paths.guard_open("init_lora", Path("out-link/x"), "file")
    with pytest.raises(paths.PathOutsideRoots, match="plain relative name"):
        paths.guard_open("tracker_run_name", "../x", "subfolder")


def test_path_fields_and_nested_blocks_of_the_schemas():
    fields = paths.path_fields(TrainConfig)
    assert fields["logging_dir"] == paths.PathField("logging_dir", "dir", "output_dir")
    assert fields["output_dir"] == paths.PathField("output_dir", "dir", "workdir")
    assert fields["resume_from_checkpoint"].base == "either"
    assert "learning_rate" not in fields
    nested = paths.nested_path_fields(TrainConfig)
    assert nested, "distillation's prompt file is a nested path field"
    for block, inner in nested.items():
        assert all(name == f"{block}.{sub}" for sub, name in ((s, spec.name) for s, spec in inner.items()))
    assert paths.path_fields(DatasetBackend)["instance_data_dir"].kind == "dir"


def test_annotation_classes_finds_models_inside_optional_and_unions():
    from typing import Optional, Union

    class Block:
        model_fields: dict = {}

    class Other:
        model_fields: dict = {}

    assert paths._annotation_classes(Optional[Block]) == [Block]
    assert set(paths._annotation_classes(Union[Block, list[Other], int])) == {Block, Other}
    assert paths._annotation_classes(int) == [] and paths._annotation_classes(None) == []


def test_config_paths_yields_every_path_field_with_its_value():
    from simpletuner.config import load_data_backends, load_train_config
    from tests.server.helpers import data_backends

    config = load_train_config({"model_family": "flux", "model_flavour": "tiny", "output_dir": "runs/a",
                                "resume_from_checkpoint": "latest", "webhook_config": '{"callback_url": '
                                '"http://127.0.0.1:1/x", "webhook_type": "raw"}'}).config
    backends = load_data_backends(data_backends(), config=config)
    found = {field: (value, spec.kind) for field, value, spec in paths.config_paths(config, backends)}
    assert found["output_dir"] == ("runs/a", "dir")
    assert "resume_from_checkpoint" not in found  # "latest" names no folder
    assert "webhook_config" not in found  # parsed already: nothing to open
    # every other path field, set or not (the ones after resume_from_checkpoint too), less JSON fields not given as text
    every = {name for name, spec in paths.path_fields(TrainConfig).items()
             if spec.kind not in ("webhook", "json") and name != "resume_from_checkpoint"}
    assert {f for f in found if not f.startswith("datasets[")} == every
    assert found["init_lora"] == (None, "file") and found["logging_dir"][1] == "dir"
    parsed = config.model_copy(update={"lycoris_config": {"algo": "lokr"}, "deepspeed_config": "ds.json"})
    kinds = {field: value for field, value, _ in paths.config_paths(parsed)}
    assert "lycoris_config" not in kinds and kinds["deepspeed_config"] == "ds.json"  # JSON objects: nothing to open
    assert found["datasets[d].instance_data_dir"] == ("imgs", "dir")
    assert found["datasets[d].cache_dir_vae"] == ("cache/vae", "dir")
    assert found["datasets[te].cache_dir"] == ("cache/text", "dir")
    assert not any(field.startswith("distillation.") for field in found)  # no distillation block
    assert {field for field, _, _ in paths.config_paths(config)} == {f for f in found if not f.startswith("datasets[")}
    assert list(paths.config_paths(None, None)) == []
    only_data = [field for field, _, _ in paths.config_paths(backends=backends)]
    assert only_data == ["datasets[d].instance_data_dir", "datasets[d].cache_dir_vae", "datasets[te].cache_dir"]

    from simpletuner.config.distill import DistillationConfig

    block = DistillationConfig.model_construct(prompt_file="prompts.txt", student_init=None, pairs_cache_dir="pc")
    named = config.model_copy(update={"resume_from_checkpoint": "runs/a/checkpoint-5", "distillation": block})
    found = {field: (value, spec) for field, value, spec in paths.config_paths(named)}
    assert found["resume_from_checkpoint"][0] == "runs/a/checkpoint-5"
    assert found["distillation.prompt_file"] == ("prompts.txt", paths.PathField("distillation.prompt_file", "file"))
    assert found["distillation.student_init"][0] is None and found["distillation.pairs_cache_dir"][0] == "pc"


def test_an_empty_value_is_unset_and_inline_json_is_no_file(tree, tmp_path):
    root, outside = tree
    sub = [root / "sub"]  # the base (root) is outside these roots: any path read from it is refused
    assert paths.problem("", sub, root) is None and paths.problem(None, sub, root, "file") is None
    for kind in ("webhook", "json"):
        for text in ('{"callback_url": "http://x"}', '  [1, 2]', '\n{"a": 1}'):
            assert paths.problem(text, sub, root, kind) is None, (kind, text)
        assert "outside the allowed roots" in paths.problem("hook.json", sub, root, kind)
    assert "outside the allowed roots" in paths.problem('{"a": 1}', sub, root, "file")  # a file may not be JSON
    two = [root / "sub", outside / "in"]
    assert paths.problem("x", two, root) == f"'x' resolves to {root / 'x'}, outside the allowed roots ({root / 'sub'}, {outside / 'in'})"


def test_nested_blocks_keep_each_fields_base():
    from typing import Optional

    from pydantic import BaseModel, Field

    class Block(BaseModel):
        report: str | None = Field(None, json_schema_extra={"path": "file", "path_base": "output_dir"})
        source: str | None = Field(None, json_schema_extra={"path": "dir"})

    class Config(BaseModel):
        block: Optional[Block] = None
        name: str = "x"

    assert paths.nested_path_fields(Config) == {"block": {
        "report": paths.PathField("block.report", "file", "output_dir"),
        "source": paths.PathField("block.source", "dir", "workdir")}}
