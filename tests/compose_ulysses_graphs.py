"""Run by ``tests/test_compose.py`` under torchrun (2 gloo processes): cache-dit's Ulysses with a
static cache schedule, regional compile (eager backend) and graphs of the computed steps through a
capturer that replays like a graph — the units must be found under the context-parallel hooks, the
replayed images must equal the un-graphed ones, the ranks must agree on every cache decision."""

import json
import sys

import torch
import torch.distributed as dist

from ditbook.cp.cache_sync import static_schedule
from ditbook.accel.graphs import install_cached_step_graphs
from ditbook.parallel.worker import compile_repeated_blocks
from speedsuite.fullsize import flux_pipeline
from speedsuite.schedules import ditbook_schedule
from speedsuite.worker import _ulysses_with_schedule
from test_graphs import ReplayLikeAGraph

dist.init_process_group("gloo")
fp = flux_pipeline("tiny", "cpu", torch.float32, height=32, width=32, steps=12, text_tokens=16)
# the reference model's chosen schedule is for 28 steps (and is refused for 12): a 12-step one of its kind
_ulysses_with_schedule(fp, 2, ditbook_schedule(12, warmup=4, computed=10, taylorseer_order=1))
with torch.inference_mode():
    ref = fp(seed=0).images[0]
    compile_repeated_blocks(fp.pipe.transformer, backend="eager")
    g = install_cached_step_graphs(fp.pipe.transformer, static_schedule(fp.schedule.mask), steps=12,
                                   capturer=ReplayLikeAGraph())
    got = fp(seed=0).images[0]
    again = fp(seed=0).images[0]
if dist.get_rank() == 0:
    out = {"graphs": g.to_dict(), "max_diff": max((got - ref).abs().max().item(), (again - ref).abs().max().item()),
           "agreement": fp.agreement.to_dict(), "computed": fp.schedule.computed}
    open(sys.argv[1], "w").write(json.dumps(out))
dist.destroy_process_group()
