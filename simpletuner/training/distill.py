"""The distillation recipe. Read top to bottom: set up, prompts and caches, the networks, the loop, save.

A config with a ``distillation`` block runs this recipe instead of fine-tuning (``trainer.py``): the config's model
is the teacher (frozen); the student starts from the teacher's weights (or ``student_init``) and learns to sample
in the few steps of ``denoising_step_list``; for dmd / sid / gan a critic (the "fake score", also from the teacher)
learns the student's samples. Prompts are all the data it needs.

One step (``global_step``), with every random draw from the run's generator:
- ``ode_regression``: draw stored teacher trajectories (``distill_pairs``) and one of the student's steps for each
  (with the ``ode`` sampler the point of that step on the line from the trajectory's noise to its end, else the
  trajectory's point there); the student predicts x0 there; MSE to the trajectory's end; backward, clip, step (and
  EMA).
- ``dmd`` / ``sid`` / ``gan`` (``+gan``): every ``generator_update_ratio``-th step the student rolls out from noise
  (autograd only at one random step, Self-Forcing's backward simulation); the teacher (with CFG) and the critic
  predict x0 on a noised copy of its sample: DMD moves the sample along their difference, SiD takes its own loss,
  the GAN term asks the critic's classifier to call it real; backward, clip, step, EMA. Then, every step, the critic
  learns a fresh rollout (no autograd through the student) with the denoising loss, and its classifier tells the
  teacher's stored samples (real) from the student's (fake), with R1/R2.
- report progress and losses, validate (student against teacher samples, images), checkpoint every network,
  optimizer, schedule, the EMA and the RNG.
At the end the student (and its EMA) is exported as the family's diffusers model or LoRA, with a few-step scheduler.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from diffusers.optimization import get_scheduler
from tqdm.auto import tqdm

from simpletuner.config import paths
from simpletuner.config.files import write_json
from simpletuner.config.distill import warped_step_list
from simpletuner.config.errors import ConfigError
from simpletuner.data.cache import TensorCache, fill_text_cache, negative_identity, text_key
from simpletuner.models.base import TextEmbedding
from simpletuner.models.registry import create_adapter
from simpletuner.training import checkpoint as ckpt
from simpletuner.training.distill_losses import (BlockFeatures, GanHead, dmd_gradient, dmd_loss,
                                                 finite_difference_penalty, gan_critic_loss, gan_generator_loss,
                                                 ode_regression_loss, sid_loss)
from simpletuner.training.distill_pairs import PairSpec, fill_pairs, pair_identity, pair_specs
from simpletuner.training.distill_sampling import (CausalDenoiser, Denoiser, Rollout, critic_timesteps, renoise,
                                                   timesteps, unshifted_timestep)
from simpletuner.training.distill_validation import StudentValidation
from simpletuner.training.guards import NanLossGuard, require_finite
from simpletuner.training.optimizers import build_optimizer, param_groups
from simpletuner.training.paths import check_run_paths
from simpletuner.training.state import RunState
from simpletuner.training.trainer import (TrainingInterrupted, TrainResult, _last_logged_loss, _load_trainable,
                                          _StopFlag, _trainable_state, adapter_family, build_transformer,
                                          export_weights, preflight, weight_dtype_for)
from simpletuner.training.trainer import run as run_recipe
from simpletuner.training.webhooks import WebhookReporter

log = logging.getLogger("simpletuner.distill")


class DistillationError(ValueError):
    """A distillation setting the chosen model cannot do; names the field."""


# ---------------------------------------------------------------------------------------------------------------
# setup: what to distill, at what size, from which prompts
# ---------------------------------------------------------------------------------------------------------------
def check_model(config, adapter) -> None:
    """What the recipe needs from the teacher: a text-to-image or text-to-video flavour of one whole model."""
    flavour = config.model_flavour
    if adapter.references:
        raise DistillationError(f"model_flavour: {flavour!r} edits reference images; distillation learns from "
                                "prompts alone (pick a text-to-image flavour)")
    if getattr(adapter, "is_i2v", False):
        raise DistillationError(f"model_flavour: {flavour!r} animates a first frame; distillation learns from prompts "
                                "alone (pick a text-to-video flavour)")
    if getattr(adapter, "expert", None) is not None:
        raise DistillationError(f"model_flavour: {flavour!r} is one expert of a two-expert model; distill a "
                                "single-transformer flavour")


def sample_size(config, adapter) -> tuple[int, int, int | None]:
    """(width, height, frames) of the student's samples: a square of ``resolution`` pixels (megapixels for 'area'),
    rounded down to the family's multiple; video families ``distillation.num_frames`` frames (a length the VAE
    takes)."""
    multiple = adapter.resolution_multiple
    side = (config.resolution * 1_000_000) ** 0.5 if config.resolution_type == "area" else config.resolution
    side = int(side) // multiple * multiple
    if side < multiple:
        raise DistillationError(f"resolution: {config.resolution} is smaller than model_family "
                                f"{config.model_family!r}'s multiple ({multiple} pixels)")
    frames = None
    if adapter.is_video:
        frames = config.distillation.num_frames or adapter.validation_num_frames()
        tc = adapter.temporal_compression
        if (frames - 1) % tc:
            raise DistillationError(f"distillation.num_frames: {frames} is not {tc}k + 1 frames (the VAE of "
                                    f"model_family {config.model_family!r} compresses time {tc}x)")
    elif config.distillation.num_frames is not None:
        raise DistillationError(f"distillation.num_frames: model_family {config.model_family!r} makes images")
    return side, side, frames


def latent_shape(adapter, width: int, height: int, frames: int | None) -> tuple[int, ...]:
    """One sample's latent shape, as the family's VAE encodes a (black) picture or clip of this size."""
    pixels = torch.zeros(1, 3, *((frames,) if frames else ()), height, width)
    return tuple(adapter.encode_images(pixels).shape[1:])


def load_prompts(config) -> list[str]:
    """``distillation.prompts`` then the lines of ``distillation.prompt_file`` (blank lines skipped)."""
    d = config.distillation
    prompts = list(d.prompts or [])
    if d.prompt_file:
        paths.guard_open("distillation.prompt_file", d.prompt_file, "file")
        file = Path(d.prompt_file).expanduser()
        try:
            lines = file.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise DistillationError(f"distillation.prompt_file: {d.prompt_file!r} cannot be read ({exc.strerror})")
        except UnicodeDecodeError:
            raise DistillationError(f"distillation.prompt_file: {d.prompt_file!r} is not UTF-8 text")
        prompts += [line.strip() for line in lines if line.strip()]
    if not prompts:
        raise DistillationError("distillation.prompts: no prompts (give prompts or a prompt_file with one per line)")
    return prompts


@dataclass
class Texts:
    """The prompts' cached text embeddings, batched on the device."""

    cache: TensorCache
    identity: str
    negative_prompt: str
    device: torch.device

    def batch(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        items = [TextEmbedding(self.cache.load(text_key(p, self.identity))) for p in prompts]
        return {k: v.to(self.device) for k, v in TextEmbedding.collate(items).items()}

    def negative(self, size: int) -> dict[str, torch.Tensor]:
        one = self.cache.load(text_key(self.negative_prompt, negative_identity(self.identity)))
        return {k: v.unsqueeze(0).expand(size, *v.shape).to(self.device) for k, v in one.items()}

    def one(self, prompt: str | None) -> dict[str, torch.Tensor]:
        return self.negative(1) if prompt is None else self.batch([prompt])

    def many(self, prompts: list[str] | None) -> dict[str, torch.Tensor]:
        return self.negative(1) if prompts is None else self.batch(prompts)


def prepare_texts(config, backends, adapter, accelerator, prompts: list[str], extra: list[str]) -> Texts:
    """Encode every prompt (and the negative prompt when guidance uses it) not yet cached, main process first."""
    d = config.distillation
    cache = TensorCache(backends.text_embeds.cache_dir)
    batch = backends.text_embeds.write_batch_size
    with accelerator.main_process_first():
        show = accelerator.is_local_main_process
        fill_text_cache([*prompts, *extra], adapter, cache, batch, show_progress=show)
        fill_text_cache([d.negative_prompt], adapter, cache, batch, show_progress=show, negative=True)
    return Texts(cache, adapter.text_cache_identity(), d.negative_prompt, accelerator.device)


@dataclass
class Pairs:
    """The run's stored teacher trajectories: ``trajectory`` (S + 1, *latent_shape) per pair."""

    specs: list[PairSpec]
    cache: TensorCache

    def load(self, spec: PairSpec) -> torch.Tensor:
        return self.cache.load(spec.key)["trajectory"]


def prepare_pairs(config, adapter, accelerator, teacher, texts: Texts, prompts: list[str], shape,
                  steps) -> tuple[Pairs, int]:
    """Make the missing teacher trajectories (each rank its share), then wait for every rank; returns the pairs and
    how many this process made."""
    d = config.distillation
    cache = TensorCache(d.pairs_cache_dir)
    paths.guard_open("distillation.pairs_cache_dir", cache.folder)
    specs = pair_specs(prompts, d.ode_pairs_per_prompt, pair_identity(config, adapter, shape, steps))
    made = fill_pairs(config, adapter, teacher, specs, cache, texts.many, latent_shape=shape, student_steps=steps,
                      rank=accelerator.process_index, world_size=accelerator.num_processes,
                      autocast=accelerator.autocast, show_progress=accelerator.is_local_main_process)
    accelerator.wait_for_everyone()
    if made:
        log.info("made %d teacher trajectories (%d in %s)", made, len(specs), cache.folder)
    return Pairs(specs, cache), made


# ---------------------------------------------------------------------------------------------------------------
# the networks
# ---------------------------------------------------------------------------------------------------------------
def load_teacher(adapter, device) -> torch.nn.Module:
    teacher = adapter.load_transformer()
    teacher.requires_grad_(False).eval()
    return teacher.to(device)


def student_adapter(config, adapter, device, weight_dtype):
    """The adapter that loads the student: the teacher's, or one reading ``student_init`` (a transformer folder,
    or a folder holding ``transformer/``)."""
    init = config.distillation.student_init
    if not init:
        return adapter
    paths.guard_open("distillation.student_init", init, "model")
    folder = Path(init).expanduser()
    subfolder = "none" if (folder / "config.json").is_file() else None
    changed = config.model_copy(update={"pretrained_transformer_model_name_or_path": init,
                                        "pretrained_transformer_subfolder": subfolder})
    return create_adapter(changed, device=device, weight_dtype=weight_dtype)


@dataclass
class Critic:
    """The fake score, and (for gan) its classification branch on one block's tokens."""

    model: torch.nn.Module
    head: GanHead | None = None
    features: BlockFeatures | None = None

    def trainable(self, config) -> dict[str, torch.Tensor]:
        state = dict(_trainable_state(_unwrap(self.model), config))
        if self.head is not None:
            state.update({f"gan_head.{k}": v for k, v in self.head.state_dict().items()})
        return state

    def load(self, config, weights: dict[str, torch.Tensor], source: str) -> None:
        head = {k[len("gan_head."):]: v for k, v in weights.items() if k.startswith("gan_head.")}
        if self.head is not None:
            self.head.load_state_dict(head)
        elif head:
            raise ValueError(f"{source}: holds a GAN head and this run trains none")
        _load_trainable(_unwrap(self.model), {k: v for k, v in weights.items() if not k.startswith("gan_head.")},
                        config, source)


def _unwrap(model):
    return getattr(model, "module", model)


def causal_student(config, adapter, model, shape, autocast) -> CausalDenoiser:
    """Self-Forcing's student: the Wan run block-causally (``simpletuner.models.causal_wan``)."""
    from simpletuner.models.causal_wan import CausalLayout

    d = config.distillation
    layout = CausalLayout(d.num_frame_per_block, d.local_attn_size, d.independent_first_frame)
    try:
        layout.blocks(shape[1])
    except ValueError as exc:
        raise DistillationError(f"distillation.num_frame_per_block: {exc} (distillation.num_frames sets the video's "
                                "length: 4k + 1 frames make k + 1 latent frames)") from None
    if getattr(adapter, "is_i2v", False) or _unwrap(model).config.image_dim is not None:
        raise DistillationError("distillation.causal: the causal student is a text-to-video Wan")
    return CausalDenoiser(adapter, model, layout, context_noise=float(d.context_noise), autocast=autocast)


def attach_gan_head(config, adapter, critic_model, denoiser: Denoiser, probe) -> tuple[GanHead, BlockFeatures]:
    """The classifier on the critic's middle block (its feature width read by one probe forward)."""
    layout = adapter.tread_layout(_unwrap(critic_model))
    if layout is None or not layout.blocks:
        raise DistillationError(f"distillation.objective: {config.distillation.objective!r} puts a classifier on "
                                f"the critic's blocks, and model_family {config.model_family!r} has no block layout")
    index = len(layout.blocks) // 2
    features = BlockFeatures(layout.blocks[index], layout.block_args(index).image_output)
    features.active = True
    with torch.no_grad():
        probe(denoiser)
    features.active = False
    head = GanHead(features.take().shape[-1]).to(adapter.device)
    return head, features


# ---------------------------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class StepLosses:
    generator: float | None = None
    critic: float | None = None
    extras: dict[str, float] = field(default_factory=dict)


def single_process_error(num_processes: int) -> tuple[str, str]:
    """Why a distillation run is refused on several processes, as a (field, message) config error."""
    return ("num_processes", f"{num_processes}: a distillation run trains on one process (multi-process "
            "distillation is not supported yet: the student's and critic's updates, the GAN head and the causal "
            "student are not synchronised across ranks); `simpletuner distill-pairs --num_processes N` makes the "
            "teacher trajectories on several")


def distill(config, backends, *, reporter: WebhookReporter | None = None) -> TrainResult:
    """Distill as ``config.distillation`` says; returns where the student is. Raises TrainingInterrupted on
    SIGTERM."""
    d = config.distillation
    check_run_paths(config, backends)
    reporter = reporter or WebhookReporter.from_env(getattr(config, "webhook_config", None))
    output_dir = Path(config.output_dir)
    accelerator = Accelerator(mixed_precision=config.mixed_precision if config.mixed_precision != "no" else "no")
    if accelerator.num_processes > 1:
        raise ConfigError([single_process_error(accelerator.num_processes)])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.seed is not None:
        set_seed(config.seed)
    state = RunState.start(config.seed, accelerator.process_index)
    generator = state.generator
    device = accelerator.device
    if accelerator.is_main_process:
        reporter.status("running")
        ckpt.remove_incomplete(output_dir)

    # ---- the teacher's model, sizes, prompts and caches ----
    weight_dtype = weight_dtype_for(config, device)
    adapter = create_adapter(config, device=device, weight_dtype=weight_dtype, references=False)
    check_model(config, adapter)
    preflight(config, adapter, device)
    objective = adapter.objective
    steps = [t for t in warped_step_list(d) if t > 0]
    width, height, frames = sample_size(config, adapter)
    prompts = load_prompts(config)
    texts = prepare_texts(config, backends, adapter, accelerator, prompts,
                          [p.prompt for p in StudentValidation.prompts_of(config)])
    shape = latent_shape(adapter, width, height, frames)
    validation = StudentValidation(config, adapter, texts.one, shape, steps, reporter=reporter,
                                   is_main=accelerator.is_main_process)
    adapter.unload_encoders()  # the text cache is warm; validation reloads the VAE when it decodes
    log.info("distilling %s (%s) into a %d-step student by %s: %d prompt(s), samples %dx%d%s (latents %s)",
             config.model_family, config.model_flavour, len(steps), d.objective, len(prompts), width, height,
             f"x{frames} frames" if frames else "", tuple(shape))

    # ---- networks: teacher (frozen), student, critic ----
    teacher = load_teacher(adapter, device)
    real = Denoiser(adapter, teacher, accelerator.autocast)
    pairs = prepare_pairs(config, adapter, accelerator, teacher, texts, prompts, shape, steps)[0] \
        if d.uses_pairs else None
    validation.sample_teacher(real)
    student = build_transformer(config, student_adapter(config, adapter, device, weight_dtype), accelerator,
                                generator)
    critic = None
    if d.has_critic:
        critic = Critic(build_transformer(config, adapter, accelerator, generator))
        if "gan" in d.objectives:
            def probe(denoiser):
                denoiser(torch.zeros(1, *shape, device=device), torch.full((1,), 500.0, dtype=torch.float64),
                         texts.one(prompts[0]))
            critic.head, critic.features = attach_gan_head(config, adapter, critic.model,
                                                           Denoiser(adapter, critic.model), probe)

    # ---- optimizers and schedules: one per trained network ----
    max_steps = config.max_train_steps
    generator_steps = max_steps if not d.has_critic else math.ceil(max_steps / d.generator_update_ratio)
    lr_scale = adapter_family(config).lr_scale
    student_lr = d.generator_learning_rate or config.learning_rate
    opt_g = build_optimizer(config.model_copy(update={"learning_rate": student_lr}),
                            param_groups(student, config.model_copy(update={"learning_rate": student_lr}), lr_scale))
    sched_g = _schedule(config, opt_g, generator_steps, accelerator.num_processes)
    student, opt_g, sched_g = accelerator.prepare(student, opt_g, sched_g)
    student_params = [p for p in student.parameters() if p.requires_grad]
    student_x0 = causal_student(config, adapter, student, shape, accelerator.autocast) if d.causal \
        else Denoiser(adapter, student, accelerator.autocast)
    fake = opt_c = sched_c = None
    critic_params: list = []
    if critic is not None:
        critic_lr = d.critic_learning_rate or config.learning_rate
        critic_config = config.model_copy(update={"learning_rate": critic_lr})
        groups = param_groups(critic.model, critic_config, lr_scale)
        if critic.head is not None:
            groups.append({"params": list(critic.head.parameters()), "lr": critic_lr})
        opt_c = build_optimizer(critic_config, groups)
        sched_c = _schedule(config, opt_c, max_steps, accelerator.num_processes)
        critic.model, opt_c, sched_c = accelerator.prepare(critic.model, opt_c, sched_c)
        critic_params = [p for group in opt_c.param_groups for p in group["params"]]
        fake = Denoiser(adapter, critic.model, accelerator.autocast)
    ema = None
    if config.use_ema:
        from simpletuner.training.ema import TrainedWeightsEMA

        ema = TrainedWeightsEMA(student_params, decay=config.ema_decay, update_interval=config.ema_update_interval,
                                device="cpu" if config.ema_device == "cpu" else device)

    # ---- resume: every network, optimizer, schedule, the EMA and the RNG ----
    extra_trainable, extra_states = {}, {}
    if critic is not None:
        extra_trainable["critic"] = lambda weights, source: critic.load(config, weights, source)
        extra_states = {"critic_optimizer": opt_c, "critic_scheduler": sched_c}
    resumed = ckpt.resume(output_dir, config.resume_from_checkpoint, state, optimizer=opt_g, lr_scheduler=sched_g,
                          rank=accelerator.process_index, world_size=accelerator.num_processes, ema=ema,
                          extra_trainable=extra_trainable, extra_states=extra_states)
    if resumed is not None:
        resume_path, trainable = resumed
        _load_trainable(_unwrap(student), trainable, config, str(resume_path))
        if ema is not None and not (resume_path / "ema.pt").is_file():
            log.warning("%s has no EMA: the EMA starts from the resumed weights", resume_path)
            ema.reset_to_weights()
        log.info("resumed from %s at step %d", resume_path, state.global_step)

    # ---- loop ----
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        from simpletuner.evaluation.trackers import Trackers

        validation.trackers = Trackers(config)
    loss_log = output_dir / "training_log.jsonl"
    losses = DistillSteps(config, adapter, objective, real, fake, student_x0, critic, texts, pairs, prompts, shape,
                          steps, generator, device)
    save = _checkpointer(config, accelerator, student, opt_g, sched_g, critic, opt_c, sched_c, reporter, ema)
    nan_guard = NanLossGuard(config.max_nan_loss_steps)
    bar = tqdm(total=max_steps, initial=state.global_step, desc="Distilling",
               disable=not accelerator.is_local_main_process)
    started, start_step = time.time(), state.global_step
    if config.validation_on_startup:
        validation.run(state.global_step, student_x0)
    try:
        with _StopFlag() as stop:
            while state.global_step < max_steps:
                if stop.stop:
                    raise TrainingInterrupted(f"stopped by signal at step {state.global_step}")
                step = state.global_step
                out = StepLosses()
                # the student: every step for ode_regression, every generator_update_ratio-th step otherwise
                if not d.has_critic or step % d.generator_update_ratio == 0:
                    loss, out.extras = losses.student_loss()
                    out.generator = _optimise(accelerator, loss, opt_g, sched_g, student_params, config)
                    if ema is not None:
                        ema.update(state.global_step + 1)
                if critic is not None:
                    loss, extras = losses.critic_loss()
                    out.extras.update(extras)
                    out.critic = _optimise(accelerator, loss, opt_c, sched_c, critic_params, config)
                # the run's loss: the student's regression loss, or the critic's denoising loss (logged every step)
                step_loss = out.generator if critic is None else out.critic
                state.record_step(step_loss)
                step = state.global_step
                lr = sched_g.get_last_lr()[0]
                elapsed = time.time() - started
                it_s = (step - start_step) / elapsed if elapsed > 0 else 0.0
                bar.update(1)
                bar.set_postfix(loss=f"{step_loss:.4f}")
                if accelerator.is_main_process:
                    record = {"step": step, "loss": step_loss, "lr": lr, "generator_loss": out.generator,
                              "critic_loss": out.critic, **out.extras}
                    if sched_c is not None:
                        record["critic_lr"] = sched_c.get_last_lr()[0]
                    with loss_log.open("a") as fh:
                        fh.write(json.dumps(record) + "\n")
                    reporter.progress(step, max_steps, step_loss, lr, it_s,
                                      (max_steps - step) / it_s if it_s > 0 else None)
                    if validation.trackers is not None:
                        validation.trackers.log({f"train/{k}": v for k, v in record.items()
                                                 if k != "step" and v is not None}, step)
                nan_guard.check(step, step_loss)
                if validation.due(step):
                    validation.run(step, student_x0)
                accelerator.wait_for_everyone()
                if config.checkpointing_steps and step % config.checkpointing_steps == 0:
                    save(state)
        bar.close()
        step = state.global_step
        if config.checkpointing_steps and step > 0 and not (output_dir / f"checkpoint-{step}").exists():
            save(state)
        if validation.enabled and validation.last_step != step:
            validation.run(step, student_x0)
    finally:
        if validation.trackers is not None:
            validation.trackers.close()
        if critic is not None and critic.features is not None:
            critic.features.remove()

    # ---- save: the student as its family's model (or LoRA), with a few-step scheduler ----
    accelerator.wait_for_everyone()
    final_loss = state.losses[-1] if state.losses else _last_logged_loss(loss_log)
    result = TrainResult(str(output_dir), step, final_loss, losses=state.losses,
                         vae_forwards=adapter.vae_forwards, text_encoder_forwards=adapter.text_encoder_forwards)
    if accelerator.is_main_process:
        model = accelerator.unwrap_model(student)
        require_finite(_trainable_state(model, config), step, "the final student")
        path = export_student(config, adapter, model, output_dir, steps)
        if ema is not None:
            with ema.swapped_in():
                result.ema_path = str(export_student(config, adapter, model, output_dir / "ema", steps))
        if config.model_type == "lora":
            result.lora_path = str(path)
        else:
            result.model_path = str(path)
        write_json(output_dir / "run_summary.json", {k: v for k, v in result.__dict__.items() if k != "losses"})
    accelerator.end_training()
    return result


def _schedule(config, optimizer, steps: int, world_size: int):
    return get_scheduler(config.lr_scheduler, optimizer=optimizer,
                         num_warmup_steps=config.lr_warmup_steps * world_size,
                         num_training_steps=max(1, steps) * world_size)


def _optimise(accelerator, loss: torch.Tensor, optimizer, scheduler, params, config) -> float:
    """Backward, clip, step one network's optimizer; a NaN/inf loss never reaches the weights. Returns the loss
    (averaged over processes)."""
    optimizer.zero_grad(set_to_none=True)
    accelerator.backward(loss)
    value = accelerator.gather(loss.detach().float()).mean().item()
    if not math.isfinite(value):
        optimizer.zero_grad(set_to_none=True)
    elif config.max_grad_norm:
        accelerator.clip_grad_norm_(params, config.max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return value


def sampler_points(objective, trajectories: torch.Tensor, first_step: float, t: torch.Tensor) -> torch.Tensor:
    """Where the deterministic (``ode``) student sampler is at ``t`` (B,) when its x0 is each trajectory's end X:
    X re-noised to ``t`` with the noise z that takes X to the trajectory's first point (x_t at ``first_step``; at
    1000 on a flow-matching schedule z is that point). At ``first_step`` this is the trajectory's first point."""
    start, end = trajectories[:, 0], trajectories[:, -1]
    first = timesteps(first_step, start.shape[0], start.device)
    z = objective.noise_from_x0(end, start, objective.from_train_timestep(first).to(start.device))
    return renoise(objective, end, z, t).to(start.dtype)


class DistillSteps:
    """The losses of one step, for the student and for the critic (see the module docstring). Every random draw
    (prompts, pairs, noise, timesteps, the rollout's exit step and re-noising) comes from ``generator``."""

    def __init__(self, config, adapter, objective, real: Denoiser, fake: Denoiser, student: Denoiser, critic,
                 texts: Texts, pairs: Pairs | None, prompts: list[str], shape, steps, generator, device):
        self.config, self.d = config, config.distillation
        self.adapter, self.objective = adapter, objective
        self.real, self.fake, self.student = real, fake, student
        self.critic = critic
        self.texts, self.pairs, self.prompts = texts, pairs, prompts
        self.shape, self.steps = tuple(shape), list(steps)
        self.generator, self.device = generator, device
        self.batch = config.train_batch_size

    # ---- what a step draws ----
    def draw_pairs(self) -> tuple[list[str], torch.Tensor]:
        """(prompts, trajectories (B, S + 1, ...)) of ``batch`` stored teacher trajectories."""
        picks = torch.randint(len(self.pairs.specs), (self.batch,), generator=self.generator).tolist()
        specs = [self.pairs.specs[i] for i in picks]
        return [s.prompt for s in specs], torch.stack([self.pairs.load(s) for s in specs]).to(self.device)

    def draw_prompts(self) -> list[str]:
        picks = torch.randint(len(self.prompts), (self.batch,), generator=self.generator).tolist()
        return [self.prompts[i] for i in picks]

    def noise(self, shape=None) -> torch.Tensor:
        return torch.randn((self.batch, *self.shape) if shape is None else shape,
                           generator=self.generator).to(self.device)

    def exit_index(self) -> int | list[int]:
        """Where the rollout stops (autograd there only): a random step; for a causal student the same one for every
        block (``same_step_across_blocks``), one per block, or the last (``last_step_only``)."""
        count = len(self.steps)
        if not self.d.causal:
            return int(torch.randint(count, (1,), generator=self.generator))
        blocks = len(self.student.layout.blocks(self.shape[1]))
        if self.d.last_step_only:
            return [count - 1] * blocks
        if self.d.same_step_across_blocks:
            return [int(torch.randint(count, (1,), generator=self.generator))] * blocks
        return torch.randint(count, (blocks,), generator=self.generator).tolist()

    def student_sample(self, text) -> Rollout:
        """A rollout from fresh noise that stops at a random step (its x0 keeps autograd if the caller does)."""
        exit_index = self.exit_index()
        return self.student.rollout(self.noise(), self.steps, text, sampler=self.d.student_sampler,
                                    generator=self.generator, exit_index=exit_index)

    def score_timesteps(self, sample) -> torch.Tensor:
        """Timesteps for the score networks, bounded by the rollout's step with ``ts_schedule`` (``_max``)."""
        shift = self.d.timestep_shift
        low = unshifted_timestep(sample.t_to, shift) if self.d.ts_schedule else 0.0
        high = unshifted_timestep(sample.t_from, shift) if self.d.ts_schedule_max else 1000.0
        return critic_timesteps(self.batch, self.generator, shift, low, high).to(self.device)

    def uncond(self) -> dict | None:
        needed = self.d.real_guidance_scale != 1.0 or self.d.fake_guidance_scale != 1.0
        return self.texts.negative(self.batch) if needed else None

    # ---- the student's loss ----
    def student_loss(self) -> tuple[torch.Tensor, dict[str, float]]:
        if self.d.objective == "ode_regression":
            return self.ode_regression()
        uses_real = self.pairs is not None
        prompts, trajectories = self.draw_pairs() if uses_real else (self.draw_prompts(), None)
        text = self.texts.batch(prompts)
        sample = self.student_sample(text)
        t = self.score_timesteps(sample)
        noise = self.noise()
        extras: dict[str, float] = {}
        loss = torch.zeros((), device=self.device, dtype=torch.float64)
        if "dmd" in self.d.objectives:
            with torch.no_grad():
                noisy = renoise(self.objective, sample.sample.detach(), noise, t)
                uncond = self.uncond()
                real_x0 = self.real.guided(noisy, t, text, uncond, self.d.real_guidance_scale)
                fake_x0 = self.fake.guided(noisy, t, text, uncond, self.d.fake_guidance_scale)
                grad = dmd_gradient(sample.sample, real_x0, fake_x0)
            loss = loss + dmd_loss(sample.sample, grad)
            extras["dmd_gradient_norm"] = grad.abs().mean().item()
        if "sid" in self.d.objectives:
            noisy = renoise(self.objective, sample.sample, noise, t)  # autograd through the scores' input
            uncond = self.uncond()
            real_x0 = self.real.guided(noisy, t, text, uncond, self.d.real_guidance_scale)
            fake_x0 = self.fake.guided(noisy, t, text, uncond, self.d.fake_guidance_scale)
            loss = loss + sid_loss(sample.sample, real_x0, fake_x0, self.d.sid_alpha)
        if "gan" in self.d.objectives:
            fake_logits, real_logits = self.logits(sample.sample, trajectories[:, -1], text, t, noise)
            gan = gan_generator_loss(fake_logits, real_logits.detach(), self.d.relativistic_discriminator)
            extras["gan_generator_loss"] = gan.item()
            loss = loss + self.d.gan_generator_weight * gan
        return loss, extras

    def ode_regression(self) -> tuple[torch.Tensor, dict[str, float]]:
        """A point of each drawn trajectory at one of the student's steps -> the student's x0 vs its end.

        Which point depends on how the student samples. With the ``ode`` sampler the student's own steps go from the
        noise straight towards its x0: a student that predicts the teacher's sample X from the noise z lands on
        ``renoise(X, z, t)`` at every later step, not on the teacher's curved trajectory. So it learns there (the
        straight line between the trajectory's noise and its end, as rectified flow's reflow does); trained on the
        curved points instead, its later steps see inputs it never learned and pull it off X. With ``consistency``
        (fresh noise each step) and for the causal student, the points of the teacher's trajectory."""
        prompts, trajectories = self.draw_pairs()
        steps = torch.tensor(self.steps, dtype=torch.float64)
        if not self.d.causal:
            index = torch.randint(len(self.steps), (self.batch,), generator=self.generator)
            t = steps[index].to(self.device)
            if self.d.student_sampler == "ode":
                x_t = sampler_points(self.objective, trajectories, self.steps[0], t)
            else:
                x_t = trajectories[torch.arange(self.batch), index.to(self.device)]
        else:  # a point per frame block (CausVid / Self-Forcing): blocks at different noise levels
            blocks = self.student.layout.blocks(self.shape[1])
            per_block = torch.randint(len(self.steps), (self.batch, len(blocks)), generator=self.generator)
            index = torch.cat([per_block[:, b:b + 1].expand(-1, end - start) for b, (start, end) in enumerate(blocks)],
                              dim=1).to(self.device)  # (B, F)
            gather = index[:, None, None, :, None, None].expand(-1, 1, trajectories.shape[2], -1,
                                                                *trajectories.shape[-2:])
            x_t = trajectories.gather(1, gather).squeeze(1)
            t = steps.to(self.device)[index]
        pred = self.student(x_t, t, self.texts.batch(prompts))
        return ode_regression_loss(pred, trajectories[:, -1]), {}

    # ---- the critic's loss ----
    def critic_loss(self) -> tuple[torch.Tensor, dict[str, float]]:
        uses_real = self.pairs is not None
        prompts, trajectories = self.draw_pairs() if uses_real else (self.draw_prompts(), None)
        text = self.texts.batch(prompts)
        with torch.no_grad():
            sample = self.student_sample(text)
        generated = sample.sample.detach()
        t = self.score_timesteps(sample)
        noise = self.noise()
        extras: dict[str, float] = {}
        loss = torch.zeros((), device=self.device)
        if "dmd" in self.d.objectives or "sid" in self.d.objectives:
            units = self.objective.from_train_timestep(t).to(self.device)
            noisy = renoise(self.objective, generated, noise, t)
            with self.fake.autocast():
                pred = self.adapter.predict(self.critic.model, noisy, units, text)
            denoising = self.objective.loss(pred, self.objective.target(generated, noise, units), units)
            extras["critic_denoising_loss"] = denoising.item()
            loss = loss + denoising
        if "gan" in self.d.objectives:
            real_sample = trajectories[:, -1]
            fake_logits, real_logits = self.logits(generated, real_sample, text, t, noise)
            gan = gan_critic_loss(fake_logits, real_logits, self.d.relativistic_discriminator)
            extras["gan_critic_loss"] = gan.item()
            loss = loss + self.d.gan_critic_weight * gan
            for weight, sigma, x0, logits, name in (
                    (self.d.r1_weight, self.d.r1_sigma, real_sample, real_logits, "r1"),
                    (self.d.r2_weight, self.d.r2_sigma, generated, fake_logits, "r2")):
                if weight > 0:
                    noisy = renoise(self.objective, x0, noise, t)
                    bumped = noisy + sigma * self.noise(noisy.shape)
                    penalty = finite_difference_penalty(self.classify(bumped, t, text), logits, sigma)
                    extras[f"{name}_loss"] = penalty.item()
                    loss = loss + weight * penalty
        return loss, extras

    # ---- the GAN branch ----
    def classify(self, noisy: torch.Tensor, t: torch.Tensor, text) -> torch.Tensor:
        features = self.critic.features
        features.active = True
        try:
            self.fake(noisy, t, text)
        finally:
            features.active = False
        return self.critic.head(features.take())

    def logits(self, fake_x0, real_x0, text, t, noise) -> tuple[torch.Tensor, torch.Tensor]:
        """The classifier's logits of the noised student and teacher samples (same noise and timesteps), in one
        critic forward."""
        both = torch.cat([renoise(self.objective, fake_x0, noise, t), renoise(self.objective, real_x0, noise, t)])
        doubled = {k: torch.cat([v, v]) for k, v in text.items()}
        logits = self.classify(both, torch.cat([t, t]), doubled)
        return logits.chunk(2)


def _checkpointer(config, accelerator, student, opt_g, sched_g, critic, opt_c, sched_c, reporter, ema):
    """``save(state)``: every rank writes its RNG; the main process the student, the critic (and its GAN head), both
    optimizers and schedules and the EMA, into one ``checkpoint-<step>``."""

    def save(state: RunState) -> None:
        main = accelerator.is_main_process
        trainable = _trainable_state(accelerator.unwrap_model(student), config)
        require_finite(trainable, state.global_step, "checkpoint")
        extra_trainable = extra_states = None
        if critic is not None and main:
            extra_trainable = {"critic": critic.trainable(config)}
            extra_states = {"critic_optimizer": opt_c.state_dict(), "critic_scheduler": sched_c.state_dict()}
        path = ckpt.save_checkpoint(
            config.output_dir, state, trainable=trainable if main else None, optimizer=opt_g, lr_scheduler=sched_g,
            total_limit=config.checkpoints_total_limit, rank=accelerator.process_index,
            world_size=accelerator.num_processes, barrier=accelerator.wait_for_everyone,
            ema_state=ema.state_dict() if ema is not None and main else None,
            extra_trainable=extra_trainable, extra_states=extra_states,
        )
        if main:
            log.info("saved %s", path)
            reporter.checkpoint(state.global_step, str(path))

    return save


def export_student(config, adapter, model, folder: Path, steps: list[float]) -> Path:
    """The student as users load it (``export_weights``: a LoRA for the family's pipeline, or ``transformer/``),
    plus ``distillation.json`` (its timesteps and sampler) and, for a flow-matching family, ``scheduler/``: a
    ``FlowMatchEulerDiscreteScheduler`` that steps exactly as the student samples when the pipeline is called with
    ``sigmas`` = the timesteps / 1000 (``stochastic_sampling`` for the consistency sampler)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = export_weights(config, adapter, model, folder)
    d = config.distillation
    info = {"model_family": config.model_family, "model_flavour": config.model_flavour,
            "pretrained_model_name_or_path": config.pretrained_model_name_or_path, "objective": d.objective,
            "timesteps": steps, "sampler": d.student_sampler, "num_inference_steps": len(steps)}
    if d.causal:  # what `simpletuner stream-video` needs to run it block by block
        info["causal"] = {"num_frame_per_block": d.num_frame_per_block, "local_attn_size": d.local_attn_size,
                          "independent_first_frame": d.independent_first_frame, "context_noise": d.context_noise}
        width, height, frames = sample_size(config, adapter)
        info.update(num_frames=frames, width=width, height=height)
    if adapter.objective.name == "flow_matching":
        from diffusers import FlowMatchEulerDiscreteScheduler

        FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False,
                                        stochastic_sampling=d.student_sampler == "consistency"
                                        ).save_pretrained(folder / "scheduler")
        info["sigmas"] = [t / 1000 for t in steps]
    write_json(folder / "distillation.json", info)
    return path


# ---------------------------------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------------------------------
def make_pairs(config, backends) -> tuple[int, int, str]:
    """``simpletuner distill-pairs``: the teacher's missing trajectories (this process's share); returns (made,
    stored in all, the folder)."""
    d = config.distillation
    check_run_paths(config, backends)
    accelerator = Accelerator(mixed_precision=config.mixed_precision if config.mixed_precision != "no" else "no")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    device = accelerator.device
    adapter = create_adapter(config, device=device, weight_dtype=weight_dtype_for(config, device), references=False)
    check_model(config, adapter)
    adapter.check_weights()
    steps = [t for t in warped_step_list(d) if t > 0]
    width, height, frames = sample_size(config, adapter)
    prompts = load_prompts(config)
    texts = prepare_texts(config, backends, adapter, accelerator, prompts, [])
    shape = latent_shape(adapter, width, height, frames)
    adapter.unload_encoders()
    teacher = load_teacher(adapter, device)
    pairs, made = prepare_pairs(config, adapter, accelerator, teacher, texts, prompts, shape, steps)
    stored = sum(1 for s in pairs.specs if pairs.cache.has(s.key))
    accelerator.end_training()
    return made, stored, str(pairs.cache.folder)


def run(config, backends) -> int:
    """Distill and report the outcome to the webhooks, as fine-tuning's ``run`` does; returns a process exit code."""
    return run_recipe(config, backends, recipe=distill)
