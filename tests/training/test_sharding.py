"""FSDP across two real gloo processes (accelerate's MULTI_CPU state, torch's fully_shard, torch.distributed.checkpoint):
a tiny Flux transformer is sharded block by block, checkpointed in both layouts, resumed with the same losses bit for
bit, a damaged shard is named and skipped, the trained weights are gathered, and ``consolidate`` turns the
checkpoint back into the same weights in one process. Plus the pieces that need no process group: the settings
handed to accelerate, the metadata reader that never runs pickled code, the file checks."""

from __future__ import annotations

import json
import os
import pickle
import socket

import pytest
import torch

from simpletuner.training import sharding
from simpletuner.training.checkpoint import CheckpointDamaged
from simpletuner.training.guards import LossNotFinite
from tests.helpers import flux_config

WORLD = 2


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, root: str, port: int) -> None:
    """One of two processes: every scenario in turn, its results written to ``root/result-<rank>.json``."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_WORLD_SIZE":
                       str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "ACCELERATE_USE_CPU": "1"})
    torch.set_num_threads(1)  # one intra-op thread: the CPU's reductions then keep their order
    from pathlib import Path

    from accelerate import Accelerator

    from simpletuner.models.flux import FluxAdapter
    from simpletuner.training import checkpoint as ckpt
    from simpletuner.training.state import RunState
    from tests.helpers import flux_transformer_inputs, tiny_flux_transformer

    root = Path(root)
    accelerator = Accelerator()
    results: dict = {"distributed_type": str(accelerator.distributed_type)}

    def build(config):
        model = tiny_flux_transformer()
        if config.model_type == "lora":
            from peft import LoraConfig

            model.requires_grad_(False)
            model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v"]))
        else:
            model.requires_grad_(True)
        run = sharding.FsdpRun(config, accelerator)
        model = run.shard(model)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        model, optimizer, schedule = run.prepare(model, optimizer, schedule)
        return run, model, optimizer, schedule

    def step(model, optimizer, schedule, i):
        out = model(**flux_transformer_inputs(seed=100 * i + rank), return_dict=False)[0]
        loss = out.pow(2).mean()
        accelerator.backward(loss)
        accelerator.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        return loss.item()

    def save(run, optimizer, schedule, output, i):
        ckpt.save_checkpoint(output, RunState(torch.Generator().manual_seed(rank), global_step=i), trainable=None,
                             optimizer=optimizer, lr_scheduler=schedule, total_limit=None, rank=rank,
                             world_size=WORLD, barrier=accelerator.wait_for_everyone, shards=run)

    def resume(config, output, which):
        run, model, optimizer, schedule = build(config)
        state = RunState(torch.Generator())
        path, trainable = ckpt.resume(output, which, state, optimizer=optimizer, lr_scheduler=schedule, rank=rank,
                                      world_size=WORLD, shards=run)
        return path, trainable, state, (run, model, optimizer, schedule)

    for name, settings in {"full-sharded": {"model_type": "full"},
                           "full-full": {"model_type": "full", "fsdp_state_dict_type": "full"},
                           "lora-sharded": {"model_type": "lora"}}.items():
        output = root / name
        config = flux_config(fsdp_enable=True, output_dir=str(output), **settings)
        run, model, optimizer, schedule = build(config)
        results[f"{name}/local_shard"] = [tuple(p.to_local().shape) for p in model.parameters()][0]
        first = [step(model, optimizer, schedule, i) for i in (1, 2)]
        save(run, optimizer, schedule, output, 2)
        expected = [step(model, optimizer, schedule, i) for i in (3, 4)]
        save(run, optimizer, schedule, output, 4)
        run.export(FluxAdapter(config), root / f"{name}-export")

        path, trainable, state, (run, model, optimizer, schedule) = resume(config, output, str(output / "checkpoint-2"))
        resumed = [step(model, optimizer, schedule, i) for i in (3, 4)]
        results[name] = {"expected": expected, "resumed": resumed, "trainable": trainable, "step": state.global_step,
                         "losses": first + expected}

    # the same four steps unsharded in this one process, on both processes' inputs (gradients averaged, as FSDP's
    # reduce-scatter averages them): what the sharded run must have computed
    model = tiny_flux_transformer().requires_grad_(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reference = []
    for i in (1, 2, 3, 4):
        losses = [model(**flux_transformer_inputs(seed=100 * i + r), return_dict=False)[0].pow(2).mean()
                  for r in range(WORLD)]
        (sum(losses) / WORLD).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        reference.append(losses[rank].item())
    results["unsharded"] = reference

    # a shard cut short: named, and `latest` falls back to the checkpoint before it, on every process alike
    output = root / "full-sharded"
    config = flux_config(fsdp_enable=True, output_dir=str(output), model_type="full")
    if accelerator.is_main_process:
        shard = output / "checkpoint-4" / "sharded" / "__1_0.distcp"
        shard.write_bytes(shard.read_bytes()[:1000])
    accelerator.wait_for_everyone()
    path, _, state, parts = resume(config, output, "latest")
    results["damaged/latest"] = [path.name, state.global_step, step(*parts[1:], 3)]
    try:
        resume(config, output, str(output / "checkpoint-4"))
    except CheckpointDamaged as exc:
        results["damaged/named"] = str(exc)

    # a NaN in one process's shard stops every process before a collective save could wait for it
    run, model, *_ = build(config)
    if rank == 1:
        with torch.no_grad():
            next(model.parameters()).to_local().fill_(float("nan"))
    try:
        run.require_finite(5, "checkpoint")
    except LossNotFinite as exc:
        results["nan"] = str(exc)
    (root / f"result-{rank}.json").write_text(json.dumps(results))
    accelerator.end_training()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("fsdp")
    mp.spawn(_worker, args=(str(root), _port()), nprocs=WORLD, join=True)
    return root, [json.loads((root / f"result-{r}.json").read_text()) for r in range(WORLD)]


def test_two_gloo_processes_shard_the_model(two_ranks):
    _, results = two_ranks
    for result in results:
        # accelerate's own state is plain DDP on the CPU; fully_shard did the sharding
        assert result["distributed_type"] == "DistributedType.MULTI_CPU"
    # the first parameter (the timestep embedding's 32 x 256 weight) is split over the two processes, half each
    assert [r["full-sharded/local_shard"] for r in results] == [[16, 256], [16, 256]]


def test_sharded_training_computes_what_unsharded_training_does(two_ranks):
    _, results = two_ranks
    for result in results:
        assert result["full-sharded"]["losses"] == pytest.approx(result["unsharded"], rel=1e-5)


@pytest.mark.parametrize("name", ["full-sharded", "full-full", "lora-sharded"])
def test_resume_gives_the_same_losses_bit_for_bit(two_ranks, name):
    _, results = two_ranks
    for result in results:
        run = result[name]
        assert run["step"] == 2 and run["trainable"] is None  # the shards restored the weights themselves
        assert run["resumed"] == run["expected"]
    assert results[0][name]["expected"] != results[1][name]["expected"]  # each process trained on its own batch


def test_checkpoint_layouts(two_ranks):
    root, _ = two_ranks
    sharded = root / "full-sharded" / "checkpoint-4"
    assert sorted(p.name for p in (sharded / "sharded").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (sharded / "trainable.safetensors").exists() and not (sharded / "optimizer.pt").exists()
    state = json.loads((sharded / "training_state.json").read_text())
    assert state["sharding"]["kind"] == "fsdp" and state["sharding"]["world_size"] == 2
    assert "sharded/__1_0.distcp" in state["sharding"]["files"]
    full = root / "full-full" / "checkpoint-4"
    assert (full / "trainable.safetensors").is_file() and (full / "optimizer.pt").is_file()
    assert not (full / "sharded").exists()
    assert (root / "lora-sharded" / "checkpoint-4" / "adapter_config.json").is_file()  # peft's config, for consolidate


def test_a_damaged_shard_is_named_and_latest_falls_back(two_ranks):
    _, results = two_ranks
    for result in results:
        name, step, loss = result["damaged/latest"]
        assert (name, step) == ("checkpoint-2", 2)
        assert loss == result["full-sharded"]["expected"][0]  # it trains on exactly as from checkpoint-2
        assert "checkpoint-4/sharded/__1_0.distcp: 1000 bytes, but" in result["damaged/named"]


def test_a_non_finite_shard_stops_every_process(two_ranks):
    _, results = two_ranks
    assert "another process's part of the weights is not finite" in results[0]["nan"]
    assert "checkpoint at step 5: 1 weight tensor(s) are not finite" in results[1]["nan"]


@pytest.mark.parametrize("name", ["full-sharded", "full-full", "lora-sharded"])
def test_consolidate_writes_the_gathered_weights(two_ranks, name, tmp_path):
    from safetensors.torch import load_file

    from simpletuner.training.consolidate import consolidate

    root, _ = two_ranks
    if name == "full-sharded":
        checkpoint = root / name / "checkpoint-2"  # checkpoint-4's shard was cut short above
        with pytest.raises(CheckpointDamaged, match="__1_0.distcp"):
            consolidate(root / name / "checkpoint-4", tmp_path / "damaged")
        assert not (tmp_path / "damaged").exists() and not list(tmp_path.iterdir())
    else:
        checkpoint = root / name / "checkpoint-4"
    written = consolidate(checkpoint, tmp_path / "out")
    exported = root / f"{name}-export"
    if name.startswith("lora"):
        assert written == tmp_path / "out" / "pytorch_lora_weights.safetensors"
        got, want = load_file(written), load_file(exported / "pytorch_lora_weights.safetensors")
    else:
        assert written == tmp_path / "out" / "transformer"
        got = load_file(written / "diffusion_pytorch_model.safetensors")
        want = load_file(exported / "transformer" / "diffusion_pytorch_model.safetensors")
    assert got.keys() == want.keys() and len(got) > 0
    if name == "full-sharded":  # consolidated from checkpoint-2, exported after step 4: trained further since
        assert any(not torch.equal(got[k], want[k]) for k in got)
    else:
        assert all(torch.equal(got[k], want[k]) for k in got)
    with pytest.raises(FileExistsError, match="--out: .* already exists"):
        consolidate(checkpoint, tmp_path / "out")


# ---- no process group needed ------------------------------------------------------------------------------------
def test_metadata_reader_never_runs_a_planted_pickle(tmp_path):
    class Planted:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))

    folder = tmp_path / "sharded"
    folder.mkdir()
    (folder / ".metadata").write_bytes(pickle.dumps(Planted()))
    with pytest.raises(CheckpointDamaged, match=r"sharded/\.metadata: cannot be read safely .*system"):
        sharding.read_metadata(folder)
    assert not (tmp_path / "ran").exists()
    (folder / ".metadata").write_bytes(b"\x80\x04")  # cut short
    with pytest.raises(CheckpointDamaged, match=r"\.metadata: cannot be read safely"):
        sharding.read_metadata(folder)


def test_file_checks_name_missing_and_resized_files(tmp_path):
    (tmp_path / "a.pt").write_bytes(b"12345")
    sharding.check_files(tmp_path, {"files": {"a.pt": 5}})
    with pytest.raises(CheckpointDamaged, match=r"a.pt: 4 bytes, but 5 were written"):
        (tmp_path / "a.pt").write_bytes(b"1234")
        sharding.check_files(tmp_path, {"files": {"a.pt": 5}})
    with pytest.raises(CheckpointDamaged, match=r"b.pt: missing"):
        sharding.check_files(tmp_path, {"files": {"b.pt": 5}})


def test_optimizer_state_splits_into_tensors_and_the_rest():
    state = {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}},
             "param_groups": [{"lr": 0.1, "params": ["w"]}]}
    tensors, rest = sharding.split_tensors(state)
    assert tensors == {"state": {"w": {"step": state["state"]["w"]["step"], "exp_avg": state["state"]["w"]["exp_avg"]}}}
    assert rest == {"state": {"w": {}}, "param_groups": [{"lr": 0.1, "params": ["w"]}]}
    assert sharding.merge_tensors(tensors, rest) == state


def test_gpu_plugins_are_built_from_the_config():
    config = flux_config(fsdp_enable=True, fsdp_reshard_after_forward=False, fsdp_state_dict_type="full")
    plugin = sharding.fsdp_plugin(config)
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is False
    assert plugin.transformer_cls_names_to_wrap == ["FluxTransformerBlock", "FluxSingleTransformerBlock"]
    assert "FULL_STATE_DICT" in str(plugin.state_dict_type)
    named = flux_config(fsdp_enable=True, fsdp_transformer_layer_cls_to_wrap="FluxSingleTransformerBlock")
    assert sharding.fsdp_plugin(named).transformer_cls_names_to_wrap == ["FluxSingleTransformerBlock"]
    # on this machine (no CUDA) the run gets no plugin: it shards by hand
    assert sharding.accelerator_kwargs(config) == {}


def test_deepspeed_auto_values_come_from_the_config():
    config = flux_config(train_batch_size=3, gradient_accumulation_steps=2, max_grad_norm=0.5,
                         deepspeed_config={"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
                                           "gradient_clipping": 1.0})
    settings = sharding.deepspeed_settings(config, world_size=4)
    assert settings == {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 3,
                        "gradient_accumulation_steps": 2, "train_batch_size": 24, "gradient_clipping": 1.0}
    assert config.deepspeed_config["train_micro_batch_size_per_gpu"] == "auto"  # the config is left as it was


def test_the_family_names_its_blocks(tiny_transformer):
    from simpletuner.models.ltxvideo import LTXVideoAdapter

    config = flux_config(fsdp_enable=True)
    assert sharding.block_classes(config) == ["FluxTransformerBlock", "FluxSingleTransformerBlock"]
    assert LTXVideoAdapter.fsdp_block_classes() == ["LTXVideoTransformerBlock"]

    class OneProcess:
        num_processes, distributed_type = 2, "MULTI_CPU"

    run = sharding.FsdpRun(flux_config(fsdp_enable=True, fsdp_transformer_layer_cls_to_wrap="FluxBlock"), OneProcess)
    with pytest.raises(ValueError, match="fsdp_transformer_layer_cls_to_wrap: FluxBlock not found in "
                                         "FluxTransformer2DModel"):
        run.shard(tiny_transformer)
    OneProcess.num_processes = 1
    with pytest.raises(ValueError, match="fsdp_enable: needs 2 or more processes"):
        sharding.FsdpRun(config, OneProcess)
