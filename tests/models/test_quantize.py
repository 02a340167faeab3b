"""quanto quantization of a tiny Flux transformer, with a PEFT LoRA trained on top."""

import copy

import pytest
import torch
from optimum.quanto.nn import QLinear
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model, set_peft_model_state_dict

from simpletuner.models.quantize import (
    check_quantization_supported,
    check_quantized_training,
    quantize_model,
    weight_bytes,
)
from tests.helpers import tiny_flux_transformer as tiny_flux, flux_transformer_inputs as flux_inputs

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                "proj_mlp", "ff.net.2"]


def add_lora(model, seed=2):
    torch.manual_seed(seed)
    cfg = LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGETS, init_lora_weights="gaussian")
    return inject_adapter_in_model(cfg, model)


def train(model, inputs, target, steps=8, lr=1e-2):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(**inputs).sample, target)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    return losses


@pytest.mark.parametrize("precision", ["int8-quanto", "int4-quanto"])
def test_lora_trains_on_quantized_base_and_base_stays_frozen(precision):
    model = add_lora(quantize_model(tiny_flux(), precision))
    base_before = {n: t.clone() for n, t in model.state_dict().items() if "lora_" not in n}
    inputs = flux_inputs()
    target = torch.randn_like(inputs["hidden_states"])

    losses = train(model, inputs, target)

    assert losses[-1] < losses[0] * 0.9
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if n in trainable)
    assert isinstance(model.transformer_blocks[0].attn.to_q.base_layer, QLinear)
    for name, tensor in model.state_dict().items():
        if "lora_" not in name:
            assert torch.equal(tensor, base_before[name]), name


def test_lora_from_quantized_base_loads_onto_unquantized_base():
    inputs = flux_inputs()
    target = torch.randn_like(inputs["hidden_states"])
    quantized = add_lora(quantize_model(tiny_flux(), "int8-quanto"))
    train(quantized, inputs, target, steps=6, lr=3e-2)
    lora_state = get_peft_model_state_dict(quantized)

    plain = tiny_flux()
    plain.eval()
    with torch.no_grad():
        without_lora = plain(**inputs).sample
    add_lora(plain, seed=99)  # different init: the loaded state must overwrite it
    result = set_peft_model_state_dict(plain, lora_state)
    assert not result.unexpected_keys
    assert not [k for k in result.missing_keys if "lora_" in k]

    quantized.eval()
    with torch.no_grad():
        from_quantized = quantized(**inputs).sample
        from_plain = plain(**inputs).sample
    lora_effect = (from_plain - without_lora).abs().mean()
    mismatch = (from_plain - from_quantized).abs().mean()
    assert lora_effect > 1e-2
    assert mismatch < 0.1 * lora_effect


def test_lora_from_quantized_base_loads_with_diffusers_loader():
    quantized = add_lora(quantize_model(tiny_flux(), "int8-quanto"))
    inputs = flux_inputs()
    train(quantized, inputs, torch.randn_like(inputs["hidden_states"]), steps=3, lr=3e-2)
    lora_state = {k: v.clone() for k, v in get_peft_model_state_dict(quantized).items()}

    plain = tiny_flux()
    plain.load_lora_adapter(lora_state, adapter_name="default", prefix=None)
    plain.eval()
    quantized.eval()
    with torch.no_grad():
        assert torch.allclose(plain(**inputs).sample, quantized(**inputs).sample, atol=0.05)


def test_exclusions_stay_full_precision():
    model = quantize_model(tiny_flux(), "int8-quanto")
    assert type(model.proj_out) is torch.nn.Linear
    assert type(model.norm_out.linear) is torch.nn.Linear
    assert type(model.x_embedder) is torch.nn.Linear
    assert isinstance(model.single_transformer_blocks[0].proj_out, QLinear)
    assert isinstance(model.transformer_blocks[0].ff.net[2], QLinear)
    everything = quantize_model(tiny_flux(), "int8-quanto", exclude=[])
    assert isinstance(everything.proj_out, QLinear)


def test_weight_bytes_shrink_with_precision():
    bf16 = weight_bytes(tiny_flux().to(torch.bfloat16))
    assert bf16 == sum(p.numel() * 2 for p in tiny_flux().parameters())
    sizes = {p: weight_bytes(quantize_model(tiny_flux().to(torch.bfloat16), p, exclude=[]))
             for p in ("int8-quanto", "int4-quanto", "int2-quanto", "fp8-quanto")}
    assert sizes["int2-quanto"] < sizes["int4-quanto"] < sizes["int8-quanto"] < bf16
    assert sizes["fp8-quanto"] == sizes["int8-quanto"]


def test_all_precisions_run_on_cpu():
    inputs = flux_inputs(batch=1)
    with torch.no_grad():
        reference = tiny_flux()(**inputs).sample
        for precision in ("int8-quanto", "int4-quanto", "int2-quanto", "fp8-quanto"):
            out = quantize_model(tiny_flux(), precision)(**inputs).sample
            assert out.shape == reference.shape and torch.isfinite(out).all(), precision


@pytest.mark.parametrize("bits", [2, 4])
def test_packed_weights_unpack_on_the_cpu_without_compiling(bits):
    """int4 / int2 weights read on the CPU go through our torch unpack (quanto's own pack round-trips through it),
    and quanto's C++ extension is never built (compiling it took over 15 minutes inside a first step)."""
    from optimum.quanto.library.extensions import get_extension
    from optimum.quanto.tensor.packed import PackedTensor

    from simpletuner.models.quantize import unpack_bits

    inputs = flux_inputs(batch=1)
    with torch.no_grad():
        quantize_model(tiny_flux(), f"int{bits}-quanto")(**inputs)
    assert getattr(get_extension("quanto_cpp")._lib, "unpack", None) is unpack_bits
    values = torch.randint(0, 2**bits, (37, 5), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    assert torch.equal(PackedTensor.pack(values, bits=bits).unpack(), values)


def test_no_change_returns_module_untouched():
    model = tiny_flux()
    state = copy.deepcopy(model.state_dict())
    assert quantize_model(model, "no_change") is model
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_errors_name_the_field():
    with pytest.raises(ValueError, match="base_model_precision: 'int3-quanto' is not one of"):
        quantize_model(tiny_flux(), "int3-quanto")
    with pytest.raises(ValueError, match="text_encoder_1_precision"):
        quantize_model(torch.nn.Linear(2, 2), "nf4", field="text_encoder_1_precision")
    with pytest.raises(ValueError, match="base_model_precision: fp8-quanto .* mps"):
        check_quantization_supported("fp8-quanto", "mps")
    check_quantization_supported("fp8-quanto", "cpu")
    check_quantization_supported("int4-quanto", "cuda")
    with pytest.raises(ValueError, match="model_type=full"):
        check_quantized_training("int8-quanto", model_type="full")
    with pytest.raises(ValueError, match="init_lora_weights: loftq"):
        check_quantized_training("int4-quanto", init_lora_weights="loftq")
    check_quantized_training("no_change", model_type="full")


@pytest.mark.parametrize("precision", ["int8-torchao", "fp8-torchao"])
def test_torchao_weight_only_shrinks_the_base_and_trains_a_lora(precision):
    """torchao as an alternative backend to quanto: the selected linears are stored in 8 bits, the embedders and
    output layers stay (DEFAULT_EXCLUDE), and a peft LoRA on top gets gradients."""
    from peft import LoraConfig, inject_adapter_in_model

    from simpletuner.models.quantize import count_quantized, quantize_model, weight_bytes
    from tests.helpers import flux_transformer_inputs, tiny_flux_transformer

    model = tiny_flux_transformer().to(torch.bfloat16)
    before = weight_bytes(model)
    quantize_model(model, precision)
    assert count_quantized(model) > 10
    assert type(model.x_embedder.weight).__module__.startswith("torch")  # excluded layers keep their weights
    quanto = quantize_model(tiny_flux_transformer().to(torch.bfloat16), "int8-quanto")
    # 8-bit weights: within 5 points of quanto's int8 on the same model (per-row scales; bf16 embedders weigh more here)
    assert weight_bytes(model) / before <= weight_bytes(quanto) / before + 0.05 < 0.8
    model = inject_adapter_in_model(LoraConfig(r=4, target_modules=["to_q", "to_k"]), model)
    inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in flux_transformer_inputs().items()}
    model(**inputs).sample.float().pow(2).mean().backward()
    grads = [n for n, p in model.named_parameters() if p.grad is not None]
    assert grads and all("lora_" in n for n in grads)


def test_nf4_is_refused_off_cuda_with_the_alternatives():
    from simpletuner.models.quantize import check_quantization_supported, quantize_model, selected_linears
    from tests.helpers import tiny_flux_transformer

    for device in ("cpu", "mps"):
        with pytest.raises(ValueError, match=f"base_model_precision: 'nf4-bnb' quantizes with bitsandbytes on a "
                                             f"CUDA GPU and this run is on {device}; use 'int4-quanto'"):
            check_quantization_supported("nf4-bnb", device)
    check_quantization_supported("nf4-bnb", "cuda")
    model = tiny_flux_transformer()
    with pytest.raises(ValueError, match="nf4-bnb"):
        quantize_model(model, "nf4-bnb")  # a CPU model: refused before bitsandbytes is even imported
    chosen = selected_linears(model, ["proj_out", "x_embedder", "context_embedder", "time_text_embed.*",
                                      "norm_out.*"])
    assert "transformer_blocks.0.attn.to_q" in chosen and "single_transformer_blocks.0.proj_out" in chosen
    assert "proj_out" not in chosen and "x_embedder" not in chosen
