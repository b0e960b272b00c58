"""Videos through the playbook's stages: a pipeline output with ``.frames`` is kept whole (every
frame), compared frame by frame (a wrong frame anywhere fails, where a first-frame comparison or
one PSNR pooled over the tiled frames passes), stored whole, and drawn as a row of frames per
video in the intake, cache and benchmark sheets and the report. The last test runs all five
stages on the video reference card in make-test-sized settings, when its weights are in the
repository."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ditbook.quality import FRAME_REDUCE, compare, compare_sets, psnr
from ditbook.render import Render, frame_strip, is_video, load_images, save_renders, to_image
from ditbook.zoo import moving_shapes

ROOT = Path(__file__).resolve().parent.parent
CARD = ROOT / "models" / "video_reference.yaml"
WEIGHTS = ROOT / "models" / "video_reference" / "pipeline"


def clip(direction: str = "right", seed: int = 0) -> np.ndarray:
    scene = moving_shapes.MovingScene("circle", "red", direction)
    return moving_shapes.render(scene, np.random.default_rng(seed)).astype(np.float32) / 255.0


# -- comparison: every frame counts ----------------------------------------------------------
def _swapped(v):
    w = v.copy()
    w[[3, 5]] = w[[5, 3]]
    return w


def _reversed_after_first(v):
    return np.concatenate([v[:1], v[:0:-1]])


def _frozen_end(v):  # the last frame dropped and the one before repeated in its place
    return np.concatenate([v[:-1], v[-2:-1]])


@pytest.mark.parametrize("wrong", [_swapped, _reversed_after_first, _frozen_end], ids=["swap", "reversed", "frozen"])
def test_wrong_frames_fail_the_video_comparison_that_frame_zero_passes(wrong):
    ref = clip()
    bad = wrong(ref)
    assert compare(bad[0], ref[0]).passed, "frame 0 is untouched: a first-frame comparison passes"
    q = compare(bad, ref)
    assert not q.passed and q.frames["count"] == 9 and q.frames["reduce"] == FRAME_REDUCE
    assert q.frames["psnr"][0] == 100.0 and q.psnr < 30 and q.psnr == pytest.approx(min(q.frames["psnr"]), abs=1e-4)
    wrong_frames = [i for i in range(9) if not np.array_equal(bad[i], ref[i])]
    assert q.reasons[0].startswith(f"frames {wrong_frames} of 9: PSNR") or \
        q.reasons[0].startswith(f"frame {wrong_frames[0]} of 9: PSNR"), q.reasons
    assert compare(ref, ref).passed and compare(ref, ref).frames["psnr"] == [100.0] * 9


def test_a_dropped_frame_fails_with_its_reason_not_a_crash():
    ref = clip()
    q = compare(ref[1:], ref)
    assert not q.passed and q.reasons == ["video has 8 frames where the reference has 9 (a frame dropped or added)"]
    s = compare_sets({"p0_s0": ref[:-1]}, {"p0_s0": ref})
    assert not s.passed and "8 frames" in s.reasons[0]
    nan, blank = ref.copy(), ref.copy()
    nan[2, 5, 5] = np.nan
    blank[6] = 0.5
    assert compare(nan, ref).reasons == ["frame 2 of 9: holds NaN or Inf"] and compare(nan, ref).to_dict()["psnr"] is None
    assert "frame 6 of 9: blank where the reference is not" in compare(blank, ref).reasons


def test_one_bad_frame_fails_where_a_psnr_pooled_over_all_frames_passes():
    """The old video path tiled the frames into one picture and took one PSNR over it: a single
    corrupted frame is diluted by the eight good ones. Frame by frame, the worst frame decides."""
    ref = clip()
    bad = ref.copy()
    bad[4] = np.clip(bad[4] + np.random.default_rng(0).normal(0, 0.045, bad[4].shape), 0, 1)
    pooled = psnr(frame_strip(bad, gap=0), frame_strip(ref, gap=0))
    assert pooled > 30, pooled  # the old tiled comparison passed this video
    q = compare(bad, ref)
    assert not q.passed and q.frames["worst_frame"] == 4 and q.psnr < 30
    assert q.reasons[0].startswith("frame 4 of 9: PSNR"), q.reasons
    assert q.frames["psnr_mean"] > q.psnr  # the mean is reported beside it, the minimum is judged


def test_image_reports_are_unchanged_and_video_sets_state_their_frame_reduction():
    img = clip()[0]
    q = compare(img, img).to_dict()
    assert "frames" not in q and q["passed"]
    s = compare_sets({"a": img}, {"a": img}).to_dict()
    assert "frame_reduce" not in s
    v = compare_sets({"a": clip()}, {"a": clip()}).to_dict()
    assert v["passed"] and "min over its frames" in v["frame_reduce"] and v["per_image"]["a"]["frames"]["count"] == 9


# -- rendering and storage: a pipeline output with .frames stays a video ------------------------
def test_to_image_keeps_every_frame_of_a_frames_output():
    video = np.random.default_rng(0).random((1, 9, 8, 12, 3)).astype(np.float32)
    assert to_image(SimpleNamespace(frames=video)).shape == (9, 8, 12, 3)
    assert np.array_equal(to_image(SimpleNamespace(frames=video)), video[0])
    assert np.array_equal(to_image(SimpleNamespace(frames=video[0])), video[0])  # one video, unbatched
    channels_first = np.ascontiguousarray(video.transpose(0, 1, 4, 2, 3))  # (B, F, C, H, W), output_type="pt"
    assert np.array_equal(to_image(SimpleNamespace(frames=channels_first)), video[0])
    image = video[:, 0]
    assert to_image(SimpleNamespace(images=image)).shape == (8, 12, 3)  # an image stays an image
    assert is_video(video[0]) and not is_video(image[0])


def test_save_renders_stores_all_frames_and_a_row_of_frames(tmp_path):
    from PIL import Image

    v = clip()
    rows = save_renders([Render("a red circle moving right", 0, v, 0.1, "p0_s0")], tmp_path / "images")
    assert rows[0].frames == 9 and rows[0].shape == [9, 32, 32, 3]
    back = load_images(tmp_path, rows)["p0_s0"]
    assert back.shape == v.shape and np.array_equal(back, v)
    png = np.asarray(Image.open(tmp_path / rows[0].png))
    assert png.shape == (32, 9 * 33 - 1, 3)
    assert np.array_equal(png[:, 33 * 8:], (v[8] * 255).round().astype(np.uint8))  # the last frame is there


def test_a_long_videos_pictures_show_a_bounded_choice_of_frames_and_the_npy_keeps_all(tmp_path, monkeypatch):
    """A Wan-length video (81 frames): its PNG and its sheets show PREVIEW_FRAMES evenly spaced
    frames, first and last among them, at most SHEET_FRAME_PX wide in a sheet (drawing every frame
    of 480x832 took minutes per sheet); the benchmark sheet adds each row's worst frame."""
    import matplotlib.pyplot as plt
    from PIL import Image

    from ditbook.benchmark.plots import video_grid
    from ditbook.intake.stage import baseline_sheet
    from ditbook.render import PREVIEW_FRAMES, preview_frames
    from ditbook.render_sheet import SHEET_FRAME_PX

    rng = np.random.default_rng(0)
    v = rng.random((81, 24, 600, 3), dtype=np.float32)
    shown = preview_frames(81)
    assert len(shown) == PREVIEW_FRAMES and shown[0] == 0 and shown[-1] == 80
    rows = save_renders([Render("long", 0, v, 0.1, "p0_s0")], tmp_path / "images")
    assert rows[0].png_frames == shown and np.array_equal(load_images(tmp_path, rows)["p0_s0"], v)
    png = np.asarray(Image.open(tmp_path / rows[0].png))
    assert png.shape == (24, PREVIEW_FRAMES * 601 - 1, 3)
    assert np.array_equal(png[:, 601 * 4: 601 * 4 + 600], (v[shown[4]] * 255).round().astype(np.uint8))
    fig = baseline_sheet([Render("long", 0, v, 0.0, "p0_s0")])
    (h, w, _), = _strip_widths(fig)
    step = -(-600 // SHEET_FRAME_PX)
    assert w == PREVIEW_FRAMES * (-(-600 // step) + 1) - 1 and h == -(-24 // step)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == [str(i) for i in shown]
    plt.close(fig)
    bad = v.copy()
    bad[37] = 0.0  # the worst frame, not among the evenly spaced ones
    assert 37 not in shown
    import ditbook.render_sheet as sheet

    seen = {}

    def spy(rows, title="", path=None, px=0.025, frame_numbers=None):
        seen["frames"], seen["widths"] = frame_numbers, {np.shape(r)[0] for _, r in rows}
        return real(rows, title, path, px, frame_numbers)

    real = sheet.video_sheet
    monkeypatch.setattr(sheet, "video_sheet", spy)
    assert Path(video_grid({"p0_s0": v}, {"c": {"p0_s0": bad}}, tmp_path / "grid.png")).is_file()
    assert seen["frames"] == sorted(shown + [37]) and seen["widths"] == {PREVIEW_FRAMES + 1}


# -- sheets: a row of frames per video ---------------------------------------------------------
def _strip_widths(fig):
    return [ax.get_images()[0].get_array().shape for ax in fig.axes if ax.get_images()]


def test_intake_and_cache_sheets_draw_a_row_of_frames_per_video(tmp_path):
    import matplotlib.pyplot as plt

    from ditbook.cache.plots import image_grid as cache_grid
    from ditbook.intake.stage import baseline_sheet

    videos = {"p0_s0": clip("right"), "p1_s0": clip("up", 1)}
    renders = [Render("a red circle", 0, v, 0.0, k) for k, v in videos.items()]
    fig = baseline_sheet(renders)
    assert _strip_widths(fig) == [(32, 9 * 33 - 1, 3)] * 2
    plt.close(fig)
    cached = {k: _swapped(v) for k, v in videos.items()}
    fig = cache_grid(videos, cached, "swapped", tmp_path / "grid.png")
    assert _strip_widths(fig) == [(32, 9 * 33 - 1, 3)] * 6 and (tmp_path / "grid.png").is_file()
    labels = [ax.get_ylabel() for ax in fig.axes]
    assert labels[:3] == ["p0_s0 baseline", "p0_s0 cached", "p0_s0 |diff| x10"]
    diff = fig.axes[2].get_images()[0].get_array()
    assert diff[:, :32].max() < 0.02  # frame 0 equal: black in magma
    assert diff[:, 3 * 33: 3 * 33 + 32].max() > 0.5  # frame 3 swapped: bright
    plt.close(fig)
    fig = baseline_sheet([Render("img", 0, clip()[0], 0.0, "p0_s0")])  # images keep their grid
    assert _strip_widths(fig) == [(32, 32, 3)]
    plt.close(fig)


def test_benchmark_video_grid_labels_worst_frame(tmp_path, monkeypatch):
    """Each configuration's row is labelled with its worst frame's number, PSNR and SSIM, and that
    frame is among the frames drawn."""
    from ditbook import render_sheet
    from ditbook.benchmark.plots import image_grid

    seen = {}
    sheet = render_sheet.video_sheet

    def spy(rows, title, path, frame_numbers=None, **kw):
        seen["labels"], seen["frames"] = [label for label, _ in rows], list(frame_numbers)
        return sheet(rows, title, path, frame_numbers=frame_numbers, **kw)

    monkeypatch.setattr(render_sheet, "video_sheet", spy)
    base = {"p0_s0": clip()}
    path = image_grid(base, {"scm[x]": {"p0_s0": _swapped(clip())}, "same": {"p0_s0": clip()}},
                      tmp_path / "grid.png", {"p0_s0": "a red circle moving right"}, {"scm[x]": "C1"})
    assert Path(path).is_file()
    q = compare(_swapped(clip()), clip())
    assert q.frames["worst_frame"] in (3, 5), q.frames  # frames 3 and 5 were swapped
    swapped = [label for label in seen["labels"] if "scm[x]" in label or "C1" in label]
    expected = f"worst frame {q.frames['worst_frame']}: {q.psnr:.1f} dB, SSIM {q.ssim:.3f}"
    assert len(swapped) == 1 and expected in swapped[0], seen["labels"]
    assert q.frames["worst_frame"] in seen["frames"], seen["frames"]
    from PIL import Image

    w, h = Image.open(path).size
    assert w > 2 * h / 3, (w, h)  # 5 rows of 9 frames: wider than a square grid of one column


def test_explorer_shows_a_video_as_a_row_of_frames_judged_by_its_worst_frame():
    from ditbook.widgets import ExplorerData, explorer_state

    data = ExplorerData({"baseline": {"p0_s0": clip()}, "swapped": {"p0_s0": _swapped(clip())}})
    st = explorer_state(data, "swapped", "p0_s0")
    assert st.image.shape == (32, 9 * 33 - 1, 3) and st.diff.shape[:2] == st.image.shape[:2]
    assert st.psnr == pytest.approx(compare(_swapped(clip()), clip()).psnr) and st.psnr < 20


def test_benchmark_and_report_of_a_video_pipeline_judge_every_frame(tmp_path):
    """The benchmark stage's measure/save/figures and the report on a synthetic video pipeline
    (``.frames`` output, 5 frames; no weights needed): every configuration is judged frame by
    frame, the grid is drawn as rows of frames and the report says so."""
    from ditbook.benchmark.report import build_report, write_result_md
    from synthetic_run import make_synthetic_run
    from ditbook.runs import RunFolder

    run = RunFolder(make_synthetic_run(tmp_path, frames=5, repeats=1, parallel=False))
    res = run.read_results("benchmark")
    assert res.video["frames"] == 5 and res.video["reduce"] == FRAME_REDUCE
    assert res.grid_videos == {"frames": 5}
    rows = {r.name: r for r in res.configs}
    assert rows["gentle"].passed and not rows["rough"].passed
    assert any("of 5: PSNR" in reason for reason in rows["rough"].reasons), rows["rough"].reasons
    stored = np.load(run.stage_dir("benchmark") / res.images["baseline"][0]["npy"])
    assert stored.shape == (5, 8, 8, 3)
    html = (build_report(run.path)).read_text()
    assert "a row of 5 frames" in html and "cases are videos of 5 frames" in html
    assert "cases are videos of 5 frames" in write_result_md(run.path).read_text()


def test_a_cfg_split_counts_as_verified_sharding_in_the_checklist():
    """A CFG-parallel plan splits the branches, not the sequence: its record is ``cfg_check``
    (degree 1, no sequence ``check``); the checklist read it as 'not recorded'."""
    from ditbook.records import Sharding, ShardingSummary, decode

    def verified(rec: dict) -> bool | None:
        return ShardingSummary.of(decode(Sharding, rec, "test")).verified

    rows = {"blocks": {"rows": [24, 24], "reference_rows": 48, "allowed": 24.0}}
    cfg = {"degree": 1, "check": None, "error": None, "kinds": {}, "ranks": [], "split_cfg": True,
           "cfg_check": {"degree": 2, "per_list": rows}}
    assert verified(cfg) is True
    assert verified({**cfg, "cfg_check": None}) is False  # split unproven
    assert verified({"degree": 1, "check": None, "error": None, "ranks": []}) is None


# -- the five stages on the video reference card ----------------------------------------------
# make-test-sized: one prompt, one seed, 6 steps (the fewest where the SCM grid's mask skips a
# step), one cache strategy with one configuration and one held-out try, one two-process plan,
# one timed call (the image reference's LIGHT settings in tests/test_playbook.py, through the
# same overrides)
VIDEO_LIGHT = {
    "device": "cpu",
    "generation.prompts": ["a red circle moving right"],
    "generation.seeds": [0],
    "generation.steps": 6,
    "inspect.trace_steps": 1,
    "cache.strategies": ["scm"],
    "cache.max_configs": 1,
    "cache.confirm_tries": 1,
    "parallel.plans": ["cfg2"],
    "benchmark.repeats": 1,
    "benchmark.warmup": 0,
}


@pytest.mark.skipif(not (WEIGHTS / "model_index.json").is_file(),
                    reason="the video reference's weights are not in the repository yet "
                           "(models/video_reference/pipeline; train them with python -m ditbook.zoo.train_video_reference)")
def test_five_stages_on_the_video_reference(tmp_path, monkeypatch):
    from ditbook.card import gate_check
    from ditbook.approval import approve
    from ditbook.runner import run_stages, select_stages
    from ditbook.runs import RunFolder

    monkeypatch.delenv("DITBOOK_NOTEBOOKS", raising=False)
    # one torch thread in every stage kernel (they inherit the environment; torchrun's ranks get one
    # anyway): the model is tiny, and on a shared 2-core machine two threads per kernel spin
    # against each other (a 6-step clip took 1.2-4 s with two threads, 0.2-0.3 s with one)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # a copy of the card (its path made absolute), so approving the plan leaves the repository's card alone
    text = CARD.read_text().replace("path: video_reference/pipeline", f"path: {WEIGHTS}")
    card_path = tmp_path / "video_reference.yaml"
    card_path.write_text(text)
    lines: list[str] = []
    card = gate_check(card_path, VIDEO_LIGHT)
    run = RunFolder.create(card, tmp_path / "outputs", "video", VIDEO_LIGHT)
    first = run_stages(run, card, select_stages(["intake", "inspect"]), VIDEO_LIGHT, log=lines.append)
    assert first.ok, (first.failure, lines)
    approve(card, run.stage_dir("inspect") / "plan.json")
    card = gate_check(card_path, VIDEO_LIGHT)
    rest = run_stages(run, card, select_stages(["cache", "parallel", "benchmark"]), VIDEO_LIGHT, log=lines.append)
    assert rest.ok, (rest.failure, lines)
    assert run.read_meta()["status"] == "finished"

    # intake: the baseline is the whole video, its sheet a row of frames
    intake = run.read_results("intake")
    row = intake.images[0]
    assert row.frames == 9 and np.load(run.stage_dir("intake") / row.npy).shape == (9, 32, 32, 3)
    stored = load_images(run.stage_dir("intake"), intake.images)
    wrong = {k: np.concatenate([v[:1], v[:0:-1]]) for k, v in stored.items()}  # frames 1..8 reversed
    assert compare_sets({k: v[0] for k, v in wrong.items()}, {k: v[0] for k, v in stored.items()}).passed
    assert not compare_sets(wrong, stored).passed, "the stored baseline holds every frame, and they are judged"
    # cache and parallel: judged frame by frame (the set says how frames were reduced)
    cache = run.read_results("cache")
    judged = [s for s in cache.strategies if s.quality is not None and s.quality.n]
    assert any(s.skipped_fraction > 0 for s in judged), "a configuration that skips work was judged"
    assert all("min over its frames" in s.quality.frame_reduce for s in judged)
    assert all(q["frames"]["count"] == 9 for s in judged for q in s.quality.per_image.values())
    par = run.read_results("parallel")
    plan = par.plans[0]
    assert plan.name == "cfg2" and plan.passed, plan
    assert "min over its frames" in plan.quality.frame_reduce
    # benchmark: videos stated, grid of frames, report says so
    bench = json.loads((run.path / "benchmark" / "results.json").read_text())
    assert bench["video"]["frames"] == 9 and bench["grid_videos"] == {"frames": 9}
    assert bench["noise_floor"]["psnr_min"] == 100.0
    html = (run.path / "report.html").read_text()
    assert "a row of 9 frames" in html and "cases are videos of 9 frames" in html


def test_the_checklist_reads_each_parallel_kinds_own_record():
    """tp / te / vae plans prove their split in ``kinds`` (no sequence check): the checklist counts
    that as verified, a kind's error or a kind left unchecked as failed, and a plan that splits nothing
    as not recorded (the parallel stage's per-plan record, ``records.ShardingSummary``)."""
    from ditbook.records import Sharding, ShardingSummary, decode

    def block_sequence_lengths(rec: dict) -> dict:
        return ShardingSummary.of(decode(Sharding, rec, "test")).to_dict()

    tp = {"degree": 1, "check": None, "error": None, "ranks": [],
          "kinds": {"tp": {"check": {"sharded_weights": 44, "local_weight_elements": [8, 8]}, "error": None}}}
    assert block_sequence_lengths(tp)["verified"] is True
    broken = {**tp, "kinds": {"tp": {"check": None, "error": "TensorParallelNoOp: nothing sharded"}}}
    assert block_sequence_lengths(broken)["verified"] is False
    silent = {**tp, "kinds": {"tp": {"check": None, "error": None}}}
    assert block_sequence_lengths(silent)["verified"] is False
    assert block_sequence_lengths({**tp, "kinds": {}})["verified"] is None
