"""The feasibility table is each parallel technique's own judge (``ditbook.accel``: its module's
``judge(facts, n)``); each is checked on its own here, with a case where it says "feasible" and one
where it says "not feasible" and why. The whole table against the tiny models:
tests/test_parallel.py::test_feasibility_reasons."""

from __future__ import annotations

from ditbook import accel
from ditbook.arch.report import AttentionFacts
from ditbook.parallel.feasibility import Feasibility, ModelFacts, feasibility


def _row(token: str, kind: str):
    """The judge of one feasibility row: the technique of ``token``, its row of ``kind``."""
    def judge(f, n):
        return next(r for r in accel.by_token(token).judge(f, n) if r.kind == kind)
    return judge


judge_cfg, judge_cfg_x_ulysses = _row("cfg", "cfg"), _row("cfg", "cfg_x_ulysses")
judge_ulysses, judge_ring, judge_ulysses_x_ring = _row("ulysses", "ulysses"), _row("ring", "ring"), _row("usp", "ulysses_x_ring")
judge_tp, judge_vae, judge_text_encoder = _row("tp", "tp"), _row("vae", "vae"), _row("te", "text_encoder")
KINDS = tuple(r.kind for t in accel.parallel_kinds() for r in t.judge(ModelFacts(
    att=AttentionFacts(heads=2, kv_heads=2), heads=2, kv=2, s_img=4, s_txt=4, joint=True, device="cpu", registered_cp=None,
    tp_plan=None, cfg_ok=True, cfg_why=""), 2))


def facts(heads=8, kv=2, s_img=16, s_txt=8, joint=True, device="cuda", cp="diffusers _cp_plan", tp=None,
          cfg_ok=True, masks=(), fused=False, components=None, te=(), vae=()) -> ModelFacts:
    att = AttentionFacts(heads=heads, kv_heads=kv, head_dim=16, kind="joint" if joint else "self",
                         image_seq_len=s_img, text_seq_len=s_txt, masks=list(masks), fused_qkv=fused)
    return ModelFacts(att=att, heads=heads, kv=kv if kv is not None else heads, s_img=s_img, s_txt=s_txt,
                      joint=joint, device=device, registered_cp=cp, tp_plan=tp, cfg_ok=cfg_ok,
                      cfg_why="two calls per step" if cfg_ok else "one transformer call per step: no second branch",
                      components=components or {}, text_encoder_planners=set(te), vae_planners=set(vae))


def row(judge, f, n) -> tuple[bool, str | None, str]:
    r = judge(f, n)
    assert isinstance(r, Feasibility) and r.world_size == n and r.kind in KINDS
    return r.feasible, r.plan, r.reason


def test_every_parallel_technique_judges_itself_at_every_world_size():
    assert len(set(KINDS)) == len(KINDS) and {"cfg", "ulysses", "ring", "tp", "vae", "text_encoder"} <= set(KINDS)
    for n in (1, 2, 4, 8):
        for technique in accel.parallel_kinds():
            rows = technique.judge(facts(), n)
            assert rows and all(isinstance(r, Feasibility) and r.world_size == n for r in rows), technique.name


def test_cfg():
    assert row(judge_cfg, facts(), 2) == (True, "cfg2", "two calls per step")
    ok, plan, why = row(judge_cfg, facts(cfg_ok=False), 2)
    assert not ok and plan is None and "no second branch" in why
    assert not row(judge_cfg, facts(), 1)[0]
    ok, _, why = row(judge_cfg, facts(), 4)
    assert not ok and "needs cfg2 x CP2" in why


def test_ulysses():
    assert row(judge_ulysses, facts(), 1) == (True, "single", "the single-process baseline")
    ok, plan, why = row(judge_ulysses, facts(heads=8, kv=2), 4)
    assert ok and plan == "ulysses4" and "2 KV heads not divisible by 4: K/V repeated" in why
    ok, _, why = row(judge_ulysses, facts(heads=6), 4)
    assert not ok and "6 query heads not divisible by 4" in why
    ok, _, why = row(judge_ulysses, facts(s_img=18), 4)  # ulysses_anything: tensor_split shares
    assert ok and "18 image tokens" in why and "split unevenly" in why
    ok, _, why = row(judge_ulysses, facts(s_img=3), 4)
    assert not ok and "fewer tokens than ranks" in why
    ok, _, why = row(judge_ulysses_x_ring, facts(s_img=17), 4)  # ring: no ulysses_anything
    assert not ok and "sequence divisible" in why
    ok, _, why = row(judge_ulysses, facts(s_txt=6, joint=True), 4)
    assert ok and "6 text tokens" in why
    assert row(judge_ulysses, facts(s_txt=6, joint=False), 2)[0]  # text not split outside joint attention
    assert "head count unknown" in row(judge_ulysses, facts(heads=None), 2)[2]


def test_ring():
    ok, plan, why = row(judge_ring, facts(), 2)
    own = "ditbook's ring attention (partials merged by log-sum-exp, K/V over isend/irecv); "
    assert ok and plan == "ring2" and why == own + "plan: diffusers _cp_plan"
    assert row(judge_ring, facts(cp=None), 2)[2] == own + "plan derived from the traced call conventions"
    ok, _, why = row(judge_ring, facts(device="cpu"), 2)  # ditbook's ring runs on the CPU too
    assert ok and why.startswith(own)
    ok, _, why = row(judge_ring, facts(masks=["attention_mask"]), 2)  # ditbook's ring: the mask travels
    assert ok and "travel round the ring with their keys" in why
    ok, _, why = row(judge_ulysses_x_ring, facts(masks=["attention_mask"], heads=8), 4)  # cache-dit's ring
    assert not ok
    assert row(judge_ring, facts(masks=["encoder_attention_mask"]), 2)[0]
    assert not row(judge_ring, facts(), 1)[0]


def test_ulysses_x_ring():
    ok, plan, why = row(judge_ulysses_x_ring, facts(heads=8), 8)
    assert ok and plan == "usp2x4" and why.startswith("ring 2 x ulysses 4")  # most Ulysses ranks first
    assert row(judge_ulysses_x_ring, facts(heads=2, kv=2), 8)[1] == "usp4x2"
    ok, _, why = row(judge_ulysses_x_ring, facts(device="cpu"), 8)
    assert not ok and "no ring x ulysses split of 8" in why
    ok, _, why = row(judge_ulysses_x_ring, facts(), 2)
    assert not ok and "at least 4 processes" in why


def test_cfg_x_ulysses():
    ok, plan, why = row(judge_cfg_x_ulysses, facts(), 8)
    assert ok and plan == "cfg2_ulysses4" and why.startswith("cfg2 x ulysses4: ")
    ok, _, why = row(judge_cfg_x_ulysses, facts(cfg_ok=False), 4)
    assert not ok and "no second branch" in why
    ok, plan, why = row(judge_cfg_x_ulysses, facts(heads=6), 8)
    assert not ok and "6 query heads not divisible by 4" in why
    assert "at least 4 processes" in row(judge_cfg_x_ulysses, facts(), 2)[2]


def test_tp():
    r = judge_tp(facts(tp="diffusers _tp_plan", kv=8, fused=True), 2)
    assert r.feasible and r.plan == "tp2" and r.launchable and r.reason == "plan: diffusers _tp_plan"
    ok, plan, why = row(judge_tp, facts(kv=8), 2)  # no registered plan: derived from the traced linears
    assert ok and plan == "tp2" and why.startswith("plan derived from the traced linear layers")
    ok, _, why = row(judge_tp, facts(kv=2), 4)
    assert not ok and why.startswith("GQA: 2 KV heads not divisible by 4")
    # a fused QKV without a registered plan: derived per chunk and simulated before launch (the refusal
    # "which ditbook does not derive" was no longer true: tensor.packed_colwise, test_parallel_derived)
    ok, _, why = row(judge_tp, facts(kv=8, fused=True), 2)
    assert ok and "a fused qkv per chunk" in why
    ok, _, why = row(judge_tp, facts(heads=6, tp="x"), 4)
    assert not ok and why == "6 heads not divisible by 4"
    assert row(judge_tp, facts(heads=None), 2)[2] == "head count unknown"


def test_text_encoder():
    comps = {"text_encoder": "T5EncoderModel", "text_encoder_2": "MyEncoder", "vae": "AutoencoderKL"}
    ok, plan, why = row(judge_text_encoder, facts(components=comps), 2)
    assert ok and plan == "te2"
    assert why == ("the calls of text_encoder (T5EncoderModel), text_encoder_2 (MyEncoder) spread round-robin "
                   "over 2 ranks, each result broadcast")
    assert row(judge_text_encoder, facts(), 2)[2] == "the pipeline has no text encoder component"
    assert not judge_text_encoder(facts(components=comps), 1).feasible


def test_vae():
    comps = {"vae": "AutoencoderKLQwenImage"}
    ok, plan, why = row(judge_vae, facts(components=comps), 4)
    assert ok and plan == "vae4" and why.startswith("AutoencoderKLQwenImage: latent rows split over 4 ranks")
    assert row(judge_vae, facts(), 2)[2] == "the pipeline has no vae component"
    assert not judge_vae(facts(components=comps), 1).feasible


def test_feasibility_is_the_table_of_judges(tmp_path, monkeypatch):
    """The techniques' judges drive ``feasibility``: a judge swapped in shows in every world size."""
    from test_parallel import _report
    import test_parallel_models as models

    from ditbook.card import load_card

    monkeypatch.setattr(accel.by_token("vae"), "judge",
                        classmethod(lambda cls, f, n: [Feasibility("vae", n, False, None, f"judged {n}", launchable=False)]))
    table = feasibility(_report(), load_card(models.tiny_flux(tmp_path)), device="cuda")
    assert [r.kind for r in table.rows[:len(KINDS)]] == list(KINDS)
    assert [table.get("vae", n).reason for n in (1, 2, 4, 8)] == ["judged 1", "judged 2", "judged 4", "judged 8"]
