import pytest
import torch

from simpletuner.evaluation.eval_loss import EVAL_SIGMAS, EvalItem, evaluation_loss, fixed_noise, metric_name


def _items(adapter, n=2):
    text = adapter.encode_prompts(["a red square", "a blue circle"])
    g = torch.Generator().manual_seed(0)
    return [EvalItem(f"sample-{i}", torch.randn(4, 4, 4, generator=g), text[i % 2].tensors) for i in range(n)]


def test_fixed_noise_depends_on_the_key_only_and_leaves_the_global_rng_alone():
    torch.manual_seed(1)
    expected_next = torch.rand(2)
    torch.manual_seed(1)
    a = fixed_noise("key-a", (4, 8, 8))
    assert torch.equal(torch.rand(2), expected_next)
    assert torch.equal(a, fixed_noise("key-a", (4, 8, 8)))
    assert not torch.equal(a, fixed_noise("key-b", (4, 8, 8)))


def test_levels_and_names():
    assert EVAL_SIGMAS == pytest.approx([0.1 * i for i in range(1, 10)])
    assert metric_name(0.1) == "eval/loss_sigma_0.1" and metric_name(0.5) == "eval/loss_sigma_0.5"


def test_identical_across_evaluations_and_changes_with_the_weights(tiny_adapter, tiny_transformer):
    items = _items(tiny_adapter)
    tiny_transformer.eval()
    first = evaluation_loss(tiny_adapter, tiny_transformer, items, batch_size=4)
    torch.manual_seed(123)  # the global RNG plays no part
    second = evaluation_loss(tiny_adapter, tiny_transformer, items, batch_size=4)
    assert first == second  # bit for bit
    # another batch split changes only float rounding
    assert evaluation_loss(tiny_adapter, tiny_transformer, items, batch_size=9) == pytest.approx(first, rel=1e-6)
    assert set(first) == {metric_name(s) for s in EVAL_SIGMAS} | {"eval/loss"}
    assert first["eval/loss"] == pytest.approx(sum(first[metric_name(s)] for s in EVAL_SIGMAS) / 9)

    weight = tiny_transformer.proj_out.weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(1.5)
        assert evaluation_loss(tiny_adapter, tiny_transformer, items)["eval/loss"] != first["eval/loss"]
    finally:
        with torch.no_grad():
            weight.copy_(saved)


def test_matches_the_training_objective_at_one_level(tiny_adapter, tiny_transformer):
    (item,) = _items(tiny_adapter, 1)
    tiny_transformer.eval()
    metrics = evaluation_loss(tiny_adapter, tiny_transformer, [item], levels=(0.5,))
    x0 = item.latents.unsqueeze(0)
    noise = fixed_noise(item.key, item.latents.shape).unsqueeze(0)
    sigma = torch.tensor([0.5])
    text = {k: v.unsqueeze(0) for k, v in item.text.items()}
    with torch.no_grad():
        pred = tiny_adapter.predict(tiny_transformer, 0.5 * x0 + 0.5 * noise, sigma, text)
    expected = torch.nn.functional.mse_loss(pred, noise - x0).item()
    assert metrics["eval/loss_sigma_0.5"] == pytest.approx(expected, rel=1e-5)


def test_needs_items(tiny_adapter, tiny_transformer):
    with pytest.raises(ValueError, match="no eval items"):
        evaluation_loss(tiny_adapter, tiny_transformer, [])


_EVAL_RUN = """
import json, sys
import torch
from simpletuner.evaluation.eval_loss import EvalItem, evaluation_loss
from simpletuner.models.registry import get_adapter_class
from tests.models.contract import family_config

torch.manual_seed(int(sys.argv[1]))  # each run starts from its own global RNG state
out = {}
for prediction_type, zero_snr in (("epsilon", False), ("v_prediction", True)):
    adapter = get_adapter_class("sdxl")(family_config("sdxl", prediction_type=prediction_type,
                                                      rescale_betas_zero_snr=zero_snr))
    unet = adapter.load_transformer().eval()
    text = adapter.encode_prompts(["a red square"])[0].tensors
    latents = torch.linspace(-1, 1, 4 * 8 * 8).reshape(4, 8, 8)
    out[prediction_type] = evaluation_loss(adapter, unet, [EvalItem("held-out-0", latents, text)])
print(json.dumps(out))
"""


def test_ddpm_eval_loss_is_the_same_in_every_run(tiny_dir):
    """Epsilon and v-prediction (on a zero-terminal-SNR schedule), measured on the tiny SDXL UNet in two separate
    processes that start from different RNG states: the same fixed timesteps, the same numbers bit for bit."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    runs = [json.loads(subprocess.run([sys.executable, "-c", _EVAL_RUN, str(seed)], cwd=REPO, env=env, check=True,
                                      capture_output=True, text=True, timeout=600).stdout.strip().splitlines()[-1])
            for seed in (1, 2)]
    assert runs[0] == runs[1]
    for metrics in runs[0].values():
        levels = [name for name in metrics if name != "eval/loss"]
        assert len(levels) == 9 and all(name.startswith("eval/loss_t_") for name in levels)
        assert all(value > 0 for value in metrics.values())
    assert runs[0]["epsilon"] != runs[0]["v_prediction"]
