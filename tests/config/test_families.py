"""The family table's own checks: a row that contradicts itself is refused when it is built (the table in this
repository, and a plugin's family registered at run time), naming the family and the field."""

from __future__ import annotations

import dataclasses

import pytest

from simpletuner.config.families import ModelFamily, family_option_errors, get_family, registered, tiny_flavours


def _family(**changes) -> ModelFamily:
    values = dict(name="toy", description="a toy family", adapter="toy_module:ToyAdapter",
                  flavours={"tiny": None, "full": "org/toy"}, default_flavour="full", lora_targets=("all", "attn"),
                  default_lora_target="attn")
    values.update(changes)
    return ModelFamily(**values)


def test_a_consistent_row_builds():
    family = _family(objectives=("epsilon", "v_prediction"), modality="video", text_attention_mask=True,
                     flavour_defaults={"full": {"attention_masked_training": True}}, reference_flavours=("full",))
    assert family.default_objective == "epsilon" and family.default_weights(None) == "org/toy"
    assert family.takes_references("full") and family.takes_references("tiny") and not family.takes_references("x")


@pytest.mark.parametrize("changes, message", [
    (dict(default_flavour="dev"), "toy: default_flavour 'dev' is not one of its flavours"),
    (dict(default_lora_target="mlp"), "toy: default_lora_target 'mlp' is not a preset"),
    (dict(objectives=()), "toy: objectives must be some of flow_matching, epsilon, v_prediction"),
    (dict(objectives=("flow_matching", "x0")), "toy: objectives must be some of flow_matching, epsilon, v_prediction"),
    (dict(modality="audio"), "toy: modality must be 'image' or 'video'"),
    (dict(flavour_defaults={"dev": {"lora_rank": 4}}),
     "toy: flavour_defaults names 'dev', which is not one of its flavours"),
    (dict(flavour_defaults={"full": {"attention_masked_training": True}}),
     "toy: flavour 'full' defaults to attention masking it lacks"),
    (dict(adapter="toy_module.ToyAdapter"), "toy: adapter must be 'module:Class', got 'toy_module.ToyAdapter'"),
    (dict(reference_flavours=("full", "kontext")),
     "toy: reference_flavours names 'kontext', which is not one of its flavours"),
])
def test_a_row_that_contradicts_itself_is_refused_naming_the_field(changes, message):
    with pytest.raises(ValueError) as info:
        _family(**changes)
    assert str(info.value) == message


def test_tiny_flavours_are_the_locally_written_tiny_ones():
    family = _family(flavours={"tiny": None, "tiny-i2v": None, "tiny-hub": "org/tiny", "local": None,
                               "tinyish": None, "full": "org/toy"})
    assert tiny_flavours(family) == ["tiny", "tiny-i2v"]
    assert tiny_flavours(get_family("wan")) == [f for f in get_family("wan").flavours if f.startswith("tiny")]


def test_a_registered_family_is_in_the_table_only_for_the_duration():
    family = _family()
    with registered(family):
        assert get_family("toy") is family
        with pytest.raises(ValueError, match="model family 'toy' is already registered"):
            with registered(dataclasses.replace(family, description="again")):
                pass
        assert get_family("toy") is family  # the refused registration took nothing away
    with pytest.raises(Exception, match="'toy' is not a known model family"):
        get_family("toy")


def test_options_a_family_does_not_declare_are_refused_by_field():
    family = _family(objectives=("flow_matching", "epsilon"), max_text_length=77, num_text_encoders=2)
    fine = dict(lora_target="all", prediction_type="epsilon", guidance_value=None, tokenizer_max_length=77,
                attention_masked_training=False, text_encoder_2_precision="int8-quanto",
                text_encoder_3_precision="no_change")
    assert family_option_errors(family, fine) == []
    errors = family_option_errors(family, dict(
        lora_target="mlp", prediction_type="v_prediction", guidance_value=3.5, tokenizer_max_length=78,
        attention_masked_training=True, text_encoder_3_precision="int8-quanto", text_encoder_4_precision="fp8"))
    assert errors == [
        ("lora_target", "'mlp' is not a toy LoRA preset; one of all, attn"),
        ("prediction_type", "'v_prediction' is not how toy is trained; one of flow_matching, epsilon"),
        ("guidance_value", "toy has no guidance embedding to feed during training; remove it (validation_guidance "
                           "sets inference CFG)"),
        ("tokenizer_max_length", "78 is longer than toy's text encoder takes (77 tokens)"),
        ("attention_masked_training", "toy's transformer cannot mask text tokens in attention; remove it"),
        ("text_encoder_3_precision", "toy has 2 text encoder(s); there is no text encoder 3 to quantize"),
        ("text_encoder_4_precision", "toy has 2 text encoder(s); there is no text encoder 4 to quantize"),
    ]
    able = _family(guidance_embeds=True, text_attention_mask=True)  # max_text_length None: any length
    assert family_option_errors(able, dict(guidance_value=3.5, attention_masked_training=True,
                                           tokenizer_max_length=4096)) == []


def test_an_unknown_family_lists_the_available_ones():
    from simpletuner.config import ConfigError, family_names

    for name, opening in (("nope", "'nope' is not a known model family"),
                          ("sd2x", "'sd2x' is a SimpleTuner family that is planned but not supported yet")):
        with pytest.raises(ConfigError) as info:
            get_family(name)
        assert info.value.errors == [("model_family", f"{opening}; available: {', '.join(family_names())}")]
