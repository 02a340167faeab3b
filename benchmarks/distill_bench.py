"""How close a distilled student's few-step samples come to its teacher's 50-step samples, before and after
distillation. Prints, per objective and step count N, the mean squared latent distance to the teacher's 50-step
sample from the same noise, before (the teacher itself sampling in N steps) and after (the student in N steps),
and their ratio after / before, all measured in this one run.

    .venv/bin/python benchmarks/distill_bench.py                          # ode_regression and dmd, N = 1, 2, 4
    .venv/bin/python benchmarks/distill_bench.py --objectives ode_regression --distill-steps 400
    .venv/bin/python benchmarks/distill_bench.py --help

The tiny Flux is a random network: its ODE carries noise almost straight to noise, and any student is "close" to it.
So the benchmark first fine-tunes the tiny teacher (the fine-tuning recipe, the full model, on the 12 pictures of
``datasets/sample`` at 32x32 pixels) until its 50-step samples are pictures of its data: now 1 or 2 Euler steps from
noise land far from the 50-step sample (the ODE bends), and there is something to distill. The students then run
through the distillation recipe as a user would run it (prompts = the dataset's captions; ``distill-pairs``
trajectories of the teacher at 50 steps for ode_regression), and are compared on fresh noises that no training
trajectory started from. Everything happens in ``--work-dir`` (kept, so a second run reuses the teacher and the
trajectories; delete it to start over).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--objectives", default="ode_regression,dmd", help="comma-separated (default: %(default)s)")
    p.add_argument("--work-dir", default="output/distill_bench", help="default: %(default)s")
    p.add_argument("--teacher-steps", type=int, default=600, help="fine-tuning steps of the tiny teacher")
    p.add_argument("--distill-steps", type=int, default=300, help="ode_regression steps")
    p.add_argument("--dmd-steps", type=int, default=150, help="steps of the other objectives (each costs a rollout, "
                                                              "the teacher and the critic)")
    p.add_argument("--pairs-per-prompt", type=int, default=6, help="teacher trajectories per caption (ode_regression)")
    p.add_argument("--eval-noises", type=int, default=4, help="fresh noises per caption for the comparison")
    p.add_argument("--reference-steps", type=int, default=50, help="the teacher's reference sample steps")
    p.add_argument("--resolution", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: %(default)s: the tiny "
                   "model is overhead-bound, and more threads than free cores spin)")
    return p.parse_args()


def base_config(work: Path, resolution: int, **values):
    from simpletuner.config import load_train_config

    return load_train_config({
        "model_family": "flux", "model_flavour": "tiny", "model_type": "full", "mixed_precision": "no", "seed": 0,
        "resolution": resolution, "resolution_type": "pixel", "train_batch_size": 4, "learning_rate": 3e-4,
        "max_grad_norm": 1.0, "checkpointing_steps": None, "data_backend_config": "unused.json", **values}).config


def train_teacher(args, work: Path) -> Path:
    """The tiny Flux fine-tuned (full) on datasets/sample; returns its transformer folder."""
    folder = work / "teacher" / "transformer"
    if (folder / "config.json").is_file():
        return folder
    from simpletuner.config import load_data_backends
    from simpletuner.training.trainer import train

    config = base_config(work, args.resolution, output_dir=str(work / "teacher"), max_train_steps=args.teacher_steps,
                         learning_rate=1e-3, lr_scheduler="cosine", flow_use_uniform_schedule=True)
    backends = load_data_backends([
        {"id": "sample", "instance_data_dir": str(REPO / "datasets/sample"), "caption_strategy": "textfile",
         "resolution": args.resolution, "resolution_type": "pixel", "cache_dir_vae": str(work / "cache/vae")},
        {"id": "text", "dataset_type": "text_embeds", "cache_dir": str(work / "cache/text")}], config=config)
    started = time.time()
    result = train(config, backends)
    print(f"teacher: {result.global_step} fine-tuning steps in {time.time() - started:.0f}s, "
          f"final loss {result.final_loss:.4f}")
    return folder


def captions() -> list[str]:
    return sorted({p.read_text().strip() for p in (REPO / "datasets/sample").glob("*.txt")})


def distill_student(args, work: Path, teacher: Path, objective: str) -> Path:
    """Run the distillation recipe; returns the student's transformer folder."""
    from simpletuner.config import load_data_backends
    from simpletuner.training.distill import distill

    out = work / f"student-{objective}"
    if (out / "transformer" / "config.json").is_file():
        return out / "transformer"
    distillation = {"objective": objective, "prompts": captions(), "pairs_cache_dir": str(work / "pairs"),
                    "validation_num_samples": 0}
    if objective == "ode_regression":
        distillation.update(teacher_num_inference_steps=args.reference_steps,
                            ode_pairs_per_prompt=args.pairs_per_prompt)
    else:
        distillation.update(generator_update_ratio=5, generator_learning_rate=1e-4, critic_learning_rate=1e-4)
    steps = args.distill_steps if objective == "ode_regression" else args.dmd_steps
    config = base_config(work, args.resolution, output_dir=str(out), max_train_steps=steps, train_batch_size=8,
                         pretrained_transformer_model_name_or_path=str(teacher.parent),  # <run>/transformer
                         distillation=distillation, adam_beta1=0.0)
    backends = load_data_backends([{"id": "text", "dataset_type": "text_embeds",
                                    "cache_dir": str(work / "cache/text")}], config=config)
    started = time.time()
    result = distill(config, backends)
    print(f"{objective}: {result.global_step} distillation steps in {time.time() - started:.0f}s, "
          f"final loss {result.final_loss:.4f}")
    return out / "transformer"


@torch.no_grad()
def distances(args, work: Path, teacher: Path, students: dict[str, Path]) -> dict:
    """Mean squared latent distance to the teacher's reference samples: the teacher in N steps ("before") and
    each student in N steps ("after"), on the same fresh noises."""
    from diffusers import FluxTransformer2DModel

    from simpletuner.config.distill import warped_step_list
    from simpletuner.data.cache import TensorCache, text_key
    from simpletuner.models.flux import FluxAdapter
    from simpletuner.training.distill import latent_shape
    from simpletuner.training.distill_sampling import Denoiser, ode_solve, step_subset, teacher_schedule
    from simpletuner.training.distill_validation import step_counts

    config = base_config(work, args.resolution, max_train_steps=1, distillation={"prompts": ["x"]})
    adapter = FluxAdapter(config)
    shape = latent_shape(adapter, args.resolution, args.resolution, None)
    cache = TensorCache(work / "cache/text")
    identity = adapter.text_cache_identity()
    steps = [t for t in warped_step_list(config.distillation) if t > 0]
    load = lambda folder: FluxTransformer2DModel.from_pretrained(folder).eval()  # noqa: E731
    networks = {"teacher": Denoiser(adapter, load(teacher))}
    networks.update({name: Denoiser(adapter, load(folder)) for name, folder in students.items()})
    samplers = {name: json.loads((folder.parent / "distillation.json").read_text())["sampler"]
                for name, folder in students.items()}
    schedule = teacher_schedule(args.reference_steps, config.distillation.timestep_shift, [])
    # every caption with each of its fresh noises, as one batch
    items = [(c, caption, i) for c, caption in enumerate(captions()) for i in range(args.eval_noises)]
    text = {k: torch.stack([cache.load(text_key(caption, identity))[k] for _, caption, _ in items])
            for k in cache.load(text_key(items[0][1], identity))}
    noise = torch.cat([torch.randn((1, *shape), generator=torch.Generator().manual_seed(10_000 + 100 * c + i))
                       for c, _, i in items])
    reference, _ = ode_solve(lambda x, t: networks["teacher"](x, t, text), noise, schedule, adapter.objective)
    sums: dict[tuple[str, int], float] = {}
    for n in step_counts(len(steps)):
        subset = step_subset(steps, n)
        for name, net in networks.items():
            sampler = samplers.get(name, "ode")  # the teacher in N steps: its Euler ODE sampler
            sample = net.rollout(noise, subset, text, sampler=sampler,
                                 generator=torch.Generator().manual_seed(20_000)).sample
            sums[(name, n)] = (sample - reference).pow(2).flatten(1).mean(1).sum().item()
    count = len(items)
    return {key: value / count for key, value in sums.items()}, count


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    work = (REPO / args.work_dir) if not Path(args.work_dir).is_absolute() else Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    objectives = [o.strip() for o in args.objectives.split(",") if o.strip()]
    started = time.time()
    teacher = train_teacher(args, work)
    students = {o: distill_student(args, work, teacher, o) for o in objectives}
    result, count = distances(args, work, teacher, students)
    counts = sorted({n for _, n in result})
    print(f"\nmean squared latent distance to the teacher's {args.reference_steps}-step sample, {count} fresh noises "
          f"({args.eval_noises} per caption), tiny Flux fine-tuned {args.teacher_steps} steps, "
          f"{args.distill_steps} ode_regression / {args.dmd_steps} other distillation steps:\n")
    print("| objective | N steps | before (teacher, N Euler steps) | after (student) | after / before |")
    print("|---|---|---|---|---|")
    for objective in objectives:
        for n in counts:
            before, after = result[("teacher", n)], result[(objective, n)]
            print(f"| {objective} | {n} | {before:.5f} | {after:.5f} | {after / before:.3f} |")
    (work / "results.json").write_text(json.dumps(
        {f"{name}/{n}": value for (name, n), value in result.items()}, indent=2))
    print(f"\n(total {time.time() - started:.0f}s; results in {work / 'results.json'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
