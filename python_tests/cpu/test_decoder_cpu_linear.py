"""SpeculativeDecoder with ``cpu_linear``: the skinny fp32 linear layers on the CPU.

Checks that the choice resolves as documented, that greedy output still equals
``target.generate`` with either choice, that the kernel really runs during ``generate`` (its
call counter moves) and that the models' layers are restored afterwards.
"""

from __future__ import annotations

import copy

import pytest
import torch

from specdec_kernels.cpu import CpuAccelerator
from specdec_kernels.cpu import skinny_linear as cpu_linear_mod
from specdec_kernels.models.tiny import perturbed, tiny_llama
from specdec_kernels.ops.extension import HAS_EXT
from specdec_kernels.decoding import loop
from specdec_kernels.decoding.decoder import SpeculativeDecoder

pytestmark = pytest.mark.skipif(
    not HAS_EXT, reason="needs the C++ extension: pip install --no-build-isolation -e ."
)

PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]


def _pair():
    target = tiny_llama(32, 32, 2, 0.2, seed=0)
    return perturbed(target, 0.01, seed=1), target


@pytest.fixture(scope="module")
def pair():
    return _pair()


@pytest.fixture(scope="module")
def refs(pair):
    _, target = pair
    with torch.inference_mode():
        return [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=16,
                                pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]


def test_auto_resolves_by_dtype_and_device(pair):
    draft, target = pair
    assert SpeculativeDecoder(draft, target).cpu_linear == "skinny"
    assert SpeculativeDecoder(draft, target, cpu_linear="torch").cpu_linear == "torch"
    d16, t16 = copy.deepcopy(draft).bfloat16(), copy.deepcopy(target).bfloat16()
    assert SpeculativeDecoder(d16, t16).cpu_linear == "torch"
    with pytest.raises(ValueError, match="cpu_linear must be 'auto', 'skinny' or 'torch', got 'mkl'"):
        SpeculativeDecoder(draft, target, cpu_linear="mkl")


@pytest.mark.parametrize("mode", ["skinny", "torch"])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_equals_generate_and_layers_are_restored(pair, refs, mode, k, monkeypatch):
    draft, target = pair
    handles = []
    real = cpu_linear_mod.use_skinny_linear

    def spy(model, *a, **kw):
        handles.append(real(model, *a, **kw))
        return handles[-1]

    monkeypatch.setattr(cpu_linear_mod, "use_skinny_linear", spy)
    dec = SpeculativeDecoder(draft, target, cpu_linear=mode)
    res = dec.generate(PROMPTS, max_new_tokens=16, num_draft_tokens=k)
    assert res.token_ids == refs
    alone = dec.generate_target_only(PROMPTS[:2], max_new_tokens=16)
    assert alone.token_ids == refs[:2]
    if mode == "skinny":
        assert len(handles) == 4  # target and draft, in each of the two calls
        assert all(h.calls > 0 for h in handles[:2])  # verify and draft forwards went through it
        assert handles[2].calls > 0  # the target-only baseline too
    else:
        assert handles == []
    for m in (draft, target):
        assert all("forward" not in mod.__dict__ for mod in m.modules() if isinstance(mod, torch.nn.Linear))


def test_layers_restored_after_an_error(pair, monkeypatch):
    draft, target = pair
    dec = SpeculativeDecoder(draft, target, cpu_linear="skinny")

    def boom(parts, st):
        assert any("forward" in mod.__dict__ for mod in target.modules())  # patched inside
        raise RuntimeError("boom")

    monkeypatch.setattr(loop, "step", boom)
    with pytest.raises(RuntimeError, match="boom"):
        dec.generate([[1, 2]], max_new_tokens=4, num_draft_tokens=2)
    for m in (draft, target):
        assert all("forward" not in mod.__dict__ for mod in m.modules())


@pytest.mark.parametrize("choice", ["torch", "skinny"])
def test_cli_passes_cpu_linear(choice):
    from specdec_kernels.cli import _make_decoder, build_parser

    parser = build_parser()
    args = parser.parse_args(["generate", "Hi", "--tiny-random", "--cpu-linear", choice])
    assert _make_decoder(args, parser).cpu_linear == choice


def test_weights_written_through_data_are_seen():
    """The fp16 copies of fp16-exact weights (kept on the layers between calls) follow the
    weights: new storage (``p.data = ...``) is noticed by the same decoder; writes through
    ``.data`` in place, which torch's version counter does not see, by a new decoder or after
    ``cpu.skinny_linear.forget_weight_copies`` (seen stale before)."""
    def fp16_exact(seed):
        _, t = _pair()
        with torch.no_grad():
            for p in t.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)).mul(0.2).half().float())
        return t

    def refs(model):
        with torch.inference_mode():
            return [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=8,
                                   pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS[:3]]

    target = fp16_exact(0)
    draft = copy.deepcopy(target)
    dec = SpeculativeDecoder(draft, target)
    assert dec.cpu_linear == "skinny"
    assert dec.generate(PROMPTS[:3], max_new_tokens=8).token_ids == refs(target)
    assert any("_specdec_fp16" in m.__dict__ for m in target.modules())  # copies kept on the layers
    for p, q in zip(target.parameters(), fp16_exact(1).parameters()):
        p.data = q.data.clone()  # new storage, same object, same version
    assert dec.generate(PROMPTS[:3], max_new_tokens=8).token_ids == refs(target)
    for p, q in zip(target.parameters(), fp16_exact(2).parameters()):
        p.data.copy_(q.data)  # in place, unseen by the version counter
    want = refs(target)
    assert SpeculativeDecoder(draft, target).generate(PROMPTS[:3], max_new_tokens=8).token_ids == want
    for p, q in zip(target.parameters(), fp16_exact(3).parameters()):
        p.data.copy_(q.data)
    assert cpu_linear_mod.forget_weight_copies(target) > 0
    with pytest.raises(TypeError, match=r"^forget_weight_copies: model must be a torch.nn.Module, got list$"):
        cpu_linear_mod.forget_weight_copies([target])
    assert dec.generate(PROMPTS[:3], max_new_tokens=8).token_ids == refs(target)


def test_weight_copies_are_made_once_per_model():
    """A second decoder over the same models keeps the fp16 copies the first one made (they still
    equal their weights: checked, not made again); a copy whose weight was written through
    ``.data`` is dropped and made again; a weight fp16 does not hold gets no copy."""
    _, t = _pair()
    with torch.no_grad():
        for i, p in enumerate(t.parameters()):
            if i % 2 == 0:
                p.copy_(p.half().float())  # every other weight fp16-exact
    draft = copy.deepcopy(t)
    dec = SpeculativeDecoder(draft, t)
    dec.generate(PROMPTS[:2], max_new_tokens=4)
    linears = [m for m in t.modules() if type(m) is torch.nn.Linear]
    cached = {id(m): m.__dict__.get("_specdec_fp16") for m in linears}
    exact = [m for m in linears if cached[id(m)] is not None and cached[id(m)][3] is not None]
    inexact = [m for m in linears if cached[id(m)] is not None and cached[id(m)][3] is None]
    assert exact and inexact
    m0 = exact[0]
    m0.weight.data.mul_(0.5)  # in place through .data: no version bump
    SpeculativeDecoder(draft, t).generate(PROMPTS[:2], max_new_tokens=4)
    for m in linears:
        now = m.__dict__.get("_specdec_fp16")
        if m is m0:
            assert now is not cached[id(m)] and torch.equal(now[3].float(), m.weight)  # made again
        else:
            assert now is cached[id(m)]  # kept


@pytest.mark.slow
def test_a_weight_changed_in_place_between_calls_is_caught():
    """The same decoder, one fp16-exact weight changed in place between two calls, through the
    parameter (its version moves) and then through ``.data`` (it does not; a new decoder's
    revalidation reads the copies): each change gives the tokens of the target as changed, the
    copy is made again from the new values, and the other layers keep theirs."""
    _, t = _pair()
    with torch.no_grad():
        for p in t.parameters():
            p.copy_(p.half().float())
    draft = copy.deepcopy(t)

    def refs():
        with torch.inference_mode():
            return [t.generate(torch.tensor([p]), do_sample=False, max_new_tokens=8,
                               pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS[:3]]

    dec = SpeculativeDecoder(draft, t)
    before = refs()
    assert dec.generate(PROMPTS[:3], max_new_tokens=8).token_ids == before
    head = t.lm_head if t.lm_head.weight is not t.model.embed_tokens.weight else t.model.layers[0].mlp.down_proj
    copies = {id(m): m.__dict__["_specdec_fp16"] for m in t.modules() if "_specdec_fp16" in m.__dict__}
    assert copies[id(head)][3] is not None
    with torch.no_grad():
        head.weight.neg_()  # in place, exact in fp16 still: only a new copy gives these tokens
    after = refs()
    assert after != before  # the change moves the target's tokens, so a stale copy would be seen
    assert dec.generate(PROMPTS[:3], max_new_tokens=8).token_ids == after
    assert torch.equal(head.__dict__["_specdec_fp16"][3].float(), head.weight)
    with torch.no_grad():
        head.weight.data.neg_()  # through .data: no version bump
    assert refs() == before
    dec = SpeculativeDecoder(draft, t)
    assert dec.generate(PROMPTS[:3], max_new_tokens=8).token_ids == before
    assert torch.equal(head.__dict__["_specdec_fp16"][3].float(), head.weight)
    for m in t.modules():
        if m is not head and id(m) in copies:
            assert m.__dict__["_specdec_fp16"] is copies[id(m)]  # kept


class _Spy(CpuAccelerator):
    """A CpuAccelerator that records what the decoder asks of it."""

    def __init__(self, *args):
        super().__init__(*args)
        self.calls = []

    def lean_step(self, model, current=None):
        self.calls.append("lean_step")
        return super().lean_step(model, current)

    def linear_layers(self, mode, models, int8_models=()):
        self.calls.append(("linear_layers", mode))
        return super().linear_layers(mode, models, int8_models)


@pytest.mark.parametrize("linear,lean", [("torch", False), ("skinny", True)])
def test_a_handed_accelerator_is_the_one_used(pair, refs, linear, lean):
    """``accelerator=`` instead of ``cpu_linear``/``lean_forward``: the decoder takes its mode and
    lean steps from it and runs every call inside its ``linear_layers``; the tokens are the same."""
    draft, target = pair
    spy = _Spy(linear, lean)
    dec = SpeculativeDecoder(draft=draft, target=target, accelerator=spy)
    assert dec.accelerator is spy and dec.cpu_linear == linear and dec.lean_forward is lean
    if not lean:
        assert dec.lean_status() == {"target": "lean_forward=False", "draft": "lean_forward=False"}
    spy.calls.clear()
    res = dec.generate(PROMPTS, max_new_tokens=16, num_draft_tokens=3)
    assert res.token_ids == [r[:16] for r in refs]
    assert ("linear_layers", linear) in spy.calls and "lean_step" in spy.calls


def test_accelerator_arguments_are_checked(pair):
    draft, target = pair
    with pytest.raises(ValueError, match="pass either accelerator= or cpu_linear/lean_forward/weight_cache, got "
                                         "accelerator=CpuAccelerator with cpu_linear='torch', lean_forward=True, "
                                         "weight_cache=None"):
        SpeculativeDecoder(draft=draft, target=target, accelerator=CpuAccelerator(), cpu_linear="torch")
    with pytest.raises(ValueError, match="cpu_linear must be 'auto', 'skinny' or 'torch', got 'fast'"):
        CpuAccelerator("fast")
    with pytest.raises(TypeError, match="lean_forward must be a bool, got int"):
        CpuAccelerator("auto", 1)
