"""What an option needs besides the core install: packages (with the extra that installs them) and a device."""

from __future__ import annotations

import pytest

from simpletuner.config.requirements import device_errors, missing_packages, needed_packages


def paths(errors) -> list[str]:
    return [e.path for e in errors]


@pytest.mark.parametrize("device", ["cpu", "mps", "xpu"])
def test_bitsandbytes_optimizers_need_cuda(device):
    (error,) = device_errors({"optimizer": "bnb-adamw8bit"}, device)
    assert error.path == "optimizer"
    assert error.message.startswith(f"'bnb-adamw8bit' uses bitsandbytes' CUDA kernels and this run is on {device};")
    assert "'adamw', 'optimi-adamw'" in error.message
    assert device_errors({"optimizer": "bnb-adamw8bit"}, "cuda") == []
    assert device_errors({"optimizer": "adamw"}, device) == []


@pytest.mark.parametrize("field", ["base_model_precision", "text_encoder_1_precision", "text_encoder_2_precision",
                                   "text_encoder_3_precision"])
def test_nf4_needs_cuda_and_fp8_quanto_not_mps(field):
    (error,) = device_errors({field: "nf4-bnb"}, "cpu")
    assert error.path == field and "'nf4-bnb' quantizes with bitsandbytes on a CUDA GPU" in error.message
    assert "this run is on cpu" in error.message
    assert device_errors({field: "nf4-bnb"}, "cuda") == []
    (error,) = device_errors({field: "fp8-quanto"}, "mps")
    assert error.path == field and "'fp8-quanto' needs float8 support" in error.message
    assert device_errors({field: "fp8-quanto"}, "cpu") == device_errors({field: "fp8-quanto"}, "cuda") == []
    assert device_errors({field: "int8-quanto"}, "mps") == []


def test_loftq_needs_cuda_for_a_lora_only():
    (error,) = device_errors({"lora_init_type": "loftq"}, "cpu")  # model_type defaults to lora
    assert error.path == "lora_init_type" and "this run is on cpu; use 'default' here" in error.message
    assert paths(device_errors({"model_type": "lora", "lora_init_type": "loftq"}, "mps")) == ["lora_init_type"]
    assert device_errors({"model_type": "full", "lora_init_type": "loftq"}, "cpu") == []
    assert device_errors({"lora_init_type": "loftq"}, "cuda") == []
    assert device_errors({"lora_init_type": "default"}, "cpu") == []


def test_model_cpu_offload_needs_an_accelerator():
    (error,) = device_errors({"enable_model_cpu_offload": True}, "cpu")
    assert error.path == "enable_model_cpu_offload" and "the run is on the CPU" in error.message
    assert device_errors({"enable_model_cpu_offload": True}, "cuda") == []
    assert device_errors({"enable_model_cpu_offload": False}, "cpu") == []


def test_every_problem_is_reported_in_field_order():
    values = {"optimizer": "bnb-lion", "base_model_precision": "nf4-bnb", "text_encoder_2_precision": "nf4-bnb",
              "lora_init_type": "loftq", "enable_model_cpu_offload": True}
    assert paths(device_errors(values, "cpu")) == ["optimizer", "base_model_precision", "text_encoder_2_precision",
                                                   "lora_init_type", "enable_model_cpu_offload"]
    assert device_errors(values, "cuda") == []


def test_needed_packages_per_setting():
    needs = needed_packages({"optimizer": "prodigy", "model_type": "lora", "lora_type": "lycoris",
                             "lora_init_type": "loftq", "base_model_precision": "int8-quanto",
                             "text_encoder_1_precision": "int8-torchao", "text_encoder_3_precision": "nf4-bnb",
                             "report_to": "all"})
    assert [(field, p.module) for field, p in needs] == [
        ("optimizer", "prodigyopt"), ("lora_type", "lycoris"), ("lora_init_type", "bitsandbytes"),
        ("base_model_precision", "optimum.quanto"), ("text_encoder_1_precision", "torchao"),
        ("text_encoder_3_precision", "bitsandbytes"), ("report_to", "wandb"), ("report_to", "tensorboard")]
    # a full fine-tune has no LoRA to be LyCORIS or LoftQ; defaults need nothing
    assert needed_packages({"model_type": "full", "lora_type": "lycoris", "lora_init_type": "loftq"}) == []
    assert needed_packages({"optimizer": "adamw", "base_model_precision": "no_change", "report_to": "none"}) == []
    assert [f for f, _ in needed_packages({"report_to": "tensorboard"})] == ["report_to"]
    assert [p.module for _, p in needed_packages({"lora_type": "lycoris"})] == ["lycoris"]  # lora is the default
    assert [p.module for _, p in needed_packages({"lora_init_type": "loftq"})] == ["bitsandbytes"]
    assert [p.module for _, p in needed_packages({"base_model_precision": None, "text_encoder_1_precision": ""})] == []


def test_a_missing_package_names_the_setting_and_its_extra(monkeypatch):
    import simpletuner.config.requirements as requirements

    monkeypatch.setattr(requirements, "is_installed", lambda module: module != "prodigyopt")
    (error,) = missing_packages({"optimizer": "prodigy", "report_to": "wandb"})
    assert error.path == "optimizer"
    assert error.message == ("'prodigy' needs the prodigyopt package, which is not installed: "
                             "pip install 'simpletuner[optimizers]' (or pip install prodigyopt)")
    monkeypatch.setattr(requirements, "is_installed", lambda module: module != "wandb")
    (error,) = missing_packages({"report_to": "wandb"})
    assert error.message.endswith("pip install wandb (a core dependency: reinstall simpletuner)")


def test_is_installed_looks_without_importing():
    from simpletuner.config.requirements import is_installed

    assert is_installed("json") and not is_installed("surely_not_a_module_here")
    assert not is_installed("json.surely_not_a_submodule")
    # the parent is no package, or is missing: find_spec raises, and that means "not installed" too
    assert not is_installed("math.sub") and not is_installed("surely_not_a_module_here.sub")


def test_device_messages_in_full():
    """What a user reads when a setting cannot run here: the whole sentence, with the alternative to use."""
    messages = {e.path: e.message for e in device_errors(
        {"optimizer": "bnb-lion", "text_encoder_1_precision": "nf4-bnb", "enable_model_cpu_offload": True,
         "lora_init_type": "loftq"}, "cpu")}
    assert messages == {
        "optimizer": "'bnb-lion' uses bitsandbytes' CUDA kernels and this run is on cpu; use 'adamw', 'optimi-adamw', "
                     "'optimi-lion' or 'ademamix' here",
        "text_encoder_1_precision": "'nf4-bnb' quantizes with bitsandbytes on a CUDA GPU and this run is on cpu; use "
                                    "'int4-quanto' or 'int8-torchao' here",
        "lora_init_type": "'loftq' quantizes the base with bitsandbytes on a CUDA GPU and this run is on cpu; use "
                          "'default' here",
        "enable_model_cpu_offload": "the run is on the CPU, so there is no accelerator memory to offload the VAE and "
                                    "text encoders from; remove it",
    }
    (error,) = device_errors({"base_model_precision": "fp8-quanto"}, "mps")
    assert error.message == "'fp8-quanto' needs float8 support, which the mps device lacks; use 'int8-quanto'"
