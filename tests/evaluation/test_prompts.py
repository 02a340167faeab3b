import json

import pytest

from simpletuner.evaluation.prompts import ValidationPrompt, load_prompt_library, sanitise_nickname, validation_prompts
from tests.helpers import namespace


@pytest.mark.parametrize("name, safe", [
    ("portrait", "portrait"),
    ("Red Square!", "Red_Square"),
    ("../../etc/passwd", "etc_passwd"),
    ("a/b\\c:d", "a_b_c_d"),
    (".hidden", "hidden"),
    ("", "prompt"),
    ("!!!", "prompt"),
    ("x" * 100, "x" * 64),
    ("café-1.v2", "caf_-1.v2"),
])
def test_sanitise_nickname(name, safe):
    assert sanitise_nickname(name) == safe


def test_library_and_validation_prompt_in_order_with_unique_names(tmp_path):
    library = tmp_path / "lib.json"
    library.write_text(json.dumps({"a b": "first", "a_b": "second", "obj": {"prompt": "third"}, "validation": "x"}))
    config = namespace(validation_prompt="main", user_prompt_library=str(library))
    assert validation_prompts(config) == [
        ValidationPrompt("validation", "main"), ValidationPrompt("a_b", "first"), ValidationPrompt("a_b_2", "second"),
        ValidationPrompt("obj", "third"), ValidationPrompt("validation_2", "x"),
    ]


def test_no_prompts():
    assert validation_prompts(namespace(validation_prompt=None, user_prompt_library=None)) == []


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON (line 1"),
    ("[\"a\"]", "must hold a JSON object"),
    ('{"a": 3}', "user_prompt_library['a']: expected a non-empty prompt string"),
    ('{"a": " "}', "user_prompt_library['a']"),
])
def test_library_errors_name_the_problem(tmp_path, content, message):
    path = tmp_path / "lib.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_prompt_library(path)


def test_missing_library_file(tmp_path):
    with pytest.raises(ValueError, match="user_prompt_library: file .* does not exist"):
        load_prompt_library(tmp_path / "nope.json")
