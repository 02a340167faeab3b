import numpy as np
import pytest
import torch
from PIL import Image

from simpletuner.evaluation.clip_score import ClipScorer, clip_model_path, default_clip_model, ensure_tiny_clip
from tests.helpers import flux_config


@pytest.fixture(scope="module")
def scorer(tiny_dir):
    return ClipScorer(str(ensure_tiny_clip()))


def _images(n, seed=0):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)) for _ in range(n)]


def test_tiny_clip_is_a_standard_checkpoint(tiny_dir, tmp_path):
    from transformers import CLIPModel, CLIPProcessor

    from simpletuner.evaluation.clip_score import write_tiny_clip

    folder = ensure_tiny_clip()
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    model = CLIPModel.from_pretrained(folder)
    # what write_tiny_clip promises survives the save/load round trip: the shared projection offset ...
    assert torch.equal(model.visual_projection.weight, model.text_projection.weight)
    assert torch.all(model.text_model.final_layer_norm.bias == 1.0)
    # ... and the checkpoint is deterministic (a second write loads to the same weights)
    write_tiny_clip(tmp_path / "again")
    again = CLIPModel.from_pretrained(tmp_path / "again").state_dict()
    assert all(torch.equal(v, again[k]) for k, v in model.state_dict().items())
    assert CLIPProcessor.from_pretrained(folder).tokenizer("a red square")["input_ids"]
    assert ensure_tiny_clip() == folder  # written once


def test_score_is_100_times_the_cosine(scorer):
    images, prompts = _images(3), ["a red square", "a blue circle on the green", "photo"]
    inputs = scorer.processor(text=prompts, images=images, return_tensors="pt", padding=True)
    with torch.no_grad():
        image = scorer.model.get_image_features(pixel_values=inputs["pixel_values"])
        text = scorer.model.get_text_features(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    image = getattr(image, "pooler_output", image)
    text = getattr(text, "pooler_output", text)
    expected = (100 * torch.nn.functional.cosine_similarity(image, text)).clamp(min=0)
    scores = scorer.score(images, prompts)
    assert scores == pytest.approx(expected.tolist(), abs=1e-4)
    assert all(0 <= s <= 100 for s in scores)
    assert len(set(round(s, 3) for s in scores)) == 3  # depends on the pair, not constant


def test_score_does_not_depend_on_the_batch(scorer):
    images, prompts = _images(2, seed=1), ["a red square", "a much longer prompt about a blue circle"]
    together = scorer.score(images, prompts)
    alone = [scorer.score([im], [p])[0] for im, p in zip(images, prompts)]
    assert together == pytest.approx(alone, abs=1e-4)


def test_score_checks_lengths(scorer):
    with pytest.raises(ValueError, match="2 images but 1 prompts"):
        scorer.score(_images(2), ["a"])


def test_model_path_rules(tiny_dir):
    tiny = str(ensure_tiny_clip())
    assert clip_model_path(flux_config(pretrained_evaluation_model_name_or_path="tiny")) == tiny
    # the default CLIP on a tiny run means the tiny CLIP: tests and the demo never download
    assert clip_model_path(flux_config()) == tiny
    assert clip_model_path(flux_config(pretrained_evaluation_model_name_or_path="/models/clip")) == "/models/clip"
    real = flux_config(model_flavour="dev")
    assert clip_model_path(real) == default_clip_model() == "openai/clip-vit-large-patch14"


def test_writing_the_tiny_clip_leaves_the_global_rng_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("SIMPLETUNER_TINY_DIR", str(tmp_path))
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    ensure_tiny_clip()
    assert torch.equal(torch.rand(3), expected)


def test_unloadable_model_names_the_field(tmp_path):
    with pytest.raises(OSError, match="pretrained_evaluation_model_name_or_path"):
        ClipScorer(str(tmp_path / "missing"))
