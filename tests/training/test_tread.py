"""TREAD token routing on a tiny diffusers Flux transformer (2 double + 4 single blocks = 6 layers)."""

import pytest
import torch

from simpletuner.training.tread import TREADRouter, TreadLayout, apply_tread, resolve_routes
from tests.helpers import tiny_flux_transformer as tiny_flux

NUM_IMG, NUM_TXT = 64, 8


def layout(t):
    return TreadLayout(blocks=list(t.transformer_blocks) + list(t.single_transformer_blocks))


def flux_inputs(seed=1, batch=2):
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(batch, NUM_IMG, 16, generator=g),
        encoder_hidden_states=torch.randn(batch, NUM_TXT, 32, generator=g),
        pooled_projections=torch.randn(batch, 32, generator=g),
        timestep=torch.rand(batch, generator=g),
        img_ids=torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(8.0), torch.arange(8.0), indexing="ij"),
                            -1).reshape(-1, 3),
        txt_ids=torch.zeros(NUM_TXT, 3),
        guidance=torch.full((batch,), 3.5),
    )


def route(ratio=0.5, start=2, end=-2):
    return {"selection_ratio": ratio, "start_layer_idx": start, "end_layer_idx": end}


def capture(block, store, key):
    def hook(module, args, kwargs):
        store.setdefault(key, []).append(dict(
            img=kwargs["hidden_states"] if "hidden_states" in kwargs else args[0],
            txt=kwargs["encoder_hidden_states"] if "encoder_hidden_states" in kwargs else args[1],
            rope=kwargs["image_rotary_emb"] if "image_rotary_emb" in kwargs else args[3],
        ))
    return block.register_forward_pre_hook(hook, with_kwargs=True)


def test_gradients_reach_every_image_token():
    t = tiny_flux()
    handle = apply_tread(t, [route(0.7, 0, -1)], layout(t), generator=torch.Generator().manual_seed(0))
    inputs = flux_inputs()
    x = inputs.pop("hidden_states").requires_grad_(True)
    t(hidden_states=x, **inputs).sample.square().mean().backward()
    assert handle.last_selection[0].shape[1] < NUM_IMG  # most tokens were routed around every block
    assert (x.grad.abs().sum(-1) > 0).all()


@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5, 0.7, 0.99])
def test_kept_count_matches_ratio_and_text_is_never_dropped(ratio):
    t = tiny_flux()
    blocks = layout(t).blocks
    seen = {}
    apply_tread(t, [route(ratio, 2, -2)], layout(t))
    hooks = [capture(b, seen, i) for i, b in enumerate(blocks)]
    t(**flux_inputs())
    kept = max(1, round((1 - ratio) * NUM_IMG))
    for i in range(len(blocks)):
        (call,) = seen[i]
        assert call["img"].shape[1] == (kept if 2 <= i <= 4 else NUM_IMG), i
        assert call["txt"].shape[1] == NUM_TXT
        assert call["rope"][0].shape[0] == NUM_TXT + call["img"].shape[1]
    for h in hooks:
        h.remove()


def test_rotary_is_sliced_to_text_and_kept_positions():
    t = tiny_flux()
    seen = {}
    blocks = layout(t).blocks
    capture(blocks[1], seen, "full")  # registered first: sees the unrouted arguments
    handle = apply_tread(t, [route(0.5, 1, 3)], layout(t))
    capture(blocks[2], seen, "routed")
    t(**flux_inputs())
    idx = handle.last_selection[0][0]
    full_cos, full_sin = seen["full"][0]["rope"]
    cos, sin = seen["routed"][0]["rope"]
    rows = torch.cat([torch.arange(NUM_TXT), idx + NUM_TXT])
    assert torch.equal(cos, full_cos[rows]) and torch.equal(sin, full_sin[rows])


def test_routed_around_tokens_skip_the_blocks_unchanged():
    t = tiny_flux()
    blocks = layout(t).blocks
    entering, leaving = {}, {}
    blocks[1].register_forward_pre_hook(lambda m, a, k: entering.update(img=k["hidden_states"]), with_kwargs=True)
    handle = apply_tread(t, [route(0.5, 1, 4)], layout(t))
    blocks[4].register_forward_hook(lambda m, a, k, out: leaving.update(img=out[1]), with_kwargs=True)
    t(**flux_inputs())
    kept = torch.zeros(NUM_IMG, dtype=torch.bool)
    kept[handle.last_selection[0][0]] = True
    assert leaving["img"].shape == entering["img"].shape
    assert torch.equal(leaving["img"][:, ~kept], entering["img"][:, ~kept])
    assert not torch.allclose(leaving["img"][:, kept], entering["img"][:, kept])


def test_selection_ratio_zero_keeps_everything_and_matches_unrouted():
    t = tiny_flux()
    inputs = flux_inputs()
    reference = t(**inputs).sample
    apply_tread(t, [route(0.0, 0, -1)], layout(t))
    assert torch.allclose(t(**inputs).sample, reference, atol=1e-6)


def test_forced_tokens_are_always_kept_and_the_kept_count_grows():
    t = tiny_flux()
    handle = apply_tread(t, [route(0.7, 1, 4)], layout(t), generator=torch.Generator().manual_seed(3))
    mask = torch.zeros(2, NUM_IMG, dtype=torch.bool)
    mask[0, :10] = True
    mask[1, 50:60] = True  # shared selection: the union (20 tokens) is kept for both samples
    forced = mask.any(0)
    inputs = flux_inputs()
    with handle.force_keep(mask):
        for _ in range(3):
            t(**inputs)
            idx = handle.last_selection[0]
            assert forced[idx[0]].sum() == 20 and (idx[0] == idx[1]).all()
            assert idx.shape[1] == 20 + round(0.3 * (NUM_IMG - 20))
    t(**inputs)
    assert handle.last_selection[0].shape[1] == round(0.3 * NUM_IMG)  # context manager cleared the mask
    handle.set_force_keep(torch.ones(NUM_IMG, dtype=torch.bool))
    t(**inputs)
    assert handle.last_selection[0].shape[1] == NUM_IMG


def test_disabled_or_removed_routes_equal_the_unrouted_model_exactly():
    t = tiny_flux()
    inputs = flux_inputs()
    reference = t(**inputs).sample
    handle = apply_tread(t, [route(0.5, 0, 2), route(0.25, 3, -1)], layout(t))
    assert not torch.equal(t(**inputs).sample, reference)
    handle.enabled = False
    assert torch.equal(t(**inputs).sample, reference)
    handle.enabled = True
    handle.remove()
    assert not handle.hooks and not hasattr(t, "_tread_handle")
    assert torch.equal(t(**inputs).sample, reference)
    apply_tread(t, [route()], layout(t))  # can be applied again after remove()


def test_eval_mode_and_no_grad_run_the_full_sequence():
    t = tiny_flux()
    inputs = flux_inputs()
    t.eval()
    reference = t(**inputs).sample
    handle = apply_tread(t, [route(0.5, 0, -1)], layout(t))
    assert torch.equal(t(**inputs).sample, reference)
    t.train()
    with torch.no_grad():
        assert torch.equal(t(**inputs).sample, reference)
    handle.route_in_eval = True
    t.eval()
    assert not torch.equal(t(**inputs).sample, reference)


def test_negative_indices_resolve_against_total_blocks():
    routes = resolve_routes([route(0.5, 2, -2), {"selection_ratio": 0.1, "start_layer_idx": -1,
                                                 "end_layer_idx": -1}], 6)
    assert [(r.start_layer_idx, r.end_layer_idx) for r in routes] == [(2, 4), (5, 5)]
    assert resolve_routes([route(0.5, -6, 0)], 6)[0].start_layer_idx == 0
    assert resolve_routes([(0.5, -3, -1)], 6) == resolve_routes([route(0.5, 3, 5)], 6)
    t = tiny_flux()
    handle = apply_tread(t, [route(0.5, -4, -3)], layout(t))
    assert sorted(handle.hooks) == ["tread.route0.block2.post", "tread.route0.block2.pre",
                                    "tread.route0.block3.post", "tread.route0.block3.pre"]


@pytest.mark.parametrize(
    "routes, message",
    [
        ([], r"tread_config.routes: TREAD training requires you to configure the routes"),
        (None, r"TREAD training requires you to configure the routes"),
        ([route(1.0)], r"tread_config.routes\[0\].selection_ratio: 1.0 must be a number in \[0, 1\)"),
        ([route(-0.1)], r"routes\[0\].selection_ratio"),
        ([route(0.5, 0, 1), route(0.5, 2, 40)], r"tread_config.routes\[1\].end_layer_idx: 40 is past the last layer \(5\)"),
        ([route(0.5, -7, 2)], r"routes\[0\].start_layer_idx: -7 is before the first layer"),
        ([route(0.5, 4, 2)], r"routes\[0\].end_layer_idx: 2 resolves to layer 2, before start_layer_idx \(layer 4\)"),
        ([route(0.5, 3, -1), route(0.5, 0, 3)], r"routes\[0\].start_layer_idx: layers 3..5 overlap routes\[1\]"),
        ([{"selection_ratio": 0.5, "start_layer_idx": 0}], r"routes\[0\].end_layer_idx: missing"),
        ([route(0.5, 1.5, 3)], r"routes\[0\].start_layer_idx: 1.5 must be an integer"),
    ],
)
def test_route_validation_names_the_field(routes, message):
    t = tiny_flux()
    with pytest.raises(ValueError, match=message):
        apply_tread(t, routes, layout(t))
    assert not t.transformer_blocks[0]._forward_pre_hooks  # validated before any hook was attached


def test_applying_twice_is_refused():
    t = tiny_flux()
    apply_tread(t, [route()], layout(t))
    with pytest.raises(ValueError, match="already applied"):
        apply_tread(t, [route()], layout(t))


def _step(t, inputs, seed):
    handle = apply_tread(t, [route(0.5, 1, -2)], layout(t), generator=torch.Generator().manual_seed(seed))
    draws = []
    select = handle.router.select
    handle.router.select = lambda *a, **k: draws.append(1) or select(*a, **k)
    x = inputs["hidden_states"].clone().requires_grad_(True)
    loss = t(**{**inputs, "hidden_states": x}).sample.square().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in t.named_parameters()}
    handle.remove()
    return loss.detach(), x.grad, grads, handle.last_selection[0], len(draws)


def test_gradient_checkpointing_reuses_the_selection_and_matches():
    inputs = flux_inputs()
    plain = _step(tiny_flux(), inputs, seed=5)
    checkpointed_model = tiny_flux()
    checkpointed_model.enable_gradient_checkpointing()  # blocks are now called with positional args
    checkpointed = _step(checkpointed_model, inputs, seed=5)
    assert plain[4] == checkpointed[4] == 1  # one draw per forward; the recompute reused it
    assert torch.equal(plain[3], checkpointed[3])
    assert torch.allclose(plain[0], checkpointed[0], atol=1e-6)
    assert torch.allclose(plain[1], checkpointed[1], atol=1e-6)
    for name, grad in plain[2].items():
        assert torch.allclose(grad, checkpointed[2][name], atol=1e-5), name


def test_two_forwards_before_backward_keep_their_own_selection():
    t = tiny_flux()
    t.enable_gradient_checkpointing()
    inputs = flux_inputs()
    handle = apply_tread(t, [route(0.5, 1, -2)], layout(t), generator=torch.Generator().manual_seed(1))
    x1 = inputs["hidden_states"].clone().requires_grad_(True)
    loss1 = t(**{**inputs, "hidden_states": x1}).sample.square().mean()
    first = handle.last_selection[0]
    loss2 = t(**inputs).sample.square().mean()  # draws a different subset
    assert not torch.equal(first, handle.last_selection[0])
    (loss1 + 0 * loss2).backward()
    t.disable_gradient_checkpointing()
    handle.router.generator = torch.Generator().manual_seed(1)
    x2 = inputs["hidden_states"].clone().requires_grad_(True)
    t(**{**inputs, "hidden_states": x2}).sample.square().mean().backward()
    assert torch.allclose(x1.grad, x2.grad, atol=1e-6)


def test_router_selection_properties():
    router = TREADRouter(importance_weight=1.0)
    tokens = torch.randn(3, 20, 4)
    tokens[:, 5] *= 100
    idx = router.select(tokens, 0.5, shared=False)
    assert idx.shape == (3, 10)
    assert (idx.diff(dim=-1) > 0).all()  # unique and ascending
    assert (idx == 5).any(-1).all()  # the largest-norm token is kept when selection is purely by importance
    assert TREADRouter.kept_count(64, 0.7) == 19 and TREADRouter.kept_count(64, 0.7, num_forced=64) == 64
    assert TREADRouter.kept_count(4, 0.99) == 1
    full = torch.randn(2, 6, 3)
    merged = TREADRouter.scatter(full, torch.zeros(2, 2, 3), torch.tensor([[1, 4], [1, 4]]))
    assert (merged[:, [1, 4]] == 0).all() and torch.equal(merged[:, [0, 2, 3, 5]], full[:, [0, 2, 3, 5]])
    with pytest.raises(ValueError, match="force_keep: mask shape"):
        router.select(tokens, 0.5, force_keep=torch.ones(7, dtype=torch.bool))


def test_accepts_the_config_layers_routes():
    config = pytest.importorskip("simpletuner.config")
    tread_config = config.TreadConfig.model_validate({"routes": [route(0.5, 2, -2)]})
    t = tiny_flux()
    handle = apply_tread(t, tread_config.routes, layout(t))
    assert [(r.start_layer_idx, r.end_layer_idx) for r in handle.routes] == [(2, 4)]
    resolved = config.resolve_tread_routes(tread_config, 6)
    assert resolve_routes(resolved, 6) == handle.routes


def test_layout_for_blocks_without_text_or_rotary_and_per_sample_selection():
    class Block(torch.nn.Module):  # PixArt/SD3-like shape: tokens in, tokens out, positions already embedded
        def __init__(self):
            super().__init__()
            self.mlp = torch.nn.Linear(8, 8)

        def forward(self, x):
            return x + self.mlp(x)

    model = torch.nn.Sequential(*[Block() for _ in range(4)])
    blocks_seen = []
    model[2].register_forward_pre_hook(lambda m, a: blocks_seen.append(a[0].shape))
    handle = apply_tread(model, [route(0.75, 1, 2)], TreadLayout(
        blocks=list(model), image_arg="x", image_pos=0, text_arg=None, text_pos=None, rotary_arg=None,
        rotary_pos=None, image_output=None, shared_selection=False), generator=torch.Generator().manual_seed(0))
    x = torch.randn(3, 16, 8, requires_grad=True)
    model(x).sum().backward()
    assert blocks_seen == [torch.Size([3, 4, 8])]
    idx = handle.last_selection[0]
    assert idx.shape == (3, 4) and not (idx == idx[0]).all()  # each sample keeps its own subset
    assert (x.grad.abs().sum(-1) > 0).all()


# ---- joint-sequence blocks (AuraFlow's and Chroma's single-stream blocks: text and image in one sequence) ----------
class _Attention(torch.nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        q, k, v = self.qkv(x).chunk(3, -1)
        bias = None if mask is None else mask[:, None, :].bool()
        return self.out(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias))


class _StreamBlock(torch.nn.Module):  # MMDiT-like: (image, text) -> (text, image)
    def __init__(self):
        super().__init__()
        self.attn = _Attention()

    def forward(self, hidden_states, encoder_hidden_states):
        t = encoder_hidden_states.shape[1]
        seq = torch.cat([encoder_hidden_states, hidden_states], 1)
        seq = seq + self.attn(seq)
        return seq[:, :t], seq[:, t:]


class _JointBlock(torch.nn.Module):  # one sequence in, one out, with a mask over it
    def __init__(self):
        super().__init__()
        self.attn = _Attention()

    def forward(self, hidden_states, mask=None):
        return hidden_states + self.attn(hidden_states, mask)


class _JointModel(torch.nn.Module):
    def __init__(self, checkpointing=False):
        super().__init__()
        torch.manual_seed(0)
        self.stream = torch.nn.ModuleList([_StreamBlock() for _ in range(2)])
        self.joint = torch.nn.ModuleList([_JointBlock() for _ in range(2)])
        self.checkpointing = checkpointing

    def _call(self, block, *args):
        if self.checkpointing and torch.is_grad_enabled():  # positional, as diffusers' checkpointing calls blocks
            return torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False)
        return block(*args)

    def forward(self, image, text, mask):
        for block in self.stream:
            text, image = self._call(block, image, text)
        seq = torch.cat([text, image], 1)
        for block in self.joint:
            seq = self._call(block, seq, mask)
        return seq[:, text.shape[1]:]


def _joint_layout(model):
    from simpletuner.models.tread_layout import JointSequence

    return TreadLayout(blocks=list(model.stream) + list(model.joint), rotary_arg=None, rotary_pos=None,
                       shared_selection=False,
                       joint=JointSequence(start=2, image_tokens=lambda m, a, k: a[0].shape[1], mask_arg="mask",
                                           mask_pos=1))


def _joint_inputs(text_len=3, image_len=12):
    g = torch.Generator().manual_seed(2)
    mask = torch.ones(2, text_len + image_len)
    mask[0, text_len - 1] = 0  # a padded text token, as Chroma masks them
    return torch.randn(2, image_len, 8, generator=g), torch.randn(2, text_len, 8, generator=g), mask


@pytest.mark.parametrize("start,end", [(1, 2), (2, 3), (0, 3)])
def test_joint_sequence_blocks_route_only_their_image_part(start, end):
    """Routes across the boundary, inside the joint blocks, or over everything: the joint blocks see the whole text
    and the kept image tokens, with the mask sliced alike; routed-around tokens leave the route unchanged."""
    model = _JointModel()
    image, text, mask = _joint_inputs()
    layout = _joint_layout(model)
    entering = {}
    layout.blocks[start].register_forward_pre_hook(lambda m, a, k: entering.update(seq=a[0]), with_kwargs=True)
    handle = apply_tread(model, [route(0.5, start, end)], layout, generator=torch.Generator().manual_seed(0))
    seen, leaving = {}, {}
    for i, block in enumerate(layout.blocks):  # registered after TREAD's hooks: they see what the block sees
        block.register_forward_pre_hook(lambda m, a, k, i=i: seen.__setitem__(i, a), with_kwargs=True)
    layout.blocks[end].register_forward_hook(lambda m, a, k, out: leaving.update(seq=out), with_kwargs=True)
    x = image.clone().requires_grad_(True)
    model(x, text, mask).square().mean().backward()

    idx = handle.last_selection[0]
    kept, inside = 6, range(start, end + 1)
    assert idx.shape == (2, kept) and not torch.equal(idx[0], idx[1])  # per-sample selection
    for i, args in seen.items():
        tokens = kept if i in inside else 12
        if i < 2:
            assert args[0].shape[1] == tokens and args[1].shape[1] == 3
        else:
            assert args[0].shape[1] == 3 + tokens  # text whole, image routed
            expected = mask if i not in inside else torch.cat([mask[:, :3], mask[:, 3:].gather(1, idx)], 1)
            assert torch.equal(args[1], expected)  # the mask follows the tokens
    image_in = entering["seq"] if start < 2 else entering["seq"][:, 3:]
    image_out = leaving["seq"][1] if end < 2 else leaving["seq"][:, 3:]
    skipped = torch.ones(2, 12, dtype=torch.bool).scatter(1, idx, False)
    assert image_out.shape == image_in.shape
    assert torch.equal(image_out[skipped].detach(), image_in[skipped].detach())
    assert (x.grad.abs().sum(-1) > 0).all()  # routed-around tokens still get a gradient (through the skip)


class _KeywordMaskModel(_JointModel):  # the joint blocks take their mask by keyword, as Chroma calls them
    def forward(self, image, text, mask):
        for block in self.stream:
            text, image = block(image, text)
        seq = torch.cat([text, image], 1)
        for block in self.joint:
            seq = block(seq, mask=mask)
        return seq[:, text.shape[1]:]


def test_a_mask_passed_by_keyword_is_routed_and_a_tuple_output_stays_a_tuple():
    """One route ends in a stream block, whose output is a (text, image) tuple: the merged output is a tuple again.
    One route lies in the joint blocks, which take the mask by keyword: it is sliced with the tokens, as when it is
    passed by position."""
    image, text, mask = _joint_inputs()
    routes = [route(0.5, 0, 1), route(0.5, 2, 3)]
    outputs, seen = [], {}
    for model in (_JointModel(), _KeywordMaskModel()):
        layout = _joint_layout(model)
        apply_tread(model, routes, layout, generator=torch.Generator().manual_seed(4))
        layout.blocks[1].register_forward_hook(lambda m, a, out: seen.update(stream_out=out))
        layout.blocks[3].register_forward_pre_hook(lambda m, a, k: seen.update(joint_in=(a, k)), with_kwargs=True)
        outputs.append(model(image.clone().requires_grad_(True), text, mask))
    assert type(seen["stream_out"]) is tuple and seen["stream_out"][1].shape[1] == 12  # merged back whole
    args, kwargs = seen["joint_in"]  # the keyword model's last joint block
    assert len(args) == 1 and args[0].shape[1] == 3 + 6 and kwargs["mask"].shape == (2, 3 + 6)
    assert torch.allclose(outputs[0], outputs[1], atol=1e-6)  # the same as the positional mask


def test_joint_sequence_routing_with_gradient_checkpointing_matches():
    image, text, mask = _joint_inputs()
    results = []
    for checkpointing in (False, True):
        model = _JointModel(checkpointing)
        handle = apply_tread(model, [route(0.5, 1, 3)], _joint_layout(model),
                             generator=torch.Generator().manual_seed(3))
        x = image.clone().requires_grad_(True)
        loss = model(x, text, mask).square().mean()
        loss.backward()
        results.append((loss.detach(), x.grad, handle.last_selection[0]))
    assert torch.equal(results[0][2], results[1][2])
    assert torch.allclose(results[0][0], results[1][0], atol=1e-6)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-6)


def test_joint_sequence_routing_is_off_outside_training():
    model = _JointModel()
    image, text, mask = _joint_inputs()
    with torch.no_grad():
        plain = model(image, text, mask)
        apply_tread(model, [route(0.5, 1, 3)], _joint_layout(model))
        assert torch.equal(model(image, text, mask), plain)  # no grad: the full sequence, no stale selection


# ---- edges a mutation run would flip (docs/testing.md) -----------------------------------------------------------
class _Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Linear(4, 4)

    def forward(self, x):
        return x + self.mlp(x)


def _plain_layout(blocks, **kw):
    return TreadLayout(blocks=blocks, image_arg="x", image_pos=0, text_arg=None, text_pos=None, rotary_arg=None,
                       rotary_pos=None, image_output=None, **kw)


@pytest.mark.parametrize("routes, message", [
    ([(0.5, 1)], r"routes\[0\]: expected \(selection_ratio, start_layer_idx, end_layer_idx\)"),
    ([(0.5, 1, 2, 3)], r"routes\[0\]: expected"),
    ([object()], r"routes\[0\].selection_ratio: missing"),
    ([{"start_layer_idx": 0, "end_layer_idx": 1}], r"routes\[0\].selection_ratio: missing"),
    ([route(True, 0, 1)], r"selection_ratio: True must be a number in \[0, 1\)"),
    ([route("0.5", 0, 1)], r"selection_ratio: '0.5' must be a number"),
    ([route(0.5, True, 1)], r"start_layer_idx: True must be an integer layer index"),
    ([route(0.5, 0, 6)], r"end_layer_idx: 6 is past the last layer \(5\)"),
    ([route(0.5, 0, -7)], r"end_layer_idx: -7 is before the first layer \(the model has 6\)"),
    ([route(0.5, 0, 2), route(0.5, 2, 3)], r"routes\[1\].start_layer_idx: layers 2..3 overlap routes\[0\] "
                                           r"\(layers 0..2\)"),
])
def test_more_route_errors_name_the_field(routes, message):
    with pytest.raises(ValueError, match=message):
        resolve_routes(routes, 6)


def test_route_edges_that_are_allowed():
    assert resolve_routes([route(0, 5, 5)], 6)[0] == resolve_routes([(0.0, -1, -1)], 6)[0]
    assert resolve_routes([route(0.5, 0, 1), route(0.5, 2, 3)], 6)[1].start_layer_idx == 2  # adjacent, no overlap
    later_first = resolve_routes([route(0.5, 4, 5), route(0.5, 0, 1)], 6)
    assert [(r.start_layer_idx, r.end_layer_idx) for r in later_first] == [(4, 5), (0, 1)]
    assert isinstance(resolve_routes([route(0, 0, 0)], 1)[0].selection_ratio, float)
    with pytest.raises(ValueError, match="tread_config.routes: the model has no blocks to route"):
        resolve_routes([route(0.5, 0, 0)], 0)


def test_kept_count_rounds_half_up_and_keeps_at_least_one():
    assert TREADRouter.kept_count(10, 0.25) == 8  # 7.5 -> 8
    assert TREADRouter.kept_count(10, 0.35) == 7  # 6.5 -> 7
    assert TREADRouter.kept_count(10, 0.0) == 10
    assert TREADRouter.kept_count(10, 0.5, num_forced=4) == 7  # 4 + round(0.5 * 6)
    assert TREADRouter.kept_count(1, 0.99) == 1 and TREADRouter.kept_count(5, 0.999) == 1
    for weight in (-0.01, 1.01):
        with pytest.raises(ValueError, match=f"importance_weight: {weight} must be in \\[0, 1\\]"):
            TREADRouter(importance_weight=weight)
    assert TREADRouter(importance_weight=0).importance_weight == 0 and TREADRouter(importance_weight=1)


def test_importance_routing_keeps_the_largest_tokens_in_a_shared_subset():
    tokens = torch.ones(2, 8, 4)
    tokens[0, 6] *= 50  # large in one sample only: the shared subset goes by the batch mean
    tokens[1, 2] *= 40
    idx = TREADRouter(importance_weight=1.0).select(tokens, 0.75)
    assert idx.tolist() == [[2, 6], [2, 6]]
    forced = torch.zeros(8, dtype=torch.bool)
    forced[0] = True
    idx = TREADRouter(importance_weight=1.0).select(tokens, 0.75, force_keep=forced)
    assert idx.tolist() == [[0, 2, 6]] * 2  # 1 forced + round(0.25 * 7)
    per_sample = torch.zeros(2, 8, dtype=torch.bool)
    per_sample[1, 3] = True
    assert TREADRouter(importance_weight=1.0).select(tokens, 0.75, force_keep=per_sample).tolist() == [[2, 3, 6]] * 2
    own = TREADRouter(importance_weight=1.0).select(tokens, 0.75, force_keep=per_sample, shared=False)
    assert {2, 3} <= set(own[1].tolist()) and 6 in own[0].tolist() and own.shape == (2, 3)  # each its own subset
    for bad in (torch.ones(8), [True] * 8, torch.ones(3, 8, dtype=torch.bool), torch.ones(2, 2, 8, dtype=torch.bool)):
        with pytest.raises(ValueError, match="force_keep"):
            TREADRouter().select(tokens, 0.5, force_keep=bad)


def test_apply_tread_checks_the_layout_before_attaching_anything():
    model = torch.nn.Sequential(_Plain(), _Plain(), _Plain())
    stranger = _Plain()
    for blocks, message in (([], "a non-empty list of nn.Module blocks"),
                            ([model[0], "x"], "a non-empty list of nn.Module blocks"),
                            ([model[0], model[0]], "a block is listed twice"),
                            ([model[0], stranger], "every block must be a submodule of the model")):
        with pytest.raises(ValueError, match=message):
            apply_tread(model, [route(0.5, 0, 0)], _plain_layout(blocks))
        assert not any(b._forward_pre_hooks for b in model) and not hasattr(model, "_tread_handle")


def test_force_keep_is_a_bool_mask_restored_after_the_block_and_removal_allows_reapplying():
    model = torch.nn.Sequential(_Plain(), _Plain())
    handle = apply_tread(model, [route(0.5, 0, 1)], _plain_layout(list(model)))
    for bad in (torch.ones(4), [True]):
        with pytest.raises(ValueError, match="force_keep: expected a bool tensor"):
            handle.set_force_keep(bad)
    outer = torch.ones(8, dtype=torch.bool)
    handle.set_force_keep(outer)
    with handle.force_keep(None):
        assert handle._force_keep is None
        with handle.force_keep(torch.zeros(8, dtype=torch.bool)):
            pass
        assert handle._force_keep is None
    assert handle._force_keep is outer
    x = torch.randn(2, 8, 4, requires_grad=True)
    model(x)
    assert handle.last_selection[0].shape == (2, 8)  # every token forced
    handle.set_force_keep(None)
    handle.remove()
    assert handle.hooks == {} and not hasattr(model, "_tread_handle")
    assert not any(b._forward_pre_hooks or b._forward_hooks for b in model)
    again = apply_tread(model, [route(0.5, 0, 1)], _plain_layout(list(model)))
    assert model._tread_handle is again
    handle.remove()  # an old handle's remove leaves the new one attached
    assert model._tread_handle is again


def test_routing_follows_enabled_route_in_eval_and_grad_mode():
    model = torch.nn.Sequential(_Plain(), _Plain())
    seen = []
    model[1].register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1]))  # inside the route
    handle = apply_tread(model, [route(0.5, 0, 1)], _plain_layout(list(model)))
    x = torch.randn(1, 8, 4)
    model.train()
    model(x)
    handle.enabled = False
    model(x)
    handle.enabled = True
    with torch.no_grad():
        model(x)
    model.eval()
    model(x)
    handle.route_in_eval = True
    model(x)
    with torch.no_grad():
        model(x)
    handle.enabled = False
    model(x)
    assert seen == [4, 8, 8, 8, 4, 4, 8]


# ---- what the mutation run of 2026-11-28 found unguarded (docs/testing.md) -----------------------------------
def test_arguments_are_read_and_replaced_by_name_or_position():
    from simpletuner.training.tread import _get, _put

    assert _get((1, 2), {"x": 3}, "x", 0) == 3  # a keyword wins over the position
    assert _get((1, 2), {}, "x", 1) == 2 and _get((1,), {}, "x", 1) is None and _get((1,), {}, None, None) is None
    kwargs = {"x": 3}
    assert _put((1, 2), kwargs, "x", 0, 9) == ((1, 2), {"x": 9}) and kwargs == {"x": 3}  # never in place
    assert _put((1, 2), {}, "x", 1, 9) == ((1, 9), {})
    assert _put((1,), {}, "x", 1, 9) == ((1,), {"x": 9})  # not given at all: passed by name
    assert _put((1,), {"y": 0}, None, 1, 9) == ((1,), {"y": 0})  # nowhere to put it
    assert _put((1, 2), {}, None, 0, 9) == ((9, 2), {})


def test_the_score_mixes_normalised_rank_and_the_routers_noise():
    """score = w * rank / (N - 1) + (1 - w) * u, u drawn from the router's generator; the top scores are kept."""
    for num, kept in ((8, 3), (2, 1)):
        tokens = torch.arange(num, 0, -1).float().reshape(1, num, 1).expand(1, num, 3)  # token 0 the largest
        ranks = torch.arange(num - 1, -1, -1).float().unsqueeze(0) / (num - 1)  # the largest has rank 1
        for w in (0.3, 0.5, 0.8):
            for seed in range(12):
                router = TREADRouter(importance_weight=w, generator=torch.Generator().manual_seed(seed))
                noise = torch.rand(1, num, generator=torch.Generator().manual_seed(seed))
                expected = (w * ranks + (1 - w) * noise).topk(kept, dim=-1).indices.sort(-1).values
                assert router.select(tokens, 1 - kept / num).tolist() == expected.tolist(), (num, w, seed)


def test_per_sample_selections_keep_as_many_as_the_most_forced_sample_needs():
    tokens = torch.ones(2, 16, 4)
    forced = torch.zeros(2, 16, dtype=torch.bool)
    forced[0, :3] = True  # three in one sample, two in the other: five in all
    forced[1, 5:7] = True
    idx = TREADRouter().select(tokens, 0.75, force_keep=forced, shared=False)
    assert idx.shape == (2, TREADRouter.kept_count(16, 0.75, 3)) == (2, 6)
    assert {0, 1, 2} <= set(idx[0].tolist()) and {5, 6} <= set(idx[1].tolist())


def test_routed_tokens_scatter_back_in_the_full_sequences_dtype():
    full = torch.zeros(1, 4, 2)
    out = TREADRouter.scatter(full, torch.ones(1, 2, 2, dtype=torch.bfloat16), torch.tensor([[1, 3]]))
    assert out.dtype == torch.float32 and out[0, :, 0].tolist() == [0.0, 1.0, 0.0, 1.0]


def test_layout_and_mask_errors_are_whole_sentences():
    import re

    model = torch.nn.Sequential(_Plain(), _Plain(), _Plain())
    for blocks, message in (([], "TreadLayout.blocks: expected a non-empty list of nn.Module blocks"),
                            ([model[0], model[0]], "TreadLayout.blocks: a block is listed twice"),
                            ([model[0], _Plain()], "TreadLayout.blocks: every block must be a submodule of the model")):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            apply_tread(model, [route(0.5, 0, 0)], _plain_layout(blocks))
    handle = apply_tread(model, [route(0.5, 0, 1)], _plain_layout(list(model)), importance_weight=0.3)
    assert handle.router.importance_weight == 0.3
    with pytest.raises(ValueError, match="^" + re.escape(
            "tread_config: TREAD is already applied to this model; remove() the first handle") + "$"):
        apply_tread(model, [route(0.5, 0, 1)], _plain_layout(list(model)))
    mask_message = "^force_keep: expected a bool tensor with one entry per image token$"
    with pytest.raises(ValueError, match=mask_message):
        handle.set_force_keep(torch.ones(4))
    with pytest.raises(ValueError, match=mask_message):
        TREADRouter().select(torch.ones(1, 8, 4), 0.5, force_keep=torch.ones(8))
    handle.remove()
    assert not hasattr(model, "_tread_handle")
    handle.remove()  # twice: nothing left to remove, no error


@pytest.mark.parametrize("start, ok", [(-1, False), (0, True), (4, True), (5, False)])
def test_the_joint_sequence_may_start_at_any_block_or_after_the_last(start, ok):
    from simpletuner.models.tread_layout import JointSequence

    model = torch.nn.Sequential(*[_Plain() for _ in range(4)])
    layout = _plain_layout(list(model), joint=JointSequence(start=start, image_tokens=lambda m, a, k: 8))
    if ok:
        apply_tread(model, [route(0.5, 0, 0)], layout).remove()
    else:
        with pytest.raises(ValueError, match=f"^TreadLayout.joint.start: {start} is outside the 4 blocks$"):
            apply_tread(model, [route(0.5, 0, 0)], layout)


def test_the_joint_image_token_count_reads_the_models_own_call():
    from simpletuner.models.tread_layout import JointSequence

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([_Plain(), _Plain()])

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    model, seen = Model(), []
    layout = _plain_layout(list(model.blocks), joint=JointSequence(
        start=2, image_tokens=lambda m, a, k: seen.append((m, a, k)) or k["x"].shape[1]))
    handle = apply_tread(model, [route(0.5, 0, 1)], layout)
    x = torch.randn(1, 8, 4)
    model(x=x)
    (m, a, k), = seen
    assert m is model and a == () and k["x"] is x and handle._image_tokens == 8
