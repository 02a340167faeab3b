"""The video families' quickstart examples, trained as tests/e2e/test_families_e2e.py trains every example (there
its docstring): ``simpletuner train`` on datasets/sample_video with short clips, the loss on a fixed batch falls, a
resumed run continues bit for bit, the validation mp4 decodes to the frames asked for, and the exported LoRA changes
what the pipeline generates. A file of their own so that the two test workers share the examples."""

from __future__ import annotations

import pytest

from tests.e2e import test_families_e2e as families

pytestmark = pytest.mark.e2e
CASES = families.example_cases("video")


@pytest.mark.parametrize("example,flavour", CASES, ids=families.case_ids(CASES))
def test_video_example_trains_resumes_and_changes_the_pipeline(example, flavour, tmp_path, monkeypatch):
    families.check_example(example, flavour, tmp_path, monkeypatch)
