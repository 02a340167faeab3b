"""The battery every model family passes, in the spirit of diffusers' ``ModelTesterMixin``.

A test class inherits ``FamilyContract`` and provides a ``family`` fixture (a name in the family table) and, where
a family has several tiny flavours (Wan's T2V, I2V and two-expert 2.2), a ``flavour`` fixture; ``test_contract.py``
runs it over the whole table, so adding a family to the table adds it here. Video families (``temporal_compression``
set) run the same checks on (B, C, F, h, w) latents of a short clip. Each check runs the family's own tiny
checkpoint through the family's own diffusers pipeline:

- the tiny flavour is in the diffusers layout, deterministic, and loads with the pipeline's ``from_pretrained``;
- the adapter's prediction equals what the pipeline hands its scheduler, from cached embeddings and from a prompt;
- live previews decode exactly the latents the pipeline's VAE decodes (or the family has no preview decoder);
- every LoRA preset targets real modules; a 3-step LoRA run through the real trainer saves a LoRA that the pipeline
  loads as its users load it and that reproduces the trained model's prediction; ``init_lora`` reads what
  ``save_lora`` writes;
- cache identities change when an encoder changes, and only then;
- a declared TREAD layout routes a subset of the image tokens and restores the full sequence;
- the eval loss is the objective's and is the same every time.

``EditFlavourContract`` runs over every flavour the table lists in a family's ``reference_flavours`` (an edit model:
Flux Kontext, ...), on the family's tiny weights loaded as that flavour: the prediction with a reference image equals
the edit pipeline's, given the encoded reference or the image itself; it depends on the reference; a LoRA trained on
(reference, edit) pairs through the real trainer loads into the edit pipeline and reproduces the trained model's
prediction for each reference; TREAD routes the target and reference tokens; the eval loss with references repeats.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from simpletuner.config import family_names, get_family, load_data_backends, load_train_config
from simpletuner.config.families import tiny_flavours
from simpletuner.models.base import TextEmbedding
from simpletuner.models.registry import get_adapter_class
from tests.conftest import REPO

PROMPT = "a red circle on a blue background"


def family_config(family: str, **overrides):
    values = {"model_family": family, "model_flavour": "tiny", "mixed_precision": "no", "seed": 0,
              "max_train_steps": 3, "data_backend_config": "unused.json", "lora_dropout": 0.0}
    values.update(overrides)
    return load_train_config(values).config


def loaded_adapter(family: str, **overrides):
    """The family's adapter on its tiny flavour (or ``overrides``) with its VAE and text encoders loaded."""
    adapter = get_adapter_class(family)(family_config(family, **overrides))
    adapter.load_vae()
    adapter.load_text_encoders()
    return adapter


def group_offload_losses(family: str, tmp_path, precision: str, flavour: str = "tiny") -> list[list[float]]:
    """The losses of two 2-step LoRA runs of a tiny video family on short clips of datasets/sample_video with a
    quantized base and gradient checkpointing: without, then with block-level group offload (one block a group)."""
    from simpletuner.training.trainer import train

    dataset = tmp_path / "clips"
    shutil.copytree(REPO / "datasets" / "sample_video", dataset)
    frames = get_adapter_class(family).temporal_compression + 1
    entries = [{"id": "clips", "dataset_type": "video", "instance_data_dir": str(dataset),
                "caption_strategy": "textfile", "resolution": 64, "resolution_type": "pixel",
                "cache_dir_vae": str(tmp_path / "cache/vae"), "video": {"num_frames": frames, "frame_rate": 8}},
               {"id": "text", "dataset_type": "text_embeds", "cache_dir": str(tmp_path / "cache/text")}]
    losses = []
    for offload in (False, True):
        config = family_config(family, model_flavour=flavour, output_dir=str(tmp_path / f"out-{offload}"),
                               max_train_steps=2, learning_rate=1e-2, base_model_precision=precision,
                               gradient_checkpointing=True, enable_group_offload=offload,
                               group_offload_type="block_level", group_offload_blocks_per_group=1)
        losses.append(train(config, load_data_backends(entries, config=config)).losses)
    return losses


def _record_steps(pipe, record) -> None:
    """Call ``record(model_output, sample)`` at each ``step`` of the pipeline's own scheduler, not at a copy's the
    pipeline makes of it for another stream (LTX-2 deep-copies its scheduler for the audio latents)."""
    scheduler = pipe.scheduler
    base = type(scheduler)

    def step(self, model_output, timestep, sample, *args, **kwargs):
        if self is scheduler:
            record(model_output, sample)
        return base.step(self, model_output, timestep, sample, *args, **kwargs)

    scheduler.__class__ = type(f"Recording{base.__name__}", (base,), {"step": step})


def _capture_scheduler_input(pipe):
    """Record the model output the pipeline hands its scheduler's first ``step``."""
    captured = []
    _record_steps(pipe, lambda output, sample: captured or captured.append(output.detach().clone()))
    return captured


def _size(adapter) -> int:
    return 4 * adapter.resolution_multiple


def _frames(adapter) -> int | None:
    """Pixel frames of the contract's clip: two latent frames for a video family, None for an image family."""
    return adapter.temporal_compression + 1 if adapter.is_video else None


def _pixels(adapter) -> torch.Tensor:
    """A deterministic picture (or clip) of 8-bit values in [-1, 1], as the data layer loads them."""
    size, frames = _size(adapter), _frames(adapter)
    g = torch.Generator().manual_seed(3)
    shape = (1, 3, size, size) if frames is None else (1, 3, frames, size, size)
    return torch.randint(0, 256, shape, generator=g).float() / 127.5 - 1.0


def _capture_scheduler_steps(pipe):
    """Record (model output, latents) the pipeline hands its scheduler's ``step`` at every step."""
    captured = []
    _record_steps(pipe, lambda output, sample: captured.append((output.detach().clone(), sample.detach().clone())))
    return captured


def edit_cases() -> list[tuple[str, str]]:
    """(family, flavour) of every edit flavour in the family table."""
    return [(name, flavour) for name in family_names() for flavour in get_family(name).reference_flavours]


class _Fixtures:
    """Class-scoped fixtures over an ``adapter`` fixture: its transformer, a prompt's embeddings, latents."""


    @pytest.fixture(scope="class")
    def transformer(self, adapter):
        return adapter.load_transformer().eval().requires_grad_(False)

    @pytest.fixture(scope="class")
    def cache_entry(self, adapter):
        """What the latent cache stores for one picture or clip (latents, plus any conditioning beside them)."""
        return adapter.latent_cache_entries(_pixels(adapter))[0]

    @pytest.fixture(scope="class")
    def text(self, adapter, cache_entry):
        text = TextEmbedding.collate(adapter.encode_prompts([PROMPT]))
        text.update({k: v.unsqueeze(0) for k, v in cache_entry.items() if k != "latents"})
        return text

    @pytest.fixture(scope="class")
    def latents(self, adapter, cache_entry):
        shape = (1, *cache_entry["latents"].shape)  # the family's latent layout
        return torch.randn(shape, generator=torch.Generator().manual_seed(0))


class FamilyContract(_Fixtures):
    # ---- fixtures (class-scoped: one adapter and transformer per family) ------------------------------------
    @pytest.fixture(scope="class")
    def flavour(self):
        return "tiny"

    @pytest.fixture(scope="class")
    def adapter(self, family, flavour, tiny_dir):
        return loaded_adapter(family, model_flavour=flavour)

    # ---- the checks ---------------------------------------------------------------------------------------
    def test_weight_sources_are_checked_before_anything_loads(self, family, adapter, tmp_path):
        from simpletuner.models.weights import WeightLoadError

        adapter.check_weights()  # the tiny flavour holds every piece the run loads
        real = next(name for name, path in get_family(family).flavours.items() if path is not None)
        copy = tmp_path / "model"
        shutil.copytree(adapter.ensure_tiny_checkpoint(), copy)
        shutil.rmtree(copy / "vae")
        user = get_adapter_class(family)(family_config(family, model_flavour=real,
                                                       pretrained_model_name_or_path=str(copy)))
        with pytest.raises(WeightLoadError, match=r"pretrained_model_name_or_path: .* has no VAE in vae/"):
            user.check_weights()

    def test_tiny_checkpoint_is_the_diffusers_layout(self, adapter, tmp_path):
        path = adapter.ensure_tiny_checkpoint()
        index = json.loads((path / "model_index.json").read_text())
        # the pipeline class, or the diffusers pipeline it extends (a family may add what training needs to it)
        assert index["_class_name"] in [c.__name__ for c in adapter.pipeline_class.__mro__]
        for component, spec in index.items():
            if not component.startswith("_") and isinstance(spec, list) and spec[0] is not None:
                assert (path / component).is_dir(), component
        assert (path / adapter.denoiser_subfolder).is_dir() and (path / "scheduler").is_dir()
        pipe = adapter.pipeline_class.from_pretrained(path)  # diffusers' own loader reads it as a whole
        assert getattr(pipe, adapter.denoiser_subfolder) is not None
        # deterministic: writing it again gives the same weights
        adapter.write_tiny(tmp_path / "again")
        from safetensors.torch import load_file

        for sub in (adapter.denoiser_subfolder, "vae"):
            for file in sorted((path / sub).glob("*.safetensors")):
                a, b = load_file(file), load_file(tmp_path / "again" / sub / file.name)
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), file

    def test_family_row_matches_the_adapter(self, family, adapter):
        row = get_family(family)
        assert type(adapter).family == family
        assert len(adapter.text_encoder_specs) == row.num_text_encoders
        assert row.modality == ("video" if adapter.is_video else "image")
        assert row.resolution_multiple == adapter.resolution_multiple  # the validate-time scan buckets with the row's
        assert adapter.config.prediction_type == row.default_objective == adapter.objective.name

    @pytest.mark.parametrize("mode", ["embeddings", "prompt"])
    def test_prediction_matches_the_pipeline(self, adapter, transformer, text, latents, mode):
        """What the adapter predicts for (noisy latents, t, text) is exactly what the family's pipeline computes
        for the same latents at its first step the run trains on (the first step, but for a two-expert model's
        low-noise expert), whether it gets cached embeddings or encodes the prompt itself."""
        pipe = adapter.build_pipeline(transformer)
        pipe.set_progress_bar_config(disable=True)
        captured = _capture_scheduler_steps(pipe)
        size = _size(adapter)
        kwargs = adapter.validation_pipeline_kwargs(text, None, guidance=1.0, guidance_real=1.0)
        if mode == "prompt":
            kwargs = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
            kwargs["prompt"] = PROMPT
        kwargs.update(adapter.validation_conditioning(text, size, size))
        with torch.no_grad():
            pipe(**adapter.pipeline_call_kwargs(height=size, width=size, num_frames=_frames(adapter)),
                 num_inference_steps=2, latents=adapter.pipeline_latents(latents), output_type="latent",
                 generator=torch.Generator().manual_seed(0), **kwargs)
            index = next(i for i in range(len(captured))
                         if adapter.objective.covers(adapter.objective.pipeline_timestep(pipe.scheduler, i)))
            t = adapter.objective.pipeline_timestep(pipe.scheduler, index)
            # later steps' inputs come back in the pipeline's layout (the same as training's for such families)
            start = latents if index == 0 else captured[index][1]
            ours = adapter.scheduler_input(adapter.predict(transformer, start, t, text), start, t)
        theirs = captured[index][0]
        assert ours.shape == theirs.shape
        assert (ours.float() - theirs.float()).abs().max().item() < 1e-5

    def test_previews_decode_what_the_pipeline_decodes(self, adapter, transformer, text):
        """The latents the pipeline hands its step callback, through ``preview_latents``, are exactly what the
        pipeline's own VAE decodes at the end (a video family's: its first latent frame, the poster frame, decoded
        by the family's VAE), and the preview decoder turns them into an image of the validation size (or the
        family says it has none)."""
        if adapter.preview_decoder_source() is None and not adapter.is_video:
            with pytest.raises(ValueError, match="validation_preview"):
                adapter.load_preview_decoder()
            return
        decoder = adapter.load_preview_decoder()
        pipe = adapter.build_validation_pipeline(transformer)
        pipe.set_progress_bar_config(disable=True)
        height, width = _size(adapter), 2 * _size(adapter)  # not square: catches swapped sides
        steps, decoded = [], []
        kwargs = adapter.validation_pipeline_kwargs(text, None, guidance=1.0, guidance_real=1.0)
        kwargs.update(adapter.preview_callback_kwargs(lambda index, latents: steps.append((index, latents))))
        if adapter.is_video:
            kwargs.update(adapter.validation_conditioning(text, height, width))
        vae_decode = pipe.vae.decode
        pipe.vae.decode = lambda z, *a, **k: decoded.append(z) or vae_decode(z, *a, **k)
        with torch.no_grad():
            out = pipe(**adapter.pipeline_call_kwargs(height=height, width=width, num_frames=_frames(adapter)),
                       num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(0), **kwargs)
            preview = adapter.preview_latents(steps[-1][1], height, width)
            pixels = decoder.decode(preview.to(decoder.dtype)).sample
        expected = decoded[-1][:, :, :1] if adapter.is_video else decoded[-1]
        assert [index for index, _ in steps] == [0, 1]
        assert torch.allclose(preview.float(), expected.float(), atol=1e-6)
        # the size the pipeline made (HiDream's rescales the request to its own area), in (H, W)
        made = (out.frames[0] if adapter.is_video else out.images[0]).shape[-3:-1]
        assert pixels.shape[:2] == (1, 3) and tuple(pixels.shape[-2:]) == tuple(made)
        assert made == (height, width) or adapter.family == "hidream"
        assert torch.isfinite(pixels).all()

    def test_every_lora_preset_targets_real_modules(self, family, adapter, transformer):
        from peft import LoraConfig, inject_adapter_in_model

        for preset in get_family(family).lora_targets:
            model = adapter.load_transformer()
            inject_adapter_in_model(LoraConfig(r=2, target_modules=adapter.lora_target_modules(model, preset)),
                                    model)
            assert any(n.endswith("lora_A") for n, _ in model.named_modules()), preset

    def test_a_lora_run_exports_what_the_pipeline_loads(self, family, flavour, adapter, text, latents, tmp_path):
        from safetensors.torch import load_file

        from simpletuner.training.lora import add_lora, load_lora_state
        from simpletuner.training.trainer import train

        dataset = tmp_path / "data"
        shutil.copytree(REPO / "datasets" / ("sample_video" if adapter.is_video else "sample"), dataset)
        sample = {"id": "sample", "instance_data_dir": str(dataset), "caption_strategy": "textfile",
                  "resolution": _size(adapter), "resolution_type": "pixel", "cache_dir_vae": str(tmp_path / "cache/vae")}
        if adapter.is_video:
            sample.update(dataset_type="video", video={"num_frames": _frames(adapter), "frame_rate": 8})
        backends = [sample, {"id": "text", "dataset_type": "text_embeds", "cache_dir": str(tmp_path / "cache/text")}]
        config = family_config(family, model_flavour=flavour, output_dir=str(tmp_path / "out"), learning_rate=1e-2,
                               lora_rank=4,
                               train_batch_size=2, checkpointing_steps=3,
                               data_backend_config=str(tmp_path / "backends.json"))
        result = train(config, load_data_backends(backends, config=config))
        assert result.global_step == 3 and all(torch.isfinite(torch.tensor(result.losses)))

        # the trained model, rebuilt from its checkpoint
        trained = adapter.load_transformer()
        add_lora(trained, adapter, config)
        load_lora_state(trained, load_file(tmp_path / "out/checkpoint-3/trainable.safetensors"), "checkpoint-3")
        # the LoRA file, loaded into a fresh pipeline the way its users load it
        pipe = adapter.pipeline_class.from_pretrained(adapter.ensure_tiny_checkpoint())
        adapter.load_lora(pipe, result.lora_path)
        loaded = getattr(pipe, adapter.denoiser_subfolder)
        base = adapter.load_transformer()
        t = adapter.objective.eval_timesteps()[4:5]
        with torch.no_grad():
            preds = [adapter.predict(m.eval(), latents, t, text) for m in (trained, loaded, base)]
        assert (preds[0] - preds[1]).abs().max().item() < 1e-5
        assert (preds[0] - preds[2]).abs().max().item() > 1e-4  # and the LoRA did change the model

    def test_init_lora_reads_what_save_lora_writes(self, family, adapter, tmp_path):
        """A LoRA the family exports is one ``init_lora`` can start a new run from."""
        from simpletuner.training.lora import add_lora, lora_state_dict

        model = adapter.load_transformer()
        add_lora(model, adapter, family_config(family, lora_rank=2))
        state = {k: torch.randn_like(v) for k, v in lora_state_dict(model).items()}
        path = adapter.save_lora(state, tmp_path)
        fresh = adapter.load_transformer()
        add_lora(fresh, adapter, family_config(family, lora_rank=2, init_lora=str(path)))
        loaded = lora_state_dict(fresh)
        assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)

    def test_cache_identity_follows_the_encoders(self, family, adapter, tmp_path):
        copy = tmp_path / "model"
        shutil.copytree(adapter.ensure_tiny_checkpoint(), copy)

        real_flavour = next(f for f in get_family(family).flavours if f not in tiny_flavours(get_family(family)))

        def identities():  # the copy as a family's real flavour would load it, from a local folder
            a = get_adapter_class(family)(family_config(family, model_flavour=real_flavour,
                                                        pretrained_model_name_or_path=str(copy)))
            return a.text_cache_identity(), a.vae_cache_identity()

        text0, vae0 = identities()
        assert identities() == (text0, vae0)
        for enc_dir, _, tok_dir, _ in adapter.text_encoder_specs:
            for folder in (enc_dir, tok_dir):
                cfg = next(f for f in (copy / folder / "config.json", copy / folder / "tokenizer_config.json")
                           if f.is_file())
                original = cfg.read_text()
                cfg.write_text(json.dumps({**json.loads(original), "_changed": True}))
                assert identities() == (identities()[0], vae0) and identities()[0] != text0, folder
                cfg.write_text(original)
        cfg = copy / "vae" / "config.json"
        cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "_changed": True}))
        assert identities() == (text0, identities()[1]) and identities()[1] != vae0

    def test_tread_layout_routes_and_restores(self, adapter, transformer, text, latents):
        from simpletuner.training.tread import apply_tread

        layout = adapter.tread_layout(transformer)
        if layout is None:  # the family says its token path does not allow routing
            with pytest.raises(ValueError, match="tread_config"):
                adapter.transformer_depth()
            return
        depth = adapter.transformer_depth()
        assert depth == len(layout.blocks) >= 3
        t = adapter.objective.eval_timesteps()[4:5]
        with torch.no_grad():
            plain = adapter.predict(transformer, latents, t, text)
        handle = apply_tread(transformer, [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -2}],
                             layout, generator=torch.Generator().manual_seed(0))
        seen = []  # image tokens reaching a routed block, after TREAD's own hook (registered first) ran

        def count(module, args, kwargs):
            image = kwargs[layout.image_arg] if layout.image_arg in kwargs else args[layout.image_pos]
            seen.append(image.shape[1])

        probe = layout.blocks[1].register_forward_pre_hook(count, with_kwargs=True)
        try:
            transformer.train()
            with torch.enable_grad():
                routed = adapter.predict(transformer, latents, t, text)
            full_tokens = adapter.image_seq_len(latents.shape)
            assert seen and seen[-1] < full_tokens  # the route's blocks saw a subset of the image tokens ...
            assert routed.shape == plain.shape  # ... and the full sequence came back out
            transformer.eval()
            with torch.no_grad():  # no routing outside training
                assert torch.equal(adapter.predict(transformer, latents, t, text), plain)
        finally:
            handle.remove()
            probe.remove()
            transformer.eval()
        with torch.no_grad():
            assert torch.equal(adapter.predict(transformer, latents, t, text), plain)

    def test_eval_loss_is_the_objectives_and_repeatable(self, family, adapter, transformer, text, latents):
        from simpletuner.evaluation.eval_loss import EvalItem, evaluation_loss

        assert adapter.objective.name in get_family(family).objectives
        item = EvalItem("sample-key", latents[0], {k: v[0] for k, v in text.items()})
        first = evaluation_loss(adapter, transformer, [item])
        assert first == evaluation_loss(adapter, transformer, [item])
        assert len(first) == len(adapter.objective.eval_timesteps()) + 1 and all(v > 0 for v in first.values())


EDIT_DATA = REPO / "datasets" / "edit"


def _first_step_output(pipe, adapter, latents, **kwargs):
    """What ``pipe`` hands its scheduler at its first step for these starting latents."""
    pipe.set_progress_bar_config(disable=True)
    captured = _capture_scheduler_input(pipe)
    size = _size(adapter)
    with torch.no_grad():
        pipe(height=size, width=size, num_inference_steps=2, latents=adapter.pipeline_latents(latents),
             output_type="latent", generator=torch.Generator().manual_seed(0), **kwargs)
    return captured[0], adapter.objective.pipeline_timestep(pipe.scheduler, 0)


class EditFlavourContract(_Fixtures):
    """The checks for an edit flavour; a test class provides a ``case`` fixture: (family, flavour)."""

    @pytest.fixture(scope="class")
    def adapter(self, case, tiny_dir):
        family, flavour = case
        weights = get_adapter_class(family)(family_config(family)).ensure_tiny_checkpoint()
        # the tiny weights loaded as the edit flavour would load its real ones, from a local folder
        adapter = get_adapter_class(family)(family_config(family, model_flavour=flavour,
                                                          pretrained_model_name_or_path=str(weights)))
        assert adapter.references and adapter.run_pipeline_class is adapter.edit_pipeline_class
        adapter.load_vae()
        adapter.load_text_encoders()
        return adapter

    @pytest.fixture(scope="class")
    def references(self, adapter):
        """Two reference images at the test size: (PIL image, the conditioning of PROMPT with it as training builds
        it: the prompt's embedding, encoded with the image where the family's text encoder sees it, the reference
        latents and pixels), batch of one."""
        from PIL import Image

        from simpletuner.data.discovery import load_pixels_at

        size = _size(adapter)
        out = []
        for name in ("00_circle.png", "01_square.png"):
            path = EDIT_DATA / "reference" / name
            pixels = load_pixels_at(path, size, size)
            image = Image.open(path).convert("RGB").resize((size, size), Image.Resampling.LANCZOS)
            cond = TextEmbedding.collate(adapter.encode_text([PROMPT], [pixels]))
            cond.update(reference_latents=adapter.encode_references(pixels.unsqueeze(0)),
                        reference_pixels=pixels.unsqueeze(0))
            out.append((image, cond))
        return out

    @pytest.mark.parametrize("mode", ["embeddings", "prompt"])
    def test_prediction_matches_the_edit_pipeline(self, adapter, transformer, latents, references, mode):
        """With a reference, the adapter predicts what the edit pipeline computes at its first step, whether it is
        handed the encoded reference with cached embeddings or the image itself with the prompt."""
        image, cond = references[0]
        pipe = adapter.build_pipeline(transformer)
        assert isinstance(pipe, adapter.edit_pipeline_class)
        kwargs = adapter.validation_pipeline_kwargs(cond, None, guidance=1.0, guidance_real=1.0)
        if mode == "prompt":
            kwargs = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
            kwargs.update(prompt=PROMPT, **adapter.reference_pipeline_kwargs(image))
        theirs, t = _first_step_output(pipe, adapter, latents, **kwargs)
        with torch.no_grad():
            ours = adapter.pipeline_latents(adapter.predict(transformer, latents, t, cond))
        assert ours.shape == theirs.shape
        assert (ours.float() - theirs.float()).abs().max().item() < 1e-5

    def test_the_reference_changes_the_prediction(self, adapter, transformer, latents, references):
        t = adapter.objective.eval_timesteps()[4:5]
        with torch.no_grad():
            a, a_again, b = (adapter.predict(transformer, latents, t, cond)
                             for cond in (references[0][1], references[0][1], references[1][1]))
        assert torch.equal(a, a_again)
        assert (a - b).abs().max().item() > 1e-4

    def test_a_lora_trained_on_pairs_reproduces_in_the_edit_pipeline(self, case, adapter, latents, references,
                                                                    tmp_path):
        """A LoRA trained through the real trainer on (reference, edit) pairs: loaded into the edit pipeline as its
        users load it, its first-step output for a reference image equals the trained model's prediction with that
        reference, and the reference matters to it."""
        from safetensors.torch import load_file

        from simpletuner.training.lora import add_lora, load_lora_state
        from simpletuner.training.trainer import train

        family, flavour = case
        for kind in ("edited", "reference"):  # the two pairs of the references fixture
            (tmp_path / "edit" / kind).mkdir(parents=True)
            for file in sorted((EDIT_DATA / kind).glob("0[01]_*")):
                shutil.copy(file, tmp_path / "edit" / kind / file.name)
        backends = [{"id": "edited", "instance_data_dir": str(tmp_path / "edit/edited"), "caption_strategy": "textfile",
                     "resolution": _size(adapter), "resolution_type": "pixel", "conditioning_data": "reference",
                     "cache_dir_vae": str(tmp_path / "cache/vae")},
                    {"id": "reference", "dataset_type": "conditioning", "instance_data_dir": str(tmp_path / "edit/reference"),
                     "cache_dir_vae": str(tmp_path / "cache/vae-ref")},
                    {"id": "text", "dataset_type": "text_embeds", "cache_dir": str(tmp_path / "cache/text")}]
        # caption dropout: the empty caption is trained beside each reference too
        config = family_config(family, model_flavour=flavour, pretrained_model_name_or_path=adapter.model_path(),
                               output_dir=str(tmp_path / "out"), learning_rate=1e-2, lora_rank=4, train_batch_size=2,
                               checkpointing_steps=3, data_backend_config=str(tmp_path / "backends.json"),
                               caption_dropout_probability=0.5)
        result = train(config, load_data_backends(backends, config=config))
        assert result.global_step == 3 and all(torch.isfinite(torch.tensor(result.losses)))

        trained = adapter.load_transformer()
        add_lora(trained, adapter, config)
        load_lora_state(trained, load_file(tmp_path / "out/checkpoint-3/trainable.safetensors"), "checkpoint-3")
        pipe = adapter.load_pipeline()
        assert isinstance(pipe, adapter.edit_pipeline_class)
        adapter.load_lora(pipe, result.lora_path)
        outputs = []
        for image, cond in references:
            plain = {k: v for k, v in adapter.validation_pipeline_kwargs(cond, None, guidance=1.0,
                                                                         guidance_real=1.0).items()
                     if not isinstance(v, torch.Tensor)}
            theirs, t = _first_step_output(pipe, adapter, latents, prompt=PROMPT,
                                           **{**plain, **adapter.reference_pipeline_kwargs(image)})
            with torch.no_grad():
                ours = adapter.pipeline_latents(adapter.predict(trained.eval(), latents, t, cond))
            assert (ours - theirs).abs().max().item() < 1e-5
            outputs.append(ours)
        assert (outputs[0] - outputs[1]).abs().max().item() > 1e-4

    def test_tread_routes_target_and_reference_tokens(self, adapter, transformer, latents, references):
        from simpletuner.training.tread import apply_tread

        layout = adapter.tread_layout(transformer)
        if layout is None:
            return  # the family's contract already shows it refuses TREAD
        cond = references[0][1]
        t = adapter.objective.eval_timesteps()[4:5]
        with torch.no_grad():
            plain = adapter.predict(transformer, latents, t, cond)
        handle = apply_tread(transformer, [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -2}],
                             layout, generator=torch.Generator().manual_seed(0))
        seen = []

        def count(module, args, kwargs):
            image = kwargs[layout.image_arg] if layout.image_arg in kwargs else args[layout.image_pos]
            seen.append(image.shape[1])

        probe = layout.blocks[1].register_forward_pre_hook(count, with_kwargs=True)
        try:
            transformer.train()
            with torch.enable_grad():
                routed = adapter.predict(transformer, latents, t, cond)
            with_reference = (adapter.image_seq_len(latents.shape)
                              + adapter.image_seq_len(cond["reference_latents"].shape))
            assert seen and seen[-1] < with_reference and routed.shape == plain.shape
        finally:
            handle.remove()
            probe.remove()
            transformer.eval()

    def test_eval_loss_with_a_reference_repeats(self, adapter, transformer, latents, references):
        from simpletuner.evaluation.eval_loss import EvalItem, evaluation_loss

        cond = {k: v[0] for k, v in references[0][1].items()}
        item = EvalItem("sample-key", latents[0], cond)
        first = evaluation_loss(adapter, transformer, [item])
        assert first == evaluation_loss(adapter, transformer, [item]) and all(v > 0 for v in first.values())
