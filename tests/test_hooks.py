"""ditbook.hooks: named per-instance wraps that nest and come off exactly."""

import pytest
import torch

from ditbook.hooks import WrapError, is_wrapped, remove_all, remove_wrap, wrap_method, wrap_names


class Doubler(torch.nn.Module):
    def forward(self, x):
        return 2 * x


def add(k):
    return lambda original, x: original(x) + k


def test_two_wraps_nest_and_removing_both_restores_the_class_forward():
    m = Doubler()
    x = torch.ones(2)
    h1 = wrap_method(m, "plus1", add(1))
    h2 = wrap_method(m, "times", lambda original, x: original(x) * 10)
    assert wrap_names(m) == ["plus1", "times"]
    assert torch.equal(m(x), (2 * x + 1) * 10)  # newest outermost
    h1.remove()  # the inner one first: the outer stays
    assert torch.equal(m(x), 2 * x * 10)
    h2.remove()
    assert "forward" not in m.__dict__ and "_ditbook_wraps" not in m.__dict__
    assert m.forward.__func__ is Doubler.forward
    assert torch.equal(m(x), 2 * x)
    h2.remove()  # idempotent


def test_an_instance_attribute_set_before_is_the_same_object_again():
    m = Doubler()
    own = lambda x: 3 * x  # noqa: E731
    m.forward = own
    with wrap_method(m, "a", add(1)), wrap_method(m, "b", add(2)):
        assert torch.equal(m(torch.ones(1)), torch.full((1,), 6.0))
    assert m.__dict__["forward"] is own


def test_other_methods_and_plain_objects():
    class Pipe:
        def encode_prompt(self, p):
            return p.upper()

    pipe = Pipe()
    seen = []
    h = wrap_method(pipe, "time", lambda original, p: seen.append(p) or original(p), attr="encode_prompt")
    assert pipe.encode_prompt("a") == "A" and seen == ["a"]
    assert is_wrapped(pipe, "time", "encode_prompt") and not is_wrapped(pipe, "time")
    remove_wrap(pipe, "time", "encode_prompt")
    assert "encode_prompt" not in pipe.__dict__
    h.remove()


def test_errors_are_named():
    m = Doubler()
    wrap_method(m, "a", add(1))
    with pytest.raises(WrapError, match="already wrapped as 'a'"):
        wrap_method(m, "a", add(1))
    with pytest.raises(WrapError, match="no wrap named 'zz'"):
        remove_wrap(m, "zz")
    # someone else replaced forward on top of ours: removing ours would drop theirs
    theirs = m.forward
    m.forward = lambda x: theirs(x) - 100
    with pytest.raises(WrapError, match="outside ditbook.hooks"):
        remove_wrap(m, "a")
    with pytest.raises(WrapError, match="no method 'nothing'"):
        wrap_method(m, "b", add(1), attr="nothing")


def test_remove_all_undoes_every_attribute():
    m = Doubler()
    wrap_method(m, "a", add(1))
    wrap_method(m, "b", add(2))
    wrap_method(m, "c", lambda original: original(), attr="extra_repr")
    remove_all(m)
    assert "forward" not in m.__dict__ and "extra_repr" not in m.__dict__
    assert torch.equal(m(torch.ones(1)), torch.full((1,), 2.0))


# -- the core's extensions: identity check, signature, all-or-nothing groups ---------------------

def test_a_diffusers_hook_on_top_of_ours_is_seen_even_though_it_copies_our_marker():
    """diffusers' HookRegistry wraps with ``functools.update_wrapper``, which copies the wrapped
    function's ``__dict__`` — a marker attribute check would take its forward for ours and drop
    the hook silently; the registry compares identity instead."""
    from diffusers.hooks import HookRegistry, ModelHook

    class Minus(ModelHook):
        def post_forward(self, module, output):
            return output - 100

    m = Doubler()
    x = torch.ones(1)
    wrap_method(m, "ours", add(1))
    registry = HookRegistry.check_if_exists_or_initialize(m)
    registry.register_hook(Minus(), "theirs")
    assert hasattr(m.__dict__["forward"], "__ditbook_wraps__")  # the copied marker
    assert torch.equal(m(x), 2 * x + 1 - 100)
    with pytest.raises(WrapError, match="outside ditbook.hooks"):
        remove_wrap(m, "ours")
    with pytest.raises(WrapError, match="outside ditbook.hooks"):
        wrap_method(m, "more", add(2))
    assert torch.equal(m(x), 2 * x + 1 - 100)  # theirs still in place
    registry.remove_hook("theirs")
    remove_wrap(m, "ours")
    assert "forward" not in m.__dict__ and torch.equal(m(x), 2 * x)


def test_the_wrapped_attribute_keeps_the_method_signature():
    import inspect

    class Sig(torch.nn.Module):
        def forward(self, hidden_states, *, timestep=None):
            return hidden_states

    m = Sig()
    wrap_method(m, "a", lambda original, *a, **kw: original(*a, **kw))
    assert list(inspect.signature(m.forward).parameters) == ["hidden_states", "timestep"]


def test_a_group_applies_all_or_nothing():
    from ditbook.hooks import WrapGroup

    mods = [Doubler() for _ in range(3)]
    wrap_method(mods[2], "g", add(5))  # the third is taken: the group's wrap fails there
    hooks_before = len(mods[0]._forward_pre_hooks)
    group = WrapGroup("g")
    with pytest.raises(WrapError, match="already wrapped as 'g'"):
        with group.applying():
            group.track(mods[0].register_forward_pre_hook(lambda mod, args: None))
            for m in mods:
                group.wrap(m, add(1))
    assert len(group) == 0 and len(mods[0]._forward_pre_hooks) == hooks_before
    for m in mods[:2]:
        assert "forward" not in m.__dict__ and "_ditbook_wraps" not in m.__dict__
    assert wrap_names(mods[2]) == ["g"]  # the one it did not put on is untouched


def test_a_group_removes_everything_even_when_one_removal_fails():
    from ditbook.hooks import WrapGroup

    a, b = Doubler(), Doubler()
    group = WrapGroup("g")
    group.wrap(a, add(1))
    group.wrap(b, add(1))
    theirs = a.forward
    a.forward = lambda x: theirs(x)  # someone else on top of ours on a
    with pytest.raises(WrapError, match="outside ditbook.hooks"):
        group.remove()
    assert "forward" not in b.__dict__  # b was still undone


# -- every run-time swap of the library goes through the core and comes off exactly --------------

class Attn(torch.nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.q = torch.nn.Linear(dim, dim)

    def forward(self, x):
        return torch.nn.functional.scaled_dot_product_attention(self.q(x), x, x)


class Block(torch.nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.attn = Attn(dim)
        self.mlp = torch.nn.Linear(dim, dim)

    def forward(self, hidden_states, encoder_hidden_states):
        return hidden_states + self.mlp(self.attn(hidden_states)), encoder_hidden_states + 1


class Tiny(torch.nn.Module):
    def __init__(self, depth=3):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([Block() for _ in range(depth)])

    def forward(self, hidden_states, encoder_hidden_states, timestep=None):
        for b in self.blocks:
            hidden_states, encoder_hidden_states = b(hidden_states, encoder_hidden_states)
        return hidden_states


def _inputs(batch=1):
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, 1, 4, 8, generator=g), torch.randn(batch, 1, 4, 8, generator=g)


def _pristine(*mods):
    return all("forward" not in m.__dict__ and "_ditbook_wraps" not in m.__dict__ for m in mods)


def test_eval_counter_counts_then_comes_off_exactly():
    from ditbook.adapter.counting import EvalCounter

    t = Tiny()
    x, c = _inputs()
    ref = t(x, c)
    counter = EvalCounter(t, list(t.blocks))
    assert not _pristine(*t.blocks) and len(counter.attentions) == 3
    assert torch.equal(t(x, c), ref)
    assert counter.snapshot()["block_evals"] == 3 and counter.snapshot()["attention_evals"] == 3
    counter.remove()
    assert _pristine(t, *t.blocks, *counter.attentions) and not t._forward_pre_hooks
    assert torch.equal(t(x, c), ref) and counter.snapshot()["block_evals"] == 3  # no longer counting


def test_eval_counter_failing_half_way_leaves_the_model_as_it_was():
    from ditbook.adapter.counting import EvalCounter

    t = Tiny()
    wrap_method(t.blocks[2].attn, "ditbook.count-evals", add(0))  # the last wrap it tries is taken
    with pytest.raises(WrapError, match="already wrapped"):
        EvalCounter(t, list(t.blocks))
    assert _pristine(t, *t.blocks, t.blocks[0].attn, t.blocks[1].attn) and not t._forward_pre_hooks
    assert wrap_names(t.blocks[2].attn) == ["ditbook.count-evals"]


class _Adapter:
    """What the TeaCache-style skipper reads of a cache adapter."""

    def __init__(self, transformer):
        from types import SimpleNamespace

        self.pipe = SimpleNamespace(transformer=transformer)
        self.info = SimpleNamespace(has_separate_cfg=False)
        self.patches = 0

    def block_lists(self):
        return [("blocks", self.pipe.transformer.blocks, "Pattern_0")]

    def patch(self):
        self.patches += 1

    def unpatch(self):
        self.patches -= 1


def test_teacache_fitted_applies_and_undoes_exactly():
    from ditbook.accel.teacache_fitted import TeaCacheFitted, TeaCacheSettings

    t = Tiny()
    x, c = _inputs()
    ref = t(x, c, timestep=torch.tensor([1.0]))
    adapter = _Adapter(t)
    undo = TeaCacheFitted.enable(None, adapter, TeaCacheSettings(threshold=0.0))  # never skips
    assert wrap_names(t.blocks[0]) == ["ditbook.teacache-fitted"] and adapter.patches == 1
    assert torch.equal(t(x, c, timestep=torch.tensor([1.0])), ref)
    undo()
    assert _pristine(t, *t.blocks) and not t._forward_pre_hooks and adapter.patches == 0
    assert torch.equal(t(x, c, timestep=torch.tensor([1.0])), ref)


def test_teacache_fitted_failing_half_way_leaves_the_model_as_it_was():
    from ditbook.accel.teacache_fitted import TeaCacheFitted, TeaCacheSettings

    t = Tiny()
    adapter = _Adapter(t)
    wrap_method(t.blocks[1], "ditbook.teacache-fitted", add(0))
    with pytest.raises(WrapError, match="already wrapped"):
        TeaCacheFitted.enable(None, adapter, TeaCacheSettings())
    assert _pristine(t, t.blocks[0], t.blocks[2]) and not t._forward_pre_hooks and adapter.patches == 0


def _fake_cfg_group(monkeypatch):
    """A CFG group of two whose partner computed the same as this rank (identical branches)."""
    import torch.distributed as dist

    from ditbook.accel import cfg as cfg_mod

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(cfg_mod, "_gather", lambda local, group, size: [local.clone(), local.clone()])


def test_cfg_parallel_wraps_and_undoes_exactly(monkeypatch):
    from ditbook.accel.cfg import apply_cfg_parallel

    _fake_cfg_group(monkeypatch)
    t = Tiny()
    x, c = _inputs()
    xx, cc = torch.cat([x, x]), torch.cat([c, c])  # cond == uncond: the gathered halves equal the whole
    ref = t(xx, cc)
    stats = apply_cfg_parallel(t, "batched")
    assert wrap_names(t) == ["ditbook.cfg-parallel"]
    torch.testing.assert_close(t(xx, cc), ref)
    assert stats.exchanges == 1 and "handle" not in stats.to_dict()
    stats.remove()
    assert _pristine(t) and torch.equal(t(xx, cc), ref)


def test_step_graphs_inside_cfg_parallel_come_off_in_either_order(monkeypatch):
    from ditbook.accel.cfg import apply_cfg_parallel
    from ditbook.accel.graphs import StepGraphs

    _fake_cfg_group(monkeypatch)
    for graphs_first in (True, False):
        t = Tiny()
        x, c = _inputs(2)
        ref = t(x, c)
        graphs = StepGraphs(t, warmup=0, capturer=_Replay())
        stats = apply_cfg_parallel(t, "separate")
        assert wrap_names(t) == ["ditbook.step-graphs", "ditbook.cfg-parallel"]  # graphs inside
        (graphs.remove() if graphs_first else stats.remove())
        (stats.remove() if graphs_first else graphs.remove())
        assert _pristine(t) and torch.equal(t(x, c), ref)


class _Replay:
    def capture(self, fn):
        out = fn()
        return (lambda: None), out


def test_part_timing_wraps_encode_prompt_and_decode_and_undoes_exactly():
    from ditbook.timing import Clock, PartRecorder

    class Vae(torch.nn.Module):
        def decode(self, z):
            return z * 2

    class Pipe:
        def __init__(self):
            self.vae = Vae()
            self.transformer = Tiny(1)

        def encode_prompt(self, prompt):
            return prompt.upper()

    pipe = Pipe()
    rec = PartRecorder(pipe, Clock(False))
    assert wrap_names(pipe, "encode_prompt") == ["ditbook.part-timing"] and wrap_names(pipe.vae, "decode")
    rec.begin_call()
    assert pipe.encode_prompt("a") == "A" and torch.equal(pipe.vae.decode(torch.ones(1)), torch.full((1,), 2.0))
    parts = rec.end_call()
    assert len(parts["text_encoding"]) == 1 and len(parts["vae_decode"]) == 1
    rec.remove()
    assert "encode_prompt" not in pipe.__dict__ and "decode" not in pipe.vae.__dict__
    assert "_ditbook_wraps" not in pipe.__dict__ and not pipe.transformer._forward_pre_hooks


def test_part_timing_failing_half_way_leaves_the_pipeline_as_it_was():
    from types import SimpleNamespace

    from ditbook.timing import Clock, PartRecorder

    class Vae(torch.nn.Module):
        def decode(self, z):
            return z

    vae = Vae()
    pipe = SimpleNamespace(encode_prompt=lambda p: p, vae=vae)
    own = pipe.encode_prompt
    wrap_method(vae, "ditbook.part-timing", lambda original, z: original(z), attr="decode")
    with pytest.raises(WrapError, match="already wrapped"):
        PartRecorder(pipe, Clock(False))
    assert pipe.__dict__["encode_prompt"] is own and "_ditbook_wraps" not in pipe.__dict__


def test_snapshot_restores_what_a_third_party_patch_left_on_instances():
    # the shape of cache-dit's patch functors: forward replaced on the root and on a child, the
    # root marked _is_patched, nothing undone by its disable
    from ditbook.hooks import snapshot_instance_attrs

    root = torch.nn.Sequential(Doubler(), Doubler())
    own = lambda x: x  # noqa: E731
    root[1].forward = own
    restore = snapshot_instance_attrs(root)
    root.forward = lambda x: x * 0
    root[0].forward = lambda x: x * 0
    root[1].forward = lambda x: x * 0
    root._is_patched = True
    restore()
    assert "forward" not in root.__dict__ and "_is_patched" not in root.__dict__
    assert "forward" not in root[0].__dict__ and root[1].__dict__["forward"] is own
    assert torch.equal(root(torch.ones(1)), torch.full((1,), 2.0))


def test_swap_attribute_undoes_exactly_on_instances_classes_and_modules():
    import types

    from ditbook.hooks import WrapError, swap_attribute

    class Proc:
        shared = "class value"

    p = Proc()
    h = swap_attribute(p, "shared", None)  # shadows the class attribute
    assert p.shared is None
    h.remove()
    assert "shared" not in vars(p) and p.shared == "class value"  # absent again, not set to the old value
    p.own = obj = object()
    with swap_attribute(p, "own", 1):
        assert p.own == 1
    assert p.own is obj  # the very object again
    mod = types.ModuleType("fake_diffusers_module")
    mod.IDENTIFIERS = ids = ("blocks",)
    h = swap_attribute(mod, "IDENTIFIERS", ids + ("layers",))
    h.remove()
    h.remove()  # idempotent
    assert mod.IDENTIFIERS is ids
    h = swap_attribute(p, "own", 2)
    p.own = 3  # changed behind the handle's back: refused, not silently dropped
    with pytest.raises(WrapError, match="changed outside"):
        h.remove()


def test_set_item_undoes_a_registry_entry_exactly():
    from ditbook.hooks import set_item

    registry = {"Known": "theirs"}
    with set_item(registry, "Mine", "ours"):
        assert registry["Mine"] == "ours"
    assert registry == {"Known": "theirs"}
    h = set_item(registry, "Known", "ours")
    h.remove()
    assert registry == {"Known": "theirs"}


def test_cache_agreement_wraps_can_cache_and_comes_off_exactly():
    from types import SimpleNamespace

    from ditbook.cp.cache_sync import agree_cache_decisions

    class Manager:
        def can_cache(self, *a, **k):
            return True

    cm = Manager()
    stats = agree_cache_decisions(SimpleNamespace(_context_manager=cm, transformer=None))
    assert cm.can_cache() is True and stats.decisions == 1 and stats.skips == 1
    assert "handle" not in stats.to_dict()
    stats.remove()
    assert "can_cache" not in vars(cm)  # the class's method again (before: an instance attribute for good)
