"""Reference code whose sampling loop enters the transformer by a method, not the module call
(public reference code, issue 39): the original DiT's loop calls ``model.forward_with_cfg``, which
calls ``self.forward`` directly; the SD3.5 reference's CFG denoiser calls ``model.apply_model``, to
which ``forward`` hands every argument. No forward hook saw those calls (the inspection traced 0
transformer calls, the cache stage crashed); ``loading.route_entries`` routes them through the call."""

import torch
from diffusers import ConfigMixin, ModelMixin
from torch import nn

from ditbook.loading import entry_routes, route_entries


class WithCfg(ModelMixin, ConfigMixin):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, t):
        return self.lin(x) * t

    def forward_with_cfg(self, x, t, scale):
        out = self.forward(torch.cat([x, x]), t)
        cond, uncond = out.chunk(2)
        return uncond + scale * (cond - uncond)


class Held(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class Delegating(ModelMixin, ConfigMixin):
    def __init__(self):
        super().__init__()
        self.net = Held()

    def apply_model(self, x, sigma):
        return x - self.net(x) * sigma

    def forward(self, *args, **kwargs):
        return self.apply_model(*args, **kwargs)


def _count(module):
    calls = []
    module.register_forward_pre_hook(lambda m, a, k: calls.append(a[0].shape[0] if a else None), with_kwargs=True)
    return calls


def test_a_method_calling_self_forward_is_seen_as_a_transformer_call():
    m = WithCfg()
    assert entry_routes(m) == ["forward_with_cfg"]
    x = torch.randn(1, 4)
    want = m.forward_with_cfg(x, 0.5, 3.0)
    calls = _count(m)
    m.forward_with_cfg(x, 0.5, 3.0)
    assert calls == []                         # before: invisible to every forward hook
    route_entries(m)
    assert torch.equal(m.forward_with_cfg(x, 0.5, 3.0), want) and calls == [2]  # one batched call
    assert torch.equal(m(torch.cat([x, x]), 0.5), m.lin(torch.cat([x, x])) * 0.5) and calls == [2, 2]
    assert "forward" not in m.__dict__  # forward itself is routed only while forward_with_cfg runs


def test_a_method_forward_hands_everything_to_is_routed_once():
    m = Delegating()
    assert entry_routes(m) == ["apply_model"]
    x = torch.randn(2, 4)
    want = m.apply_model(x, 0.3)
    calls = _count(m)
    route_entries(m)
    assert torch.equal(m.apply_model(x, 0.3), want) and calls == [2]
    assert torch.equal(m(x, 0.3), want) and calls == [2, 2]   # through the call: not routed twice
    assert route_entries(m) == []                             # installed once


def test_a_plain_model_gets_no_route():
    assert entry_routes(Held()) == []


def test_a_deep_copy_is_routed_to_itself():
    """The parallel worker deep-copies a pristine pipeline per plan: the copy's routes were the
    original's, bound to the original, so the copy's hooks never fired ("the pipeline run never called
    the transformer") and the calls ran the original's weights."""
    import copy

    m = Delegating()
    route_entries(m)
    twin = copy.deepcopy(m)
    with torch.no_grad():
        twin.net.lin.weight.mul_(2)
    route_entries(twin)
    calls = _count(twin)
    x = torch.randn(2, 4)
    assert torch.equal(twin.apply_model(x, 0.3), x - twin.net(x) * 0.3) and calls == [2]
    assert not torch.equal(m.apply_model(x, 0.3), twin.apply_model(x, 0.3))
