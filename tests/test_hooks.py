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
