"""multidatabackend.json: entries, defaults, errors by dataset id, warnings, path checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from simpletuner.config import ConfigError, load_data_backends, load_train_config, parse_data_backends


def errors_of(entries, **kwargs):
    with pytest.raises(ConfigError) as info:
        parse_data_backends(entries, **kwargs)
    return info.value.errors


def test_simpletuner_backends_parse(make_backends):
    backends = parse_data_backends(make_backends())
    (dataset,) = backends.datasets
    assert dataset.id == "pics" and dataset.type == "local" and dataset.dataset_type == "image"
    assert dataset.repeats == 2 and dataset.crop is False
    assert dataset.cache_dir_vae == "cache/vae/pics"
    assert backends.text_embeds.id == "text-embeds"
    assert backends.text_embeds.cache_dir == "cache/text/text-embeds"
    assert backends.text_embeds.write_batch_size == 128
    assert backends.image_datasets == [dataset] and backends.eval_datasets == []
    assert backends.warnings == []


def test_dataset_defaults_come_from_the_config(make_backends):
    entries = make_backends()
    del entries[0]["resolution"], entries[0]["resolution_type"]
    dataset = parse_data_backends(entries, resolution=512, resolution_type="pixel").datasets[0]
    assert (dataset.resolution, dataset.resolution_type) == (512, "pixel")
    dataset = parse_data_backends(entries).datasets[0]
    assert (dataset.resolution, dataset.resolution_type) == (1024, "pixel_area")
    config = load_train_config({"model_family": "flux", "resolution": "0.5", "resolution_type": "area"}).config
    dataset = load_data_backends(entries, config=config).datasets[0]
    assert (dataset.resolution, dataset.resolution_type) == (0.5, "area")
    # an area-type default given in pixels is caught on the dataset that inherits it
    errors = errors_of(entries, resolution=1024, resolution_type="area")
    assert errors[0].path == "datasets[pics].resolution"


def test_eval_dataset_and_regularisation_spelling(make_backends):
    entries = make_backends()
    entries.insert(1, {"id": "held-out", "dataset_type": "eval", "instance_data_dir": "datasets/eval",
                       "is_regularization_data": "true"})
    backends = parse_data_backends(entries)
    assert [d.id for d in backends.eval_datasets] == ["held-out"]
    assert backends.eval_datasets[0].is_regularisation_data is True


def test_disabled_entries_are_skipped_even_when_incomplete(make_backends):
    entries = make_backends()
    entries.append({"id": "old", "disabled": "true", "type": "s3"})
    backends = parse_data_backends(entries)
    assert [d.id for d in backends.datasets] == ["pics"]
    assert backends.disabled == ["old"]


def test_unknown_keys_are_warnings_with_suggestions(make_backends):
    entries = make_backends(captoin_strategy="textfile", skip_file_discovery="vae", sparkle=1)
    backends = parse_data_backends(entries)
    assert "datasets[pics].captoin_strategy: unknown key, ignored; did you mean 'caption_strategy'?" in backends.warnings
    assert any(w.startswith("datasets[pics].skip_file_discovery: has no effect here") for w in backends.warnings)
    assert "datasets[pics].sparkle: unknown key, ignored" in backends.warnings


def test_several_text_embeds_need_one_default(make_backends):
    entries = make_backends()
    entries.append({"id": "te2", "dataset_type": "text_embeds"})
    backends = parse_data_backends(entries)
    assert backends.text_embeds.id == "text-embeds"
    entries[1]["default"] = False
    errors = errors_of(entries)
    assert errors[0].path == "datasets" and "need exactly one with \"default\": true" in errors[0].message


BAD_ENTRIES = [
    pytest.param(lambda e: e[0].pop("id"), "datasets[0].id", "is required", id="no-id"),
    pytest.param(lambda e: e[0].pop("instance_data_dir"), "datasets[pics].instance_data_dir", "is required",
                 id="no-folder"),
    pytest.param(lambda e: e.append({**e[0]}), "datasets[pics].id", "duplicate id 'pics'", id="duplicate"),
    pytest.param(lambda e: e[0].update(type="aws"), "datasets[pics].type", "only 'local' backends are supported",
                 id="aws"),
    pytest.param(lambda e: e[0].update(type="ftp"), "datasets[pics].type", "'ftp' is not one of local",
                 id="unknown-type"),
    pytest.param(lambda e: e[0].update(dataset_type="video", video={"num_frames": 33, "max_frames": 17}),
                 "datasets[pics].video.num_frames", "is larger than max_frames (17)", id="video-frames"),
    pytest.param(lambda e: e[0].update(dataset_type="video", video={"clip_mode": "random"}),
                 "datasets[pics].video.clip_mode", "single_beginning, single_middle, multiple_overlapping",
                 id="video-clip-mode"),
    pytest.param(lambda e: e[0].update(dataset_type="image_embeds"), "datasets[pics].dataset_type",
                 "not supported yet", id="image_embeds"),
    pytest.param(lambda e: e[0].update(caption_strategy="parquet"), "datasets[pics].caption_strategy",
                 "not supported yet", id="parquet"),
    pytest.param(lambda e: e[0].update(caption_strategy="instanceprompt"), "datasets[pics].instance_prompt",
                 "is required for caption_strategy 'instanceprompt'", id="instance-prompt"),
    pytest.param(lambda e: e[0].update(crop_style="middle"), "datasets[pics].crop_style",
                 "'middle' is not one of center, random, corner", id="crop-style"),
    pytest.param(lambda e: e[0].update(crop_aspect="wide"), "datasets[pics].crop_aspect",
                 "square, preserve, closest, random", id="crop-aspect"),
    pytest.param(lambda e: e[0].update(repeats=-1), "datasets[pics].repeats", "must be >= 0", id="repeats"),
    pytest.param(lambda e: e[0].update(probability=0), "datasets[pics].probability", "must be > 0", id="probability"),
    pytest.param(lambda e: e[0].update(resolution=1024, resolution_type="area"), "datasets[pics].resolution",
                 "megapixels", id="area"),
    pytest.param(lambda e: e[0].update(resolution="big"), "datasets[pics].resolution", "expected a number",
                 id="resolution-text"),
    pytest.param(lambda e: e[0].update(crop="sometimes"), "datasets[pics].crop", "expected true or false",
                 id="crop-bool"),
    pytest.param(lambda e: e[0].update(maximum_image_size=2048), "datasets[pics].target_downsample_size",
                 "required when maximum_image_size", id="downsample"),
    pytest.param(lambda e: e.pop(1), "datasets", "a text_embeds backend is required", id="no-text-embeds"),
    pytest.param(lambda e: e.pop(0), "datasets", "no enabled image dataset", id="no-images"),
    pytest.param(lambda e: e[1].update(write_batch_size=0), "datasets[text-embeds].write_batch_size",
                 "must be >= 1", id="write-batch"),
    pytest.param(lambda e: e.append("pics"), "datasets[2]", "expected an object", id="not-an-object"),
]


@pytest.mark.parametrize("change, path, message", BAD_ENTRIES)
def test_bad_entries_name_the_dataset_and_key(make_backends, change, path, message):
    entries = make_backends()
    change(entries)
    errors = errors_of(entries)
    matching = [e for e in errors if e.path == path]
    assert matching, errors
    assert any(message in e.message for e in matching), matching


def test_not_a_list():
    assert errors_of({"id": "pics"})[0].path == "datasets"


def test_load_from_file_names_the_file(write_json, make_backends, tmp_path):
    path = write_json("multidatabackend.json", make_backends())
    assert load_data_backends(path).datasets[0].id == "pics"
    entries = make_backends(crop_style="middle")
    path = write_json("bad.json", entries)
    with pytest.raises(ConfigError) as info:
        load_data_backends(str(path))
    assert info.value.source == str(path)
    assert str(info.value).startswith(f"{path}: datasets[pics].crop_style: ")
    bad = tmp_path / "broken.json"
    bad.write_text('[{"id": "x",}]')
    with pytest.raises(ConfigError, match=r"broken.json: not valid JSON: .*line 1, column"):
        load_data_backends(bad)


def _paired(make_backends, pairs, *extra):
    entries = make_backends(conditioning_data=pairs)
    entries[1:1] = [{"id": "refs", "dataset_type": "conditioning", "instance_data_dir": "datasets/refs"},
                    {"id": "masks", "dataset_type": "conditioning", "conditioning_type": "mask",
                     "instance_data_dir": "datasets/masks"}, *extra]
    return entries


def test_conditioning_and_mask_datasets_pair_by_id(make_backends):
    backends = parse_data_backends(_paired(make_backends, ["refs", "masks"]))
    pics = backends.image_datasets[0]
    assert backends.paired(pics, "conditioning").id == "refs" and backends.paired(pics, "mask").id == "masks"
    assert [d.dataset_type for d in backends.datasets] == ["image", "conditioning", "mask"]  # SimpleTuner's spelling
    assert backends.uses_references and backends.warnings == []
    only_masks = parse_data_backends(_paired(make_backends, "masks"))  # one id may be a plain string
    assert only_masks.image_datasets[0].conditioning_data == ["masks"] and not only_masks.uses_references
    assert only_masks.warnings == ["datasets[refs]: a conditioning dataset that no dataset names in its "
                                   "conditioning_data; ignored"]


@pytest.mark.parametrize("pairs,extra,path,message", [
    (["nope"], [], "datasets[pics].conditioning_data", "'nope' is not a dataset id (conditioning and mask datasets: "
                                                       "refs, masks)"),
    (["old"], [{"id": "old", "dataset_type": "conditioning", "instance_data_dir": "x", "disabled": True}],
     "datasets[pics].conditioning_data", "'old' is disabled"),
    (["more"], [{"id": "more", "instance_data_dir": "x"}], "datasets[pics].conditioning_data",
     "'more' is a dataset_type 'image' dataset; pair conditioning or mask datasets"),
    (["refs", "refs2"], [{"id": "refs2", "dataset_type": "conditioning", "instance_data_dir": "x"}],
     "datasets[pics].conditioning_data", "'refs' and 'refs2' are both conditioning datasets"),
    (["refs"], [{"id": "loose", "dataset_type": "conditioning", "conditioning_type": "reference_loose",
                 "instance_data_dir": "x"}], "datasets[loose].conditioning_type", "'reference_loose' is not supported yet"),
    (["refs"], [{"id": "back", "dataset_type": "conditioning", "conditioning_data": "refs", "instance_data_dir": "x"}],
     "datasets[back].conditioning_data", "a conditioning dataset is paired to an image dataset"),
])
def test_conditioning_data_errors_name_the_dataset(make_backends, pairs, extra, path, message):
    errors = errors_of(_paired(make_backends, pairs, *extra))
    assert any(e.path == path and message in e.message for e in errors), errors


def test_reference_images_are_checked_against_the_model(make_backends):
    def check(family, flavour, pairs, eval_pairs=None):
        config = load_train_config({"model_family": family, "model_flavour": flavour}).config
        entries = _paired(make_backends, pairs)
        if eval_pairs is not None:
            entries.insert(1, {"id": "held-out", "dataset_type": "eval", "instance_data_dir": "datasets/eval",
                               "conditioning_data": eval_pairs})
        try:
            return load_data_backends(entries, config=config)
        except ConfigError as exc:
            return [f"{e.path}: {e.message}" for e in exc.errors]

    assert check("sdxl", "base-1.0", ["refs"]) == [
        "datasets[pics].conditioning_data: model_family sdxl flavour 'base-1.0' does not take reference images"]
    assert check("flux", "dev", ["refs"]) == [
        "datasets[pics].conditioning_data: model_family flux flavour 'dev' does not take reference images; "
        "model_flavour kontext does"]
    assert check("flux", "kontext", ["masks"]) == [
        "datasets[pics].conditioning_data: model_flavour 'kontext' is trained on (reference, edit) pairs: name the "
        "conditioning dataset holding this dataset's reference images"]
    assert check("flux", "kontext", ["refs"]).uses_references
    assert check("flux", "tiny", ["refs"]).uses_references and not check("flux", "tiny", ["masks"]).uses_references
    assert check("sdxl", "base-1.0", ["masks"]).image_datasets  # masks go with any model
    # an edit run's eval data needs its references too
    assert check("flux", "kontext", ["refs"], eval_pairs=[]) == [
        "datasets[held-out].conditioning_data: model_flavour 'kontext' is trained on (reference, edit) pairs: name "
        "the conditioning dataset holding this dataset's reference images"]
    assert check("flux", "kontext", ["refs"], eval_pairs=["refs"]).uses_references


# --- what each entry's parsing decides, pinned by value (survivors of the config/data.py mutation pass) ---------

@pytest.mark.parametrize("value", ["true", "1", "yes", "on", "t", "y", " TRUE ", "Yes", True, 1])
def test_disabled_spellings_that_skip_an_entry(make_backends, value):
    entries = make_backends()
    entries.insert(0, {"id": "old", "disabled": value, "type": "s3"})  # invalid: only skipping it lets this parse
    backends = parse_data_backends(entries)
    assert backends.disabled == ["old"] and [d.id for d in backends.datasets] == ["pics"]  # the entries after it too


@pytest.mark.parametrize("value", ["false", "0", "no", "off", "F", "n", False, 0])
def test_values_that_do_not_disable_an_entry(make_backends, value):
    entries = make_backends()
    entries.append({"id": "kept", "disabled": value, "instance_data_dir": "datasets/kept"})
    backends = parse_data_backends(entries)
    assert backends.disabled == [] and [d.id for d in backends.datasets] == ["pics", "kept"]


@pytest.mark.parametrize("value", ["", "2", 2, None])
def test_a_disabled_value_that_is_not_a_yes_or_no_is_refused(make_backends, value):
    entries = make_backends()
    entries.append({"id": "kept", "disabled": value, "instance_data_dir": "datasets/kept"})
    assert [(e.path, e.message) for e in errors_of(entries)] == [
        ("datasets[kept].disabled", f"expected true or false, got {value!r}")]


def test_a_disabled_entry_without_an_id_is_named_by_position(make_backends):
    entries = make_backends()
    entries.append({"disabled": 1, "type": "s3"})
    assert parse_data_backends(entries).disabled == ["datasets[2]"]


def test_an_id_that_cannot_be_a_path_is_named_by_position(make_backends):
    for ident, path in (("a[b]", "datasets[2].id"), ("x]", "datasets[2].id"), ("pics", "datasets[pics].id")):
        entries = make_backends(id=ident)
        entries.append({**entries[0]})
        assert [(e.path, e.message) for e in errors_of(entries)] == [
            (path, f"duplicate id {ident!r} (also used by entry 0)")]


def test_keys_may_be_written_with_dashes_and_kinds_in_any_case(make_backends):
    entries = make_backends()
    entries[0] = {f"--{k}": v for k, v in entries[0].items()}
    entries[1]["dataset_type"] = " Text_Embeds "
    backends = parse_data_backends(entries)
    assert [d.id for d in backends.datasets] == ["pics"] and backends.datasets[0].repeats == 2
    assert backends.text_embeds.id == "text-embeds" and backends.warnings == []


def test_the_british_regularisation_spelling_wins_when_both_are_given(make_backends):
    backends = parse_data_backends(make_backends(is_regularization_data=True, is_regularisation_data=False))
    assert backends.datasets[0].is_regularisation_data is False
    assert backends.warnings == ["datasets[pics].is_regularization_data: unknown key, ignored; did you mean "
                                 "'is_regularisation_data'?"]


def test_an_unsupported_value_is_quoted_as_written(make_backends):
    assert [(e.path, e.message) for e in errors_of(make_backends(type=" AWS "))] == [
        ("datasets[pics].type", "' AWS ' is not supported yet; only 'local' backends are supported")]
    entries = make_backends(caption_strategy="JSONL")
    assert [(e.path, e.message) for e in errors_of(entries)] == [
        ("datasets[pics].caption_strategy", "'JSONL' is not supported yet")]


@pytest.mark.parametrize("change, expected", [
    (lambda e: e[0].update(crop_style="middle"), ("datasets[pics].crop_style", "'middle' is not one of center, "
                                                  "random, corner")),
    (lambda e: e[0].update(type="csv"), ("datasets[pics].type", "'csv' is not supported yet; only 'local' "
                                         "backends are supported")),
    (lambda e: e[1].update(write_batch_size=0), ("datasets[text-embeds].write_batch_size", "must be >= 1, got 0")),
    (lambda e: e[1].update(type="aws"), ("datasets[text-embeds].type", "'aws' is not supported yet; only 'local' "
                                         "backends are supported")),
], ids=["bad-image-entry", "unsupported-image-entry", "bad-text-embeds", "unsupported-text-embeds"])
def test_an_invalid_entry_is_not_also_reported_missing(make_backends, change, expected):
    """A broken image or text-embeds entry is one error: not also "no enabled image dataset" / "a text_embeds
    backend is required"."""
    entries = make_backends()
    change(entries)
    assert [(e.path, e.message) for e in errors_of(entries)] == [expected]


def test_an_unsupported_dataset_type_is_not_an_image_dataset(make_backends):
    entries = make_backends(dataset_type="audio")
    assert [(e.path, e.message) for e in errors_of(entries)] == [
        ("datasets[pics].dataset_type", "'audio' is not supported yet"),
        ("datasets", "no enabled image dataset; add one with dataset_type 'image' (or 'video')")]


def test_text_embeds_backends_and_their_default_by_value(make_backends):
    entries = make_backends()
    entries.append({"id": "te2", "dataset_type": "text_embeds"})
    assert parse_data_backends(entries).warnings == [
        "datasets: 2 text_embeds backends; using the default one, 'text-embeds'"]
    entries[2]["default"] = True
    assert [(e.path, e.message) for e in errors_of(entries)] == [
        ("datasets", '2 text_embeds backends (text-embeds, te2) need exactly one with "default": true, found 2')]
    entries[1]["default"], entries[2]["default"] = False, True
    assert parse_data_backends(entries).text_embeds.id == "te2"


def test_images_are_optional_only_when_asked(make_backends):
    text_only = make_backends()[1:]
    assert parse_data_backends(text_only, require_images=False).datasets == []
    assert [e.path for e in errors_of(text_only)] == ["datasets"]


def test_a_resolution_of_zero_from_the_config_is_checked(make_backends):
    entries = make_backends()
    del entries[0]["resolution"]
    assert [(e.path, e.message) for e in errors_of(entries, resolution=0)] == [
        ("datasets[pics].resolution", "(from the config) must be > 0, got 0")]


def test_explicit_defaults_win_over_the_config_and_a_list_has_no_source(make_backends):
    entries = make_backends()
    del entries[0]["resolution"], entries[0]["resolution_type"]
    config = load_train_config({"model_family": "flux", "resolution": 512, "resolution_type": "pixel"}).config
    backends = load_data_backends(entries, config=config, resolution=768)
    assert (backends.datasets[0].resolution, backends.datasets[0].resolution_type) == (768, "pixel")
    backends = load_data_backends(entries, config=config, resolution_type="pixel_area")
    assert (backends.datasets[0].resolution, backends.datasets[0].resolution_type) == (512, "pixel_area")
    assert backends.source is None


def test_a_reference_error_names_the_file(write_json, make_backends):
    entries = _paired(make_backends, ["refs"])
    path = write_json("multidatabackend.json", entries)
    config = load_train_config({"model_family": "sdxl"}).config
    with pytest.raises(ConfigError) as info:
        load_data_backends(path, config=config)
    assert info.value.source == str(path)
    assert [e.path for e in info.value.errors] == ["datasets[pics].conditioning_data"]
    assert load_data_backends(path).source == str(path)


def test_the_data_backend_file_beside_a_config(tmp_path):
    from simpletuner.config import data_backend_beside, found_beside_message

    config = tmp_path / "config.json"
    assert data_backend_beside(None) is None
    assert data_backend_beside(config) is None  # nothing beside it
    (tmp_path / "multidatabackend.json").mkdir()
    assert data_backend_beside(str(config)) is None  # a folder of that name is not the file
    (tmp_path / "multidatabackend.json").rmdir()
    (tmp_path / "multidatabackend.json").write_text("[]")
    assert data_backend_beside(config) == str(tmp_path / "multidatabackend.json")
    assert found_beside_message("a/multidatabackend.json", Path("a/config.json")) == (
        "data_backend_config: not set; using a/multidatabackend.json, found beside a/config.json")


def test_a_dataset_field_carries_its_group_and_path_kind():
    """``_field`` runs while the backend classes are built, once at import; called here directly (the schema route,
    the web UI's form and simpletuner.config.paths read what it sets)."""
    from simpletuner.config.data import DatasetBackend, _field

    field = _field(2, "how often each image is seen", "dir", ge=0)
    assert field.default == 2 and field.description == "how often each image is seen"
    assert field.json_schema_extra == {"group": "data", "path": "dir"}
    assert [m.ge for m in field.metadata if hasattr(m, "ge")] == [0]
    assert _field(None, "x").json_schema_extra == {"group": "data"}  # no path kind: no "path" key
    assert _field(None, "x", "").json_schema_extra == {"group": "data"}
    assert DatasetBackend.model_fields["instance_data_dir"].json_schema_extra == {"group": "data", "path": "dir"}


def test_an_empty_id_or_one_with_x_in_it_is_named_as_expected(make_backends):
    entries = make_backends(id="")
    assert "datasets[0].id" in [e.path for e in errors_of(entries)]  # an empty id: by position
    entries = make_backends(id="XL-set", crop_style="middle")
    assert [e.path for e in errors_of(entries)] == ["datasets[XL-set].crop_style"]


@pytest.mark.parametrize("content, message", [
    ({"id": "pics"}, "expected a JSON list of backends, got an object"),
    (5, "expected a JSON list of backends, got 5"),
    ("pics", "expected a JSON list of backends, got 'pics'"),
])
def test_a_file_that_is_not_a_list_names_the_file(write_json, content, message):
    path = write_json("multidatabackend.json", content)
    with pytest.raises(ConfigError) as info:
        load_data_backends(path)
    assert info.value.source == str(path)
    assert [(e.path, e.message) for e in info.value.errors] == [("datasets", message)]


def test_every_entry_is_checked_after_one_that_is_not_an_object(make_backends):
    entries = make_backends(crop_style="middle")
    entries.insert(0, "pics")
    assert [e.path for e in errors_of(entries)] == ["datasets[0]", "datasets[pics].crop_style"]


def test_conditioning_errors_by_whole_message(make_backends):
    entries = make_backends(conditioning_data=["refs"])
    assert [(e.path, e.message) for e in errors_of(entries)] == [
        ("datasets[pics].conditioning_data", "'refs' is not a dataset id (conditioning and mask datasets: none)")]
    entries = _paired(make_backends, ["refs", "refs2"], {"id": "refs2", "dataset_type": "conditioning",
                                                         "instance_data_dir": "x"})
    assert [(e.path, e.message) for e in errors_of(entries)] == [
        ("datasets[pics].conditioning_data", "'refs' and 'refs2' are both conditioning datasets; one of each kind "
                                             "per dataset is supported")]


def test_an_id_that_is_not_text_is_one_error_per_entry_not_a_duplicate(make_backends):
    entries = make_backends(id=7)
    entries.append({**entries[0]})
    assert [(e.path, e.message) for e in errors_of(entries)] == [
        ("datasets[0].id", "expected a string, got 7"), ("datasets[2].id", "expected a string, got 7")]


def test_a_refused_key_is_one_error_and_the_entries_after_it_are_still_read(make_backends):
    entries = make_backends(maximum_aspect_ratio=2.0)
    assert [(e.path, e.message) for e in errors_of(entries)] == [
        ("datasets[pics].maximum_aspect_ratio", "2.0: is not implemented: images of every aspect ratio train; "
                                                "remove it or move those images out of the folder")]


def test_an_invalid_video_dataset_is_not_also_reported_missing(make_backends):
    entries = make_backends(dataset_type="video", crop_style="middle")
    assert [e.path for e in errors_of(entries)] == ["datasets[pics].crop_style"]


def test_text_embeds_errors_whole(make_backends):
    entries = make_backends()
    assert [(e.path, e.message) for e in errors_of(entries[:1])] == [
        ("datasets", 'a text_embeds backend is required, e.g. {"id": "text-embeds", "dataset_type": "text_embeds", '
                     '"type": "local", "default": true}')]
    # two good text-embeds backends and a broken one: the broken one is the error, not the count of defaults
    entries[1]["default"] = False
    entries += [{"id": "te2", "dataset_type": "text_embeds"},
                {"id": "te3", "dataset_type": "text_embeds", "write_batch_size": 0}]
    assert [(e.path, e.message) for e in errors_of(entries)] == [
        ("datasets[te3].write_batch_size", "must be >= 1, got 0")]


def test_an_unknown_key_far_from_every_field_gets_no_suggestion(make_backends):
    backends = parse_data_backends(make_backends(repeat_count=3, crop_aspct="square"))
    assert "datasets[pics].repeat_count: unknown key, ignored" in backends.warnings
    assert "datasets[pics].crop_aspct: unknown key, ignored; did you mean 'crop_aspect'?" in backends.warnings
