"""Why a 4-step ode_regression student with the ``ode`` sampler can miss its teacher, measured on the teacher alone
(run ``distill_bench.py`` first: it reads the bench's fine-tuned teacher and text cache from its work dir).

Prints, on 12 fresh noises (one per caption): the teacher's 50-step reference vs its ODE with the student's steps in
its schedule (where distill-pairs stores the trajectory points); the distance between the straight line from the
noise to the teacher's sample (where the student's deterministic steps go when its x0 is right) and the trajectory
point at each student step; the teacher's own 1/2/4 Euler steps; and a perfect endpoint student (the teacher's own
50-step ODE from whatever input it gets) sampled in the student's 4 ode steps, with its states against the
trajectory points.

    .venv/bin/python benchmarks/distill_ode_diagnosis.py
"""
import sys, torch
from pathlib import Path
REPO = Path(__file__).resolve().parents[1]; sys.path.insert(0, str(REPO)); sys.path.insert(0, str(REPO / "benchmarks"))
torch.set_num_threads(1)
import distill_bench as B
from diffusers import FluxTransformer2DModel
from simpletuner.config.distill import warped_step_list
from simpletuner.data.cache import TensorCache, text_key
from simpletuner.models.flux import FluxAdapter
from simpletuner.training.distill import latent_shape
from simpletuner.training.distill_sampling import Denoiser, ode_solve, step_subset, teacher_schedule, rollout, renoise, timesteps
work = REPO / "output/distill_bench"; res = 32  # distill_bench.py's default --work-dir and resolution
config = B.base_config(work, res, max_train_steps=1, distillation={"prompts": ["x"]})
adapter = FluxAdapter(config); obj = adapter.objective
shape = latent_shape(adapter, res, res, None)
cache = TensorCache(work / "cache/text"); identity = adapter.text_cache_identity()
steps = [t for t in warped_step_list(config.distillation) if t > 0]
T = Denoiser(adapter, FluxTransformer2DModel.from_pretrained(work / "teacher/transformer").eval())
items = [(c, cap, 0) for c, cap in enumerate(B.captions())]
text = {k: torch.stack([cache.load(text_key(cap, identity))[k] for _, cap, _ in items]) for k in cache.load(text_key(items[0][1], identity))}
noise = torch.cat([torch.randn((1, *shape), generator=torch.Generator().manual_seed(10_000 + 100 * c + i)) for c, _, i in items])
mse = lambda a, b: (a - b).pow(2).flatten(1).mean(1).mean().item()
n = len(items)
with torch.no_grad():
    ref50, _ = ode_solve(lambda x, t: T(x, t, text), noise, teacher_schedule(50, 1.0, []), obj)
    X, pts = ode_solve(lambda x, t: T(x, t, text), noise, teacher_schedule(50, 1.0, steps), obj, steps)
    print(f"{n} fresh noises; 52-step (with the student's steps) vs 50-step reference: {mse(X, ref50):.6f}")
    for k, t in enumerate(steps):
        line = renoise(obj, X, noise, timesteps(t, n))
        print(f"t={t:.0f}: |line point - trajectory point|^2 = {mse(line, pts[k]):.6f}; |traj pt|^2 {pts[k].pow(2).mean():.3f}")
    for m in (1, 2, 4):
        e = rollout(lambda x, t: T(x, t, text), noise, step_subset(steps, m), obj, sampler="ode").sample
        print(f"teacher {m} Euler steps vs ref: {mse(e, ref50):.6f}")
    def oracle(x, t):
        tv = float(t[0]); sch = [s for s in teacher_schedule(50, 1.0, [tv]) if s <= tv + 1e-9]
        return ode_solve(lambda y, u: T(y, u, text), x, sch, obj)[0]
    fed = []
    def rec(x, t):
        fed.append(x.clone()); return oracle(x, t)
    out = rollout(rec, noise, steps, obj, sampler="ode").sample
    print(f"perfect endpoint student (teacher's ODE from its input), 4 ode steps vs ref: {mse(out, ref50):.6f}  vs X: {mse(out, X):.6f}")
    for k, t in enumerate(steps):
        print(f"  its state at t={t:.0f} vs trajectory point: {mse(fed[k], pts[k]):.6f}")
