import random

import pytest
import torch

from simpletuner.data.cache import text_key
from simpletuner.data.discovery import DatasetError
from simpletuner.models.base import TextEmbedding
from simpletuner.training.evaluator import Evaluator
from tests.helpers import CpuAccelerator, RecordingReporter


def _evaluator(make_setup, adapter, reporter=None, **overrides):
    config, backends = make_setup(**overrides)
    return Evaluator(config, backends, adapter, CpuAccelerator(), reporter or RecordingReporter())


def _kinds(reporter):
    return [(e[0], e[1], e[2]) if e[0] == "image" else (e[0], e[1]) for e in reporter.events]


@pytest.mark.parametrize("overrides, enabled, message", [
    ({"validation_preview": True}, True, "validation_preview: needs validation images"),
    ({"validation_preview": True, "validation_steps": 5}, True, "validation_preview: needs validation images"),
    ({"validation_steps": 5, "validation_prompt": "a", "validation_resolution": "40"}, True,
     "validation_resolution: 40x40 is not a multiple of 16"),
])
def test_contradictory_settings_fail_at_construction(make_setup, tiny_adapter, overrides, enabled, message):
    with pytest.raises(ValueError, match=message):
        _evaluator(make_setup, tiny_adapter, RecordingReporter(enabled=enabled), **overrides)


def test_an_empty_eval_dataset_is_named(make_setup, tiny_adapter, tmp_path):
    config, backends = make_setup()
    for p in (tmp_path / "eval").iterdir():
        p.unlink()
    with pytest.raises(DatasetError, match=r"datasets\[held-out\]: no usable images"):
        Evaluator(config, backends, tiny_adapter, CpuAccelerator(), RecordingReporter())


def test_fill_caches_encodes_eval_latents_and_prompts_once(make_setup, tiny_adapter, tmp_path):
    ev = _evaluator(make_setup, tiny_adapter, validation_steps=2, validation_prompt="a red square",
                    validation_guidance_real=2.0, eval_steps_interval=3)
    captions = [(tmp_path / "eval" / f"{n}.txt").read_text().strip() for n in ("00_orange_circle", "01_red_square")]
    assert ev.captions() == ["a red square"] + captions
    assert ev.negative_prompts() == [""]  # cached apart: a pipeline may encode its negatives differently
    assert ev.fill_caches(show_progress=False) == (2, 4)
    assert ev.fill_caches(show_progress=False) == (0, 0)


def test_schedule_events_and_training_state(make_setup, tiny_adapter, tiny_transformer):
    reporter = RecordingReporter()
    ev = _evaluator(make_setup, tiny_adapter, reporter, validation_steps=2, validation_prompt="a red square",
                    eval_steps_interval=3, evaluation_type="clip", validation_preview=True, validation_preview_steps=1)
    ev.fill_caches(show_progress=False)
    model = tiny_transformer
    model.train()
    generator = torch.Generator().manual_seed(4)
    ev.generators = [generator]
    # a forward hook that draws from every RNG: validation must leave no trace of it
    def draw(*args):
        torch.rand(1), random.random(), torch.rand(1, generator=generator)

    hook = model.register_forward_pre_hook(draw)
    try:
        torch.manual_seed(0)
        expected_torch = torch.get_rng_state()
        expected_gen = generator.get_state()
        results = {step: ev.on_step(step, model, loss=0.1 * step, lr=1e-4) for step in range(1, 7)}
        assert torch.equal(torch.get_rng_state(), expected_torch) and torch.equal(generator.get_state(), expected_gen)
        assert model.training and torch.is_grad_enabled()
    finally:
        hook.remove()
        model.eval()
    due = {step: set(m) - {"train/loss", "train/lr"} for step, m in results.items()}
    assert due[1] == due[5] == set()
    assert due[2] == due[4] == {"clip_score/validation", "clip_score/mean"}
    assert due[3] == {f"eval/loss_sigma_{s / 10:g}" for s in range(1, 10)} | {"eval/loss"}
    assert due[6] == due[2] | due[3]
    assert results[3]["eval/loss"] == results[6]["eval/loss"]  # weights unchanged -> the same eval loss

    assert _kinds(reporter) == [
        ("image", "preview", 2), ("image", "preview", 2), ("image", "validation", 2), ("scores", 2),
        ("scores", 3),
        ("image", "preview", 4), ("image", "preview", 4), ("image", "validation", 4), ("scores", 4),
        ("image", "preview", 6), ("image", "preview", 6), ("image", "validation", 6), ("scores", 6),
    ]
    scores = {e[1]: e[2] for e in reporter.events if e[0] == "scores"}
    assert scores[6] == results[6] and scores[6]["train/loss"] == pytest.approx(0.6)


def test_startup_and_end(make_setup, tiny_adapter, tiny_transformer):
    reporter = RecordingReporter()
    ev = _evaluator(make_setup, tiny_adapter, reporter, validation_steps=4, validation_prompt="a red square",
                    validation_on_startup=True)
    assert ev.eval_every == 4  # eval loss falls back to validation_steps when an eval dataset exists
    assert set(ev.on_start(tiny_transformer, 0)) >= {"eval/loss"}
    ev.on_step(4, tiny_transformer, loss=1.0, lr=1.0)
    ev.on_end(4, tiny_transformer)  # step 4 was just validated: nothing more
    ev2 = _evaluator(make_setup, tiny_adapter, reporter, validation_steps=4, validation_prompt="a red square")
    assert ev2.on_start(tiny_transformer, 0) == {}
    ev2.on_end(5, tiny_transformer)  # the last step had no validation: a final one
    assert [e[2] for e in reporter.events if e[0] == "image"] == [0, 4, 5]


def test_no_prompts_means_no_validation(make_setup, tiny_adapter, tiny_transformer, caplog):
    ev = _evaluator(make_setup, tiny_adapter, validation_steps=1, eval_dataset=False, evaluation_type="clip")
    assert "no validation images" in caplog.text and "no CLIP scores" in caplog.text
    assert not ev.validating and not ev.evaluating
    assert ev.on_step(1, tiny_transformer, loss=1.0) == {"train/loss": 1.0}


def test_missing_prompt_embedding_is_encoded_on_demand(make_setup, tiny_adapter):
    ev = _evaluator(make_setup, tiny_adapter, validation_steps=1, validation_prompt="a green square")
    embedding = ev.prompt_embedding("a green square")
    assert ev.text_cache.has(text_key("a green square", tiny_adapter.text_cache_identity()))
    assert embedding["prompt_embeds"].shape[0] == tiny_adapter.t5_max_length


def test_the_negative_prompt_is_encoded_and_cached_as_a_negative(make_setup, tiny_adapter, monkeypatch):
    """A family whose pipeline encodes negatives differently (Sana, Lumina 2) gets them through
    encode_negative_prompts, cached apart from the same text as a positive prompt."""
    def negatives(prompts):
        return [TextEmbedding({k: v * 0 for k, v in e.tensors.items()}) for e in tiny_adapter.encode_prompts(prompts)]

    monkeypatch.setattr(tiny_adapter, "encode_negative_prompts", negatives)
    ev = _evaluator(make_setup, tiny_adapter, validation_steps=1, validation_prompt="blurry",
                    validation_negative_prompt="blurry", validation_guidance_real=2.0, eval_dataset=False)
    assert ev.fill_caches(show_progress=False) == (0, 2)  # "blurry" once as a prompt, once as a negative
    assert ev.prompt_embedding("blurry")["prompt_embeds"].abs().sum() > 0
    assert ev.negative_embedding("blurry")["prompt_embeds"].abs().sum() == 0


class CountingAccelerator(CpuAccelerator):
    def __init__(self, main: bool):
        self.is_main_process = main
        self.barriers = 0

    def wait_for_everyone(self):
        self.barriers += 1


def test_every_rank_meets_the_same_barriers(make_setup, tiny_adapter, tiny_transformer):
    config, backends = make_setup(validation_steps=2, validation_prompt="a red square", eval_steps_interval=3)
    ranks = [CountingAccelerator(main=True), CountingAccelerator(main=False)]
    reporters = [RecordingReporter(), RecordingReporter()]
    for acc, reporter in zip(ranks, reporters):
        ev = Evaluator(config, backends, tiny_adapter, acc, reporter)
        for step in range(1, 5):
            ev.on_step(step, tiny_transformer, loss=1.0)
        # step 4 already had validation (on rank 0 only): no rank may wait for a final one; eval loss was
        # last measured at step 3, so every rank waits once more for the final evaluation
        ev.on_end(4, tiny_transformer)
    assert ranks[0].barriers == ranks[1].barriers == 4  # steps 2, 3, 4 and the final evaluation
    assert reporters[1].events == [] and reporters[0].events  # images and scores from the main process only


def test_an_edit_model_needs_a_reference_image_per_prompt(make_setup, tmp_path):
    import json

    from simpletuner.models.flux import FluxAdapter
    from tests.conftest import REPO
    from tests.helpers import flux_config

    adapter = FluxAdapter(flux_config(), references=True)
    with pytest.raises(ValueError, match="validation_reference_image: model_flavour 'tiny' edits a reference image; "
                                         "name the image prompt 'make it red' edits"):
        _evaluator(make_setup, adapter, validation_steps=2, validation_prompt="make it red", eval_dataset=False)
    with pytest.raises(ValueError, match="validation_reference_image: file 'missing.png' does not exist"):
        _evaluator(make_setup, adapter, validation_steps=2, validation_prompt="make it red", eval_dataset=False,
                   validation_reference_image="missing.png")
    library = tmp_path / "library.json"
    library.write_text(json.dumps({"ok": {"prompt": "make it blue",
                                          "reference_image": str(REPO / "datasets/edit/reference/01_square.png")},
                                   "bare": "make it green"}))
    with pytest.raises(ValueError, match=r"user_prompt_library\['bare'\].reference_image: model_flavour 'tiny'"):
        _evaluator(make_setup, adapter, validation_steps=2, user_prompt_library=str(library), eval_dataset=False)


def test_fill_caches_encodes_each_reference_once_per_resolution(make_setup):
    from simpletuner.models.flux import FluxAdapter
    from tests.conftest import REPO
    from tests.helpers import flux_config

    adapter = FluxAdapter(flux_config(), references=True)
    reference = str(REPO / "datasets/edit/reference/00_circle.png")
    ev = _evaluator(make_setup, adapter, validation_steps=2, validation_prompt="make it red", eval_dataset=False,
                    validation_reference_image=reference, validation_resolution="32,48x32")
    ev.fill_caches(show_progress=False)
    forwards = adapter.vae_forwards
    assert forwards >= 2 and set(ev._references) == {(reference, 32, 32), (reference, 48, 32)}
    (item,) = ev.prompts
    reference_48x32 = ev.reference_latents(item, 48, 32)
    assert reference_48x32["reference_latents"].shape == (4, 4, 6) and adapter.vae_forwards == forwards
    assert reference_48x32["reference_pixels"].shape == (3, 32, 48)  # for a pipeline that takes the image itself
    # a model without references ignores them
    plain = _evaluator(make_setup, FluxAdapter(flux_config()), validation_steps=2, validation_prompt="x",
                       eval_dataset=False, validation_reference_image=reference)
    assert plain.reference_latents(plain.prompts[0], 32, 32) is None
