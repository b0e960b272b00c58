"""Inspection and adapter decisions on the novel third-party DiTs (tests/novel/): facts that must
come from the traced data flow and the traced attention calls, not from parameter names or
attention modules (issue 23, items 3, 9 and 10). The whole-playbook runs are tests/test_novel_models.py."""

import pytest

from ditbook.card import load_card
from ditbook.loading import load_pipeline
from novel import suite

H, E = "hidden_states", "encoder_hidden_states"


@pytest.fixture(scope="module")
def inspected(tmp_path_factory):
    from ditbook.inspect.stage import run_inspection

    root = tmp_path_factory.mktemp("novel")
    cache = {}

    def get(name):
        if name not in cache:
            card = load_card(suite.build(name, root))
            pipe = load_pipeline(card)
            cache[name] = (pipe, run_inspection(pipe, card).report)
        return cache[name]
    return get


def test_blocks_without_an_attention_module_are_found_by_their_attention_calls(inspected):
    # DiTBlock holds one fused qkv Linear and calls F.scaled_dot_product_attention itself
    _, report = inspected("depthscale")
    assert [b.path for b in report.block_lists] == ["blocks"]
    assert any(n.startswith("blocks: block list by its traced attention calls") for n in report.notes), report.notes
    assert (report.attention.heads, report.attention.head_dim, report.attention.kind) == (4, 8, "joint")


def test_streams_named_otherwise_get_their_roles_from_the_data_flow(inspected):
    # JointBlock(txt, img, vec) -> (txt, img): text first, names not hidden_states
    _, report = inspected("dualstream")
    b = report.block_lists[0]
    assert b.call.output_roles == [E, H]
    assert b.forward_pattern == "Pattern_1" and "traced streams ['img', 'txt']" in b.pattern_reason
    assert report.loop_extra_work is False, report.loop_extra_work_reasons
    assert report.attention.kind == "joint"
    assert (report.attention.image_seq_len, report.attention.text_seq_len) == (16, 8)


def test_reading_a_returned_dict_is_not_loop_work(inspected):
    _, report = inspected("dictblocks")
    assert report.loop_extra_work is False, report.loop_extra_work_reasons
    assert report.block_lists[0].forward_pattern == "Pattern_0"


def test_a_chain_from_one_nested_list_into_the_next_is_no_skip_connection(inspected):
    pipe, report = inspected("stages")
    assert [b.path for b in report.block_lists] == ["stages.0.blocks", "stages.1.blocks"]
    assert report.loop_extra_work is False, report.loop_extra_work_reasons
    # the own Euler loop has no scheduler: CFG read from the traced call's steps
    assert (report.cfg.style, report.cfg.calls_per_step) == ("separate", 2.0)


def test_nested_lists_in_never_called_containers_are_cached_through_stand_in_owners(inspected):
    """``for stage in self.stages: for blk in stage.blocks``: refused before ("containers are never
    called"). The inner lists are run by the transformer's forward in order; cache-dit is handed one
    stand-in owner per container (chained from the transformer's forward), whose attribute swap lands
    on the container: both lists cached, block calls skipped, the baseline back exactly after the undo."""
    import numpy as np
    import torch

    from ditbook.adapter.build import build_cache_adapter
    from ditbook.accel.dbcache import enable_dbcache

    pipe, report = inspected("stages")
    adapter = build_cache_adapter(pipe, report, "stages")
    assert adapter.info.containers == ["stages", "blocks"] and not adapter.info.uncached
    assert [p.path for p in adapter.info.block_lists] == ["stages.0.blocks", "stages.1.blocks"]

    def render():
        return pipe("a red circle", num_inference_steps=4, generator=torch.Generator().manual_seed(0)).images

    base = render()
    undo = enable_dbcache(pipe, adapter, dict(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=10.0,
                                              max_warmup_steps=1, num_inference_steps=4))
    calls = []
    handles = [b.register_forward_hook(lambda *a: calls.append(1)) for b in adapter.original_blocks()]
    try:
        cached = render()
    finally:
        undo()
        for h in handles:
            h.remove()
    assert 0 < len(calls) < 8 * len(adapter.original_blocks())  # 4 steps x 2 CFG calls
    assert np.abs(cached - base).max() > 0
    assert np.abs(render() - base).max() == 0 and "forward" not in pipe.transformer.__dict__


def test_a_container_loop_passing_the_stream_by_keyword_is_refused_with_the_reason(inspected):
    """The stand-in owners run the loop unfolded: cache-dit's unit takes the streams first,
    positionally; a loop that passes them by keyword is left uncached, saying so."""
    import dataclasses

    from ditbook.adapter.build import CacheRefused, generate_adapter_source

    pipe, report = inspected("stages")
    bad = dataclasses.replace(report, block_lists=[dataclasses.replace(
        b, call=dataclasses.replace(b.call, positional=[], keywords=["x", "cond", "emb"])) for b in report.block_lists])
    with pytest.raises(CacheRefused, match="does not pass the hidden_states stream as positional argument 0"):
        generate_adapter_source(pipe, bad, "stages")


def test_flux_reference_shape(inspected):
    # attention() function (no module), pe tensor, guidance argument, loop in a module-level denoise()
    _, report = inspected("fluxref")
    assert [b.path for b in report.block_lists] == ["double_blocks", "single_blocks"]
    assert [b.forward_pattern for b in report.block_lists] == ["Pattern_0", "Pattern_3"]
    assert report.loop_extra_work is False, report.loop_extra_work_reasons
    a = report.attention
    assert (a.kind, a.rope, a.heads, a.head_dim) == ("joint", True, 2, 16)
    assert report.cfg.style == "distilled"


def test_len_of_the_list_outside_the_loop_is_a_length_read(inspected):
    from ditbook.adapter.build import generate_adapter_source
    from ditbook.arch.loop_source import list_uses

    pipe, report = inspected("depthscale")
    u = list_uses(type(pipe.transformer), ["blocks"])["blocks"]
    assert u.other == [] and any("len(self.blocks)" in e for e in u.element_attrs)
    src, info = generate_adapter_source(pipe, report, "depthscale")
    assert [p.path for p in info.block_lists] == ["blocks"] and info.block_lists[0].folded
    assert "len(self._ditbook_originals['blocks'])" in src


def test_one_list_looped_in_exclusive_mode_methods(inspected):
    from ditbook.adapter.build import generate_adapter_source
    from ditbook.arch.loop_source import list_uses

    pipe, report = inspected("modes")
    u = list_uses(type(pipe.transformer), ["blocks"])["blocks"]
    assert len(u.loops) == 2 and u.exclusive and u.unsafe() == ""
    _, info = generate_adapter_source(pipe, report, "modes")
    assert [p.path for p in info.block_lists] == ["blocks"]


def test_adapter_folds_when_no_pattern_matches_by_name(inspected):
    # the static report alone (no trace) finds no pattern: the blocks have no 'hidden_states'
    from ditbook.adapter.build import generate_adapter_source
    from ditbook.arch.static import inspect_transformer

    pipe, _ = inspected("dualstream")
    static = inspect_transformer(pipe.transformer, type(pipe).__name__)
    assert static.block_lists[0].forward_pattern is None
    _, info = generate_adapter_source(pipe, static, "dualstream")
    assert info.block_lists[0].folded and "renames and reorders the streams" in info.block_lists[0].reason


def test_skipped_share_counts_every_block_list_the_forward_runs(inspected, tmp_path):
    # an adapter that caches only the double-stream list: the counter still counts the single-stream
    # blocks, so a share skipped of one list is not reported as a share of the whole transformer
    from ditbook.adapter.build import CacheAdapter, generate_adapter_source
    from ditbook.cache.verify import counted_render

    pipe, report = inspected("fluxref")
    _, info = generate_adapter_source(pipe, report, "fluxref")
    info.block_lists, info.patch_functor = info.block_lists[:1], None
    adapter = CacheAdapter(pipe, report, info, None, "")
    card = load_card(suite.build("fluxref", tmp_path))
    _, counts = counted_render(pipe, card, adapter, card.generation.prompts, [0])
    assert counts["calls"] and set(counts["calls"]) == {4}  # 2 double + 2 single per transformer call


def test_attention_through_a_plain_function_is_routed(inspected):
    # the reference blocks call attention(q, k, v, pe), a module-level function that calls SDPA:
    # the CP redirect and ditbook's ring find the blocks as the modules to route
    from ditbook.cp.attention import route_attention, sdpa_callers
    from ditbook.accel.ring import attention_modules

    pipe, _ = inspected("fluxref")
    names = [n for n, _ in sdpa_callers(pipe.transformer)]
    assert names == ["double_blocks.0", "double_blocks.1", "single_blocks.0", "single_blocks.1"]
    assert [n for n, _ in attention_modules(pipe.transformer)] == names
    route = route_attention(pipe.transformer)
    try:
        assert route.modules == names
    finally:
        route.remove()


def test_a_network_held_as_an_attribute_is_cached_through_its_own_forward(inspected):
    """``heldnet``: the ModelMixin wrapper holds the reference network as ``self.net`` and its own
    forward runs the loops. Refused before ("nested inside net, whose own code runs the loop"); now
    cache-dit is handed the held network (``owner``), both lists are cached, a cached render skips
    block calls, and the undo gives the baseline back exactly."""
    import numpy as np
    import torch

    from ditbook.benchmark.residuals import first_block
    from ditbook.adapter.build import build_cache_adapter
    from ditbook.accel.dbcache import enable_dbcache

    pipe, report = inspected("heldnet")
    assert [b.path for b in report.block_lists] == ["net.dual", "net.joined"]
    adapter = build_cache_adapter(pipe, report, "heldnet")
    assert adapter.info.owner == "net" and not adapter.info.uncached
    assert "transformer=pipe.transformer.net," in adapter.source
    assert first_block(pipe.transformer)[0] == "net.dual.0"   # the benchmark's residual probe finds it too

    def render():
        return pipe("a red circle", num_inference_steps=4, generator=torch.Generator().manual_seed(0)).images

    base = render()
    undo = enable_dbcache(pipe, adapter, dict(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=10.0,
                                              max_warmup_steps=1, num_inference_steps=4))
    calls = []
    handles = [b.register_forward_hook(lambda *a: calls.append(1)) for b in adapter.original_blocks()]
    try:
        cached = render()
    finally:
        undo()
        for h in handles:
            h.remove()
    assert 0 < len(calls) < 4 * len(adapter.original_blocks())  # steps after the warmup skipped blocks
    assert np.abs(cached - base).max() > 0
    assert np.abs(render() - base).max() == 0


def test_a_sampler_entering_by_apply_model_with_the_text_carried_first(inspected):
    """``textfirst`` (the SD3.5 reference's shape): the CFG denoiser calls ``apply_model``, not the
    module, so no forward hook saw a call (0 transformer calls, no block call traced, the cache stage
    crashed); the loop carries ``context, x`` text first and the last block returns no text, so the fold
    made the text the hidden stream (TeaCache's residual of None crashed). Now: 3 steps traced as batched
    CFG, the held network's list folded with the image first, and both caches run and skip."""
    import numpy as np
    import torch

    from ditbook.adapter.build import build_cache_adapter
    from ditbook.accel import teacache_fitted as tf
    from ditbook.accel.dbcache import enable_dbcache

    pipe, report = inspected("textfirst")
    assert (report.cfg.style, report.cfg.batch_per_call) == ("batched", 2)
    (bl,) = report.block_lists
    assert bl.path == "model.joint_blocks" and list(bl.call.output_roles) == [E, H]
    adapter = build_cache_adapter(pipe, report, "textfirst")
    assert adapter.info.owner == "model"
    assert "x, context = block(hidden_states=x, encoder_hidden_states=context" in adapter.source

    def render():
        return pipe("a red circle", num_inference_steps=4, generator=torch.Generator().manual_seed(0)).images

    base = render()
    undo = tf.TeaCacheFitted.apply(pipe, tf.TeaCacheSettings(threshold=0.3, coefficients=[0.0, 1.0, 0.0],
                                                             warmup_steps=1, max_consecutive=1), adapter=adapter, steps=4)
    try:
        render()
    finally:
        undo()
    undo = enable_dbcache(pipe, adapter, dict(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=10.0,
                                              max_warmup_steps=1, num_inference_steps=4))
    calls = []
    handles = [b.register_forward_hook(lambda *a: calls.append(1)) for b in adapter.original_blocks()]
    try:
        cached = render()
    finally:
        undo()
        for h in handles:
            h.remove()
    assert 0 < len(calls) < 4 * len(adapter.original_blocks()) and np.abs(cached - base).max() > 0
    assert np.abs(render() - base).max() == 0


def test_cached_units_of_a_held_network_are_found_for_cp_with_a_cache(inspected):
    """``ulysses2+cache`` on ``heldnet`` failed in the ranks with ``CacheSplitError: cache-dit's cached
    block units were not found on this transformer's forward``: cache-dit patched the held network's
    forward, not the transformer's. The units are looked up on every module cache-dit was handed and
    named by the transformer's paths."""
    from ditbook.adapter.build import build_cache_adapter
    from ditbook.accel.dbcache import enable_dbcache
    from ditbook.cp.cache_sync import cached_block_units

    pipe, report = inspected("heldnet")
    adapter = build_cache_adapter(pipe, report, "heldnet")
    undo = enable_dbcache(pipe, adapter, dict(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=0.1,
                                              max_warmup_steps=1, num_inference_steps=3))
    try:
        assert set(cached_block_units(pipe.transformer)) == {"net.dual", "net.joined"}
    finally:
        undo()


def test_first_block_cache_is_refused_where_head_and_tail_blocks_return_different_streams(inspected, tmp_path):
    # diffusers' FirstBlockCache takes the tail block's residual against the head block's output:
    # fluxref's head (double_blocks.0) returns img and txt, its tail (single_blocks.1) one tensor, so
    # the hook fails inside the render (TypeError: Tensor - list). The strategy says so before it runs;
    # where head and tail return the same streams it stays applicable.
    from ditbook import accel
    from ditbook.adapter.build import build_cache_adapter
    from ditbook.cache.verify import render_set

    fbc = accel.get("diffusers_fbc")
    pipe, report = inspected("fluxref")
    adapter = build_cache_adapter(pipe, report, "fluxref-fbc")
    reason = fbc.applicable(adapter)
    assert reason and "double_blocks" in reason and "single_blocks" in reason
    card = load_card(suite.build("fluxref", tmp_path))
    undo = fbc.apply(pipe, fbc.settings(), adapter=adapter, steps=card.generation.steps)
    try:  # the reason is true: run anyway, the hook cannot form the residual
        with pytest.raises(TypeError):
            render_set(pipe, card, card.generation.prompts, [0])
    finally:
        undo()
    same_pipe, same_report = inspected("dualstream")
    assert fbc.applicable(build_cache_adapter(same_pipe, same_report, "dualstream-fbc")) is None
