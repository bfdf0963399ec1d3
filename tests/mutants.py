"""Plant one-line bugs, one at a time, in a copy of the repository and check that the tests kill them.

    python tests/mutants.py --all      # every mutation (an hour and more)
    python tests/mutants.py aux_detach clip_none   # some
    python tests/mutants.py --check    # only check that every target string is still there

Each mutation is (file, old, new) applied by exact string replacement: a target that is missing or not
unique fails loudly, so a moved line is noticed (update the triple when the code is reshaped). The
tests run in the copy with PYTHONPATH pointing at it; a mutation is "killed" when they fail.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the step's update, as train/step.py writes it (a mutant moves its ZeRO gather)
STEP_ORDER = """\
        if optimizer_step is None:
            backward_and_finish()
            with probes.span("optimizer", "optimizer.step"):
                self.optimizer.step()
        else:  # the update comes after the closure inside (no span of its own here)
            optimizer_step(backward_and_finish)
        result, counts = finished[0]
        # zero > 0: each rank updated its own rows, which every rank now gathers
        self.engine.gather_params()
"""

# name: (file, old, new, pytest arguments)
MUTATIONS = {
    # the ZeRO-3 bench table: a time target decided the wrong way round
    "bench_zero3_target_flipped": ("lightning_titan/tools/bench/zero3_report.py",
                                   '                "met": step.at_most(target),\n',
                                   '                "met": step.at_least(target),\n',
                                   ["tests/distributed/test_bench.py", "-k", "zero3_table"]),
    # the ZeRO-3 bench table: every part's share against the optimizer state's
    "bench_zero3_one_kind": ("lightning_titan/tools/bench/zero3_report.py",
                             "ratios, ideals = optimizer_shares(zero0, zero3, row, kind)",
                             "ratios, ideals = optimizer_shares(zero0, zero3, row)",
                             ["tests/distributed/test_bench.py", "-k", "zero3_table"]),
    # the FSDP2 ZeRO-3 peer keeps its blocks gathered from forward to backward (ZeRO-2's)
    "bench_fsdp2_zero3_not_resharded": ("lightning_titan/tools/bench/worker.py",
                                        "reshard_after_forward=impl == FSDP2_ZERO3",
                                        "reshard_after_forward=False",
                                        ["tests/distributed/test_bench.py", "-k", "quick_runs_end"]),
    # selective recompute: no hook on the consumer's output, so nothing refills the freed storage
    "selective_no_restore": ("lightning_titan/model/recompute.py",
                             "        consumer_out.register_hook(self._restore)\n",
                             "        pass\n",
                             ["tests/unit/test_selective_recompute.py", "-k", "keeping_everything"]),
    # selective recompute: the outputs' storage never freed (the same numbers, nothing saved)
    "selective_not_freed": ("lightning_titan/model/recompute.py",
                            "                storage.resize_(0)\n",
                            "                pass\n",
                            ["tests/unit/test_selective_recompute.py", "-k", "saves"]),
    # the norm's output left in fp32 under bf16 autocast: the projections save bf16 copies of it
    "selective_norm_fp32": ("lightning_titan/model/attention.py",
                            "(self.weight * n).to(dtype)",
                            "(self.weight * n)",
                            ["tests/unit/test_selective_recompute.py", "-k", "bf16"]),
    # the saved-tensor meter never reads a freed storage's size again: its peak counts it still
    "meter_no_reread": ("lightning_titan/runtime/saved_tensors.py",
                        "        if self._resizes_seen != _resizes:",
                        "        if False:",
                        ["tests/unit/test_selective_recompute.py", "-k", "saves"]),
    # compile under a B/W split schedule keeps the compiled backwards' buffers donated
    "compile_donated_buffers": ("lightning_titan/model/compiled.py",
                                "        torch._functorch.config.donated_buffer = False\n",
                                "        pass\n",
                                ["tests/distributed/test_compile.py", "-k", "layouts"]),
    # compile=True leaves the blocks' attention regions eager
    "compile_attention_eager": ("lightning_titan/model/compiled.py",
                                "                module.attend = torch.compile(module.attend, **options)  # type: ignore[method-assign]\n",
                                "                pass\n",
                                ["tests/distributed/test_compile.py", "-k", "one_process"]),
    # the experts' activation compiled with a fixed row count: a new count compiles another graph
    "compile_gated_static": ("lightning_titan/model/compiled.py",
                             "    compiled_gated = torch.compile(gated, dynamic=True, **options)\n",
                             "    compiled_gated = torch.compile(gated, **options)\n",
                             ["tests/distributed/test_compile.py", "-k", "one_process"]),
    # issue 20: the planner's state model cuts the vocabulary without Megatron's padding
    "plan_vocab_unpadded": ("lightning_titan/plan/memory.py",
                            "shape[t.tp_dim] = padded_vocab(shape[t.tp_dim], dims.tp) // dims.tp",
                            "shape[t.tp_dim] = shape[t.tp_dim] // dims.tp",
                            ["tests/distributed/test_equivalence.py", "-k", "2]"]),
    # issue 20: the planner offers layouts whose data ranks do not divide the global batch
    "plan_batch_unchecked": ("lightning_titan/plan/layouts.py",
                             '        local_batch_size(batch, dims.data_world, f"dp*ep={dims.dp}*{dims.ep}")\n',
                             "",
                             ["tests/cli/test_plan.py"]),
    # issue 20: the planner splits every ZeRO shard over the expert-DP group
    "plan_zero_group": ("lightning_titan/plan/memory.py",
                        "n, q = places.setdefault(kind, group_place(dims, kind))",
                        'n, q = places.setdefault(kind, group_place(dims, "expert_dp"))',
                        ["tests/distributed/test_equivalence.py", "-k", "2]"]),
    # issue 20: the pipeline bubble as (pp-1)/M, not (pp-1)/(M+pp-1)
    "plan_bubble": ("lightning_titan/plan/cost.py", "return fill / (m + fill)",
                    "return fill / m", ["tests/cli/test_plan.py", "-k", "bubble"]),
    # issue 20: ZeRO-2 charged a full all-reduce beside its all-gather
    "plan_zero2_bytes": ("lightning_titan/plan/cost.py", "2: (1.0, 1.0), 3:", "2: (2.0, 1.0), 3:",
                         ["tests/cli/test_plan.py", "-k", "cost_terms"]),
    # issue 20: a ring collective charged n/(n-1) too much (the whole data per rank)
    "plan_ring_bytes": ("lightning_titan/plan/cost.py",
                        "units * (n - 1) / n * nbytes / link.bandwidth",
                        "units * nbytes / link.bandwidth", ["tests/cli/test_plan.py", "-k", "collectives"]),
    # issue 20: the gradient reduction priced as if over 2 ranks whatever dp is
    "plan_dp_group": ("lightning_titan/plan/cost.py",
                      "total += reduction(device, degrees, varying, nbytes, grads, buckets)",
                      'total += reduction(device, degrees, ("cp",), nbytes, grads, buckets)',
                      ["tests/cli/test_plan.py", "-k", "cost_terms"]),
    # issue 20: every group on the intra-node link, whatever --nodes says
    "plan_one_node": ("lightning_titan/plan/cost.py", "span > device.per_node else",
                      "span > 10**9 else", ["tests/unit/test_plan_scale.py", "-k", "span_nodes"]),
    # issue 20: rows ranked by state instead of predicted step time
    "plan_rank_by_state": ("lightning_titan/plan/rank.py",
                           "return r.cost.step, r.candidate.state_bytes",
                           "return r.candidate.state_bytes, r.cost.step",
                           ["tests/cli/test_plan.py", "-k", "ranked or overlay"]),
    # issue 20: --nodes that does not divide the devices accepted
    "plan_nodes_unchecked": ("lightning_titan/plan/devices.py", "if nodes < 1 or devices % nodes:",
                             "if nodes < 1:", ["tests/cli/test_plan.py", "-k", "bad_requests"]),
    # issue 20: the fullest rank taken from the last rank of every group (ZeRO's smallest rows)
    "plan_fullest_last": ("lightning_titan/plan/memory.py",
                          "firsts = [dims.rank_of(0, p, 0) for p in range(dims.pp)]",
                          "firsts = [dims.rank_of(dims.dp - 1, p, dims.ep - 1) for p in range(dims.pp)]",
                          ["tests/cli/test_plan.py", "-k", "fullest"]),
    # issue 20: 1F1B's activations counted like GPipe's (every microbatch held)
    "plan_1f1b_holds_all": ("lightning_titan/plan/activations.py", "return min(m, pp - pp_rank)",
                            "return m", ["tests/cli/test_plan.py", "-k", "activation_peaks", "-m", "slow"]),
    # the planner meters bf16-mixed activations as fp32 (no autocast in its probe)
    "plan_bf16_as_fp32": ("lightning_titan/plan/precision.py",
                          'return torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.mixed)',
                          'return torch.autocast("cpu", dtype=torch.bfloat16, enabled=False)',
                          ["tests/cli/test_plan.py", "-k", "bf16_activation"]),
    # the planner prices bf16-mixed payloads (EP, PP, CP, TP's reduce-scatter) as fp32
    "plan_bf16_wire_fp32": ("lightning_titan/plan/precision.py", "return 2 if self.mixed else 4",
                            "return 4", ["tests/cli/test_plan.py", "-k", "bf16_prices"]),
    # the planner keeps one copy of each expert's bf16 weights per step, not per held microbatch
    "plan_expert_copies_once": ("lightning_titan/plan/activations.py",
                                "held(options, pp, p) * layers[p] * (block * m / share + expert_copies)",
                                "held(options, pp, p) * layers[p] * block * m / share + layers[p] * expert_copies",
                                ["tests/cli/test_plan.py", "-k", "bf16_activation"]),
    # issue 16: ZeRO-1 without its all-gather (other ranks' rows never arrive), through the strategy
    "zero_no_gather": ("lightning_titan/train/step.py",
                       "        self.engine.gather_params()\n",
                       "",
                       ["tests/distributed/test_strategy_step.py"]),
    # automatic optimization: the step forgets the MoE layers' counts of Lightning's closure, so the
    # expert bias never moves
    "auto_bias_uncounted": ("lightning_titan/train/step.py",
                            "                counts = take_step_counts(self.engine.module)",
                            "                counts = StepCounts()",
                            ["tests/distributed/test_strategy.py", "-k", "automatic_optimization"]),
    # the step's order: ZeRO's gather before the optimizer step (the update's rows never reach the
    # other ranks), caught by the equivalence suite, which runs the step users run
    "step_gather_before_update": ("lightning_titan/train/step.py",
                                  STEP_ORDER,
                                  STEP_ORDER.replace("        self.engine.gather_params()\n", "").replace(
                                      "backward_and_finish()\n            with",
                                      "backward_and_finish()\n            self.engine.gather_params()\n"
                                      "            with"),
                                  ["tests/distributed/test_equivalence.py", "-k", "2]"]),
    # ZeRO-1: the gather puts each rank's updated rows in another rank's place (engine layouts)
    "zero_gather_misplaced": ("lightning_titan/parallel/dp/zero.py",
                              "rows = s.rows(s.param.data, q)",
                              "rows = s.rows(s.param.data, n - 1 - q)",
                              ["tests/distributed/test_equivalence.py", "-k", "2"]),
    # ZeRO: every rank packs its rows into rank 0's chunk of the all-gather buffer
    "zero_pack_first_slot": ("lightning_titan/parallel/dp/zero.py",
                             "buffer.as_strided(sh, st, base + me * self.slot + at)",
                             "buffer.as_strided(sh, st, base + at)",
                             ["tests/distributed/test_equivalence.py", "-k", "2"]),
    # ZeRO: the unpack leaves out the rank after this one as well as this rank's own rows
    "zero_unpack_skips_next": ("lightning_titan/parallel/dp/zero.py",
                               "for lo, hi in ((0, me), (me + 1, n)):",
                               "for lo, hi in ((0, me), (me + 2, n)):",
                               ["tests/distributed/test_equivalence.py", "-k", "2"]),
    # ZeRO on gloo: the all-gather's broadcasts all from the group's first rank
    "gather_one_root": ("lightning_titan/parallel/collectives.py",
                        "group=group, group_src=q, async_op=True",
                        "group=group, group_src=0, async_op=True",
                        ["tests/distributed/test_equivalence.py", "-k", "2"]),
    # ZeRO-1 checkpoint rows saved at another rank's offset
    "zero_ckpt_rows": ("lightning_titan/parallel/dp/zero.py",
                       "start, stop = owned_rows(p.shape[dim], self.n, self.q)",
                       "start, stop = owned_rows(p.shape[dim], self.n, self.n - 1 - self.q)",
                       ["tests/distributed/test_checkpoint.py", "-k", "save_under_one"]),
    # ZeRO-2: the rank-major bucket interleaves the ranks' rows instead of keeping each block whole
    "zero2_rows_interleaved": ("lightning_titan/parallel/dp/zero_grads.py",
                               "grad.unflatten(shard.dim, (n, shard.size // n)).movedim(shard.dim, 0)",
                               "grad.unflatten(shard.dim, (shard.size // n, n)).movedim(shard.dim + 1, 0)",
                               ["tests/distributed/test_reducer.py", "-k", "four_gloo"]),
    # ZeRO-2: the full grads stay after their rows went into the bucket (no memory saved)
    "zero2_full_grads_kept": ("lightning_titan/parallel/dp/zero_grads.py",
                              "        param.grad = None  # ZeRO-2",
                              "        pass  # ZeRO-2",
                              ["tests/distributed/test_equivalence.py", "-k", "2"]),
    # ZeRO-3: a block's backward runs on its freed parameters (no gather on its output's grad)
    "zero3_no_regather": ("lightning_titan/parallel/dp/zero3.py",
                          "x.register_hook(lambda grad: self._backward_starts(unit))",
                          "x.register_hook(lambda grad: None)",
                          ["tests/distributed/test_zero3.py", "-k", "equals and 2"]),
    # ZeRO-3: a block stays whole after its forward (every block whole by the forward's end)
    "zero3_kept_after_forward": ("lightning_titan/parallel/dp/zero3.py",
                                 "            else:\n                self.release(unit)\n",
                                 "            else:\n                pass\n",
                                 ["tests/distributed/test_zero3.py", "-k", "equals and 2"]),
    # ZeRO-3: the last block freed after its forward and gathered again for its backward
    "zero3_last_block_not_kept": ("lightning_titan/parallel/dp/zero3.py",
                                  "            if backward and unit == len(self.blocks) - 1:",
                                  "            if False:",
                                  ["tests/distributed/test_zero3.py", "-k", "equals and 2"]),
    # ZeRO-3: the last block kept through the next microbatch's forward (gpipe: a third block whole)
    "zero3_kept_through_next_forward": ("lightning_titan/parallel/dp/zero3.py",
                                        "                self.release(self.kept)  # another forward",
                                        "                pass  # another forward",
                                        ["tests/distributed/test_zero3.py", "-k", "equals and 2"]),
    # ZeRO-3 prefetch: the first block gathered at its use (not under the embedding)
    "zero3_no_first_prefetch": ("lightning_titan/parallel/dp/zero3.py",
                                "            self.prefetch(0)  # under the embedding",
                                "            pass  # under the embedding",
                                ["tests/distributed/test_zero3.py", "-k", "equals and 2"]),
    # ZeRO-3: a block stays whole after its backward
    "zero3_kept_after_backward": ("lightning_titan/parallel/dp/zero3.py",
                                  "        ctx.release()\n",
                                  "        pass\n",
                                  ["tests/distributed/test_zero3.py", "-k", "equals and 2"]),
    # ZeRO-3 under activation checkpointing: the recompute frees its block before the backward
    "zero3_recompute_released": ("lightning_titan/parallel/dp/zero3.py",
                                 "            if self.in_backward[unit]:  # the recompute",
                                 "            if False:  # the recompute",
                                 ["tests/distributed/test_zero3.py", "-k", "equals and 2"]),
    # ZeRO-3 prefetch: the forward gathers each block when it runs (no next block in flight)
    "zero3_no_forward_prefetch": ("lightning_titan/parallel/dp/zero3.py",
                                  "                self.prefetch(unit + 1)",
                                  "                pass",
                                  ["tests/distributed/test_zero3.py", "-k", "equals and 2"]),
    # ZeRO-3 prefetch: the backward gathers each block when it runs
    "zero3_no_backward_prefetch": ("lightning_titan/parallel/dp/zero3.py",
                                   "        self.prefetch(unit - 1)",
                                   "        pass",
                                   ["tests/distributed/test_zero3.py", "-k", "equals and 2"]),
    # ZeRO-3 prefetch: activation checkpointing's recompute prefetches the next block (freed by
    # then: a wasted gather, a third block whole)
    "zero3_recompute_prefetches": ("lightning_titan/parallel/dp/zero3.py",
                                   "            if not recompute:",
                                   "            if True:",
                                   ["tests/distributed/test_zero3.py", "-k", "equals and 2"]),
    # ZeRO-3 prefetch: the prefetched block counted whole at its issue (read before it is waited
    # and copied out)
    "zero3_prefetch_not_waited": ("lightning_titan/parallel/dp/zero3.py",
                                  "        self.pending = (unit, [start_gather(g, unit) for g in self.groups])\n",
                                  "        self.pending = (unit, [start_gather(g, unit) for g in self.groups])\n"
                                  "        self.gathered[unit] = True\n",
                                  ["tests/distributed/test_zero3.py", "-k", "equals and 2"]),
    # ZeRO-3 prefetch: a unit's buckets gathered through the same slice of the buffer (in flight
    # at once, they overwrite each other)
    "zero3_unit_buckets_overlap": ("lightning_titan/parallel/dp/zero.py",
                                   "b.bind(buffer[at : at + b.slot * self.n], self.q)",
                                   "b.bind(buffer[: b.slot * self.n], self.q)",
                                   ["tests/distributed/test_zero3.py", "-k", "equals and 2"]),
    # ZeRO-3: a checkpoint loaded into the whole parameters, the leaves (what trains) left as they were
    "zero3_load_rows_not_taken": ("lightning_titan/train/engine.py",
                                  "            self.sharded_params.take_rows()  # bf16 weights: not the masters' rows (a load's)\n",
                                  "            pass\n",
                                  ["tests/distributed/test_zero3.py", "-k", "equals and 2"]),
    # ZeRO-3: the engine taken off the model (teardown) leaves it as rows only (a later use reads
    # freed parameters)
    "zero3_removed_as_rows": ("lightning_titan/train/engine.py",
                              "            if self.masters is None:\n                self.sharded_params.gather_all()\n",
                              "            if self.masters is None:\n                pass\n",
                              ["tests/distributed/test_zero3.py", "-k", "equals and 2"]),
    # ZeRO-3: the stage's embedding and head stay whole between steps
    "zero3_rest_kept": ("lightning_titan/train/engine.py",
                        "            self.sharded_params.release_all()\n        for g",
                        "            pass\n        for g",
                        ["tests/distributed/test_zero3.py", "-k", "equals and 2"]),
    # ZeRO-3 under a pipeline: each block freed after its forward as at pp=1 (gathered again in the
    # backward: the stage is not whole through the step)
    "zero3_pp_blocks_freed": ("lightning_titan/parallel/dp/zero3.py",
                              "enumerate(self.blocks if reshard_after_forward else ())",
                              "enumerate(self.blocks)",
                              ["tests/distributed/test_zero3.py", "-k", "equals and 4"]),
    # ZeRO-3 under a pipeline: the stage freed after a microbatch's forward (a later backward reads
    # freed parameters)
    "zero3_pp_freed_after_forward": ("lightning_titan/parallel/dp/zero3.py",
                                     "        self.reshard_after_forward = reshard_after_forward\n",
                                     "        self.reshard_after_forward = reshard_after_forward\n"
                                     "        stage.register_forward_hook(lambda *_: None if "
                                     "reshard_after_forward else self.release_all())\n",
                                     ["tests/distributed/test_zero3.py", "-k", "equals and 4"]),
    # ZeRO-3 under DualPipeV with dp x ep: the stage freed after each microbatch's forward (the
    # pair's backward reads freed parameters)
    "zero3_dualpipev_freed_after_forward": ("lightning_titan/parallel/dp/zero3.py",
                                            "        self.reshard_after_forward = reshard_after_forward\n",
                                            "        self.reshard_after_forward = reshard_after_forward\n"
                                            "        stage.register_forward_hook(lambda *_: None if "
                                            "reshard_after_forward else self.release_all())\n",
                                            ["tests/distributed/test_zero3.py", "-k", "equals and 8"]),
    # zero=3 compiled at pp=1: each block gathered by a hook on its first norm, inside the
    # compiled attention region (Dynamo traces the gather's collectives: graph breaks)
    "zero3_gathered_in_compiled_region": ("lightning_titan/parallel/dp/zero3.py",
                                          "block.register_forward_pre_hook(self._pre_block(u))",
                                          "block.attn_norm.register_forward_pre_hook(self._pre_block(u))",
                                          ["tests/distributed/test_compile.py", "-k", "layouts"]),
    # zero=3 compiled at pp=1: a block's backward finds its weights freed (the compiled graph reads
    # the parameters' storage, which the gather on its output's grad refills in place)
    "zero3_compiled_no_regather": ("lightning_titan/parallel/dp/zero3.py",
                                   "x.register_hook(lambda grad: self._backward_starts(unit))",
                                   "x.register_hook(lambda grad: None)",
                                   ["tests/distributed/test_compile.py", "-k", "layouts"]),
    # zero=3 compiled under a pipeline: the stage freed after each forward (the compiled backwards
    # read freed weights)
    "zero3_compiled_pp_freed": ("lightning_titan/parallel/dp/zero3.py",
                                "        self.reshard_after_forward = reshard_after_forward\n",
                                "        self.reshard_after_forward = reshard_after_forward\n"
                                "        stage.register_forward_hook(lambda *_: None if "
                                "reshard_after_forward else self.release_all())\n",
                                ["tests/distributed/test_compile.py", "-k", "layouts"]),
    # ZeRO-3 under a pipeline: the optimizer's rows a second copy beside the whole stage in the step
    "zero3_pp_leaves_copied": ("lightning_titan/parallel/dp/zero3.py",
                               "leaves_in_place=not self.reshard_after_forward",
                               "leaves_in_place=False",
                               ["tests/distributed/test_zero3.py", "-k", "equals and 4"]),
    # ZeRO-3 under a pipeline: freeing the stage leaves the leaves views of the freed storage
    "zero3_pp_leaf_view_freed": ("lightning_titan/parallel/dp/zero3.py",
                                 "            if not s.dense:\n                s.leaf.data = s.leaf.data.clone(",
                                 "            if False:\n                s.leaf.data = s.leaf.data.clone(",
                                 ["tests/distributed/test_zero3.py", "-k", "equals and 4"]),
    # ZeRO-3: an evaluation leaves the parameters it gathered whole until the next step
    "zero3_eval_kept": ("lightning_titan/train/engine.py",
                        "  # zero=3: its rows only again, as between steps\n            self.sharded_params.release_all()\n",
                        "  # zero=3: its rows only again, as between steps\n            pass\n",
                        ["tests/distributed/test_zero3.py", "-k", "equals and 2"]),
    # the planner: zero=3 at pp=1 priced as gathering once a step (not each block twice a microbatch)
    "plan_zero3_gathers_once": ("lightning_titan/plan/cost.py",
                                "gathers = (2.0 * m_count * counts[0] - kept) / counts[0]",
                                "gathers = 1.0",
                                ["tests/cli/test_plan.py", "-k", "zero3"]),
    # the planner: zero=3 at pp=1 priced as gathering the last block for its backward again
    "plan_zero3_last_block_gathered": ("lightning_titan/plan/cost.py",
                                       "        kept = m_count if options.schedule == \"1f1b\" else 1\n",
                                       "        kept = 0\n",
                                       ["tests/cli/test_plan.py", "-k", "zero3"]),
    # the planner: zero=3 under gpipe priced as keeping every microbatch's last block (1f1b's)
    "plan_zero3_gpipe_keeps_each": ("lightning_titan/plan/cost.py",
                                    "        kept = m_count if options.schedule == \"1f1b\" else 1\n",
                                    "        kept = m_count\n",
                                    ["tests/cli/test_plan.py", "-k", "zero3"]),
    # the planner: zero >= 2 priced as cutting every microbatch's grads into the rows at once
    "plan_step_grads_not_accumulated": ("lightning_titan/plan/memory.py",
                                        "    if zero < 2 or not accumulating:\n        return 0\n",
                                        "    return 0\n",
                                        ["tests/distributed/test_zero3.py", "-k", "equals and 2"]),
    # the planner: a step of one microbatch priced as accumulating its grads whole
    "plan_step_grads_one_microbatch": ("lightning_titan/plan/memory.py",
                                       "    if zero < 2 or not accumulating:\n        return 0\n",
                                       "    if zero < 2:\n        return 0\n",
                                       ["tests/distributed/test_zero3.py", "-k", "equals and 2"]),
    # the planner: zero <= 1 priced as accumulating whole grads beside its buckets
    "plan_step_grads_zero1_accumulated": ("lightning_titan/plan/memory.py",
                                          "    if zero < 2 or not accumulating:\n        return 0\n",
                                          "    if not accumulating:\n        return 0\n",
                                          ["tests/distributed/test_equivalence.py", "-k", "2"]),
    # zero <= 1: the backwards under no_sync() accumulate on the parameters (a second copy)
    "reducer_no_sums_in_buckets": ("lightning_titan/parallel/dp/reducer.py",
                                   "                if self.sums_in_buckets and bucket.buffer is not None:",
                                   "                if False:",
                                   ["tests/distributed/test_equivalence.py", "-k", "2"]),
    # zero <= 1: the last backward's grad left out of the bucket's sum
    "reducer_sum_without_last": ("lightning_titan/parallel/dp/reducer.py",
                                 "                self._slice(bucket, slot).add_(param.grad)\n",
                                 "                pass\n",
                                 ["tests/distributed/test_equivalence.py", "-k", "2"]),
    # the planner: bf16 weights priced as accumulating fp32 grads
    "plan_step_grads_fp32_accumulated": ("lightning_titan/plan/memory.py",
                                         "            total += (BF16_BYTES if masters else t.itemsize)",
                                         "            total += (BYTES if masters else t.itemsize)",
                                         ["tests/distributed/test_bf16_master.py"]),
    # the planner: a grad no group reduces priced as accumulated beside the state's
    "plan_step_grads_trivial_group": ("lightning_titan/plan/memory.py",
                                      "group_place(dims, t.kind)[0]) > 1:",
                                      "group_place(dims, t.kind)[0]) > 0:",
                                      ["tests/distributed/test_zero3.py", "-k", "equals and 2"]),
    # zero <= 1: the reduced grads copied out of the buckets (a second copy of the step's grads)
    "reducer_grads_copied_out": ("lightning_titan/parallel/dp/reducer.py",
                                 "            p.grad = None if flags[slot] == 0 else self._slice(bucket, slot)",
                                 "            p.grad = None if flags[slot] == 0 else self._slice(bucket, slot).clone()",
                                 ["tests/distributed/test_equivalence.py", "-k", "2"]),
    # zero <= 1: a grad kept on its parameter once its bucket has taken it
    "reducer_grad_kept_after_fill": ("lightning_titan/parallel/dp/reducer.py",
                                     "                param.grad = None  # the bucket holds it now; the reduced grad",
                                     "                pass  # the bucket holds it now; the reduced grad",
                                     ["tests/distributed/test_equivalence.py", "-k", "2"]),
    # the planner: zero=3 at pp=1 priced as one block whole in the step (the prefetched one left out)
    "plan_zero3_no_prefetch": ("lightning_titan/plan/memory.py",
                               "    return rest + sum(sorted(units.values())[-2:])\n",
                               "    return rest + max(units.values(), default=0)\n",
                               ["tests/cli/test_plan.py", "-k", "zero3_prices"]),
    # the planner: zero=3 at pp=1 priced as holding the whole stage in the step
    "plan_zero3_whole_stage": ("lightning_titan/plan/memory.py",
                               "    rest = units.pop(\"\", 0)\n    return rest + sum(sorted(units.values())[-2:])\n",
                               "    return sum(units.values())\n",
                               ["tests/cli/test_plan.py", "-k", "zero3"]),
    # the planner: zero=3's parameters priced whole between steps (as zero=2's)
    "plan_zero3_rows_whole": ("lightning_titan/plan/memory.py",
                              "        held = owned if zero == 3 else numel\n",
                              "        held = numel\n",
                              ["tests/cli/test_plan.py", "-k", "zero3"]),
    # ZeRO-3: the full parameters' storage is never freed (no memory saved)
    "zero3_storage_kept": ("lightning_titan/parallel/dp/zero3.py",
                           "        s.param.data.untyped_storage().resize_(0)\n    group.dense_shards",
                           "        pass\n    group.dense_shards",
                           ["tests/distributed/test_zero3.py", "-k", "equals and 2"]),
    # ZeRO-3: the gather writes through views autograd versions (a backward after a re-gather sees
    # its saved weights modified in place)
    "zero3_views_versioned": ("lightning_titan/parallel/dp/zero.py",
                              "self.own = [s.rows(s.param.data) for s in shards]",
                              "self.own = [s.rows(s.param.detach()) for s in shards]",
                              ["tests/distributed/test_zero3.py", "-k", "equals and 2"]),
    # ZeRO-2 / TP on two gloo ranks: the sum adds the chunk sent away, not this rank's own
    "reduce_scatter_pair_sum": ("lightning_titan/parallel/collectives.py",
                                "pending = _SumOnWait(work, output, None, own=chunks[me])",
                                "pending = _SumOnWait(work, output, None, own=chunks[1 - me])",
                                ["tests/distributed/test_reducer.py", "-k", "four_gloo"]),
    # ZeRO-2: every bucket borrows the kept buffer, so buckets in flight overwrite each other's input
    "zero2_borrow_shared": ("lightning_titan/parallel/dp/zero_grads.py",
                            "if dtype not in self._borrower:",
                            "if True:",
                            ["tests/distributed/test_reducer.py", "-k", "four_gloo"]),
    # issue 41: ZeRO-2's finish() leaves the reduced rows unbound (the leaves the optimizer steps
    # and clipping scales get no grad)
    "zero2_leaf_grad_unwritten": ("lightning_titan/parallel/dp/zero_grads.py",
                                  "                shard.leaf.grad = (\n",
                                  "                _ = (\n",
                                  ["tests/distributed/test_reducer.py", "-k", "four_gloo"]),
    # issue 41: ZeRO-2's leaf grads overwritten before the step as if under ZeRO-1 (from the full
    # grads, which zero=2 dropped: no update)
    "zero2_bound_as_zero1": ("lightning_titan/train/engine.py",
                             "            elif self.zero == 1:\n",
                             "            else:\n",
                             ["tests/distributed/test_strategy_step.py"]),
    # issue 41: the hooks reduce inside no_sync() too (buckets fill from backwards that only accumulate)
    "no_sync_ignored": ("lightning_titan/parallel/dp/reducer.py",
                        "            if self._accumulating:\n",
                        "            if False:\n",
                        ["tests/distributed/test_reducer.py", "-k", "four_gloo"]),
    # ZeRO-2: a grad left whole counts in the norm on every rank of its group, not once
    "zero2_norm_replicas": ("lightning_titan/parallel/dp/zero_grads.py",
                            "counted.append(first)",
                            "counted.append(True)",
                            ["tests/distributed/test_reducer.py", "-k", "four_gloo"]),
    # ZeRO-2: the shards' squares summed over the expert-DP group only (non-expert rows under dp x ep)
    "zero2_norm_group": ("lightning_titan/parallel/dp/zero_grads.py",
                         "group=groups.sequence_dp, pp_group",
                         "group=groups.expert_dp, pp_group",
                         ["tests/distributed/test_equivalence.py", "-k", "4"]),
    # ZeRO-2 under TP: the shards' squares summed without the TP ranks (the norms' rows over tp)
    "zero2_norm_no_tp": ("lightning_titan/parallel/dp/zero_grads.py",
                         "group=groups.sequence_dp, pp_group",
                         "group=groups.non_expert_dp, pp_group",
                         ["tests/distributed/test_equivalence.py", "-k", "4"]),
    # ZeRO under TP: the TP-cut weights left whole (trains and saves right: only the state per rank
    # is larger than its share)
    "zero_tp_left_whole": ("lightning_titan/parallel/dp/zero.py",
                           "dim = cut_dim(p, id(p) in expert_ids, None if tp is None else tp.dim)",
                           "dim = None if tp is not None else cut_dim(p, id(p) in expert_ids)",
                           ["tests/distributed/test_equivalence.py", "-k", "4"]),
    # ZeRO under TP: a cut weight's state saved as rows of its TP slice under the global name (the
    # TP ranks' blocks collide: what the refusal of zero with tp stood for)
    "zero_tp_local_keys": ("lightning_titan/train/engine.py",
                           "tp_shards=cut_by_tp",
                           "tp_shards=None",
                           ["tests/distributed/test_checkpoint.py", "-k", "save_under_one"]),
    # ZeRO: the all-gather deferred to the next step's start (as an overlapped parameter gather
    # would be): every step trains right, but the checkpoint between steps holds other ranks' stale
    # rows, so a zero=2 run killed and resumed from `last` leaves the uninterrupted curve
    "zero_gather_deferred": ("lightning_titan/train/step.py",
                             "        finished: list[tuple[StepResult, StepCounts]] = []\n",
                             "        finished: list[tuple[StepResult, StepCounts]] = []\n        self.engine.gather_params()\n",
                             ["tests/distributed/test_reliability.py", "-k", "kill_9_loses_nothing and training"]),
    # the same bug through the CLI: a zero=1 checkpoint resumed under tp=4 x ep=2 at zero=2
    "zero_tp_local_keys_cli": ("lightning_titan/train/engine.py",
                               "tp_shards=cut_by_tp",
                               "tp_shards=None",
                               ["tests/cli/test_cli.py", "-k", "resume_under_another_layout"]),
    # ZeRO under TP: the 2-D block's placements swapped (the TP cut read as ZeRO's and back)
    "zero_tp_placements": ("lightning_titan/parallel/dp/zero.py",
                           "placements = [Shard(tp.dim), Shard(shard.dim)]",
                           "placements = [Shard(shard.dim), Shard(tp.dim)]",
                           ["tests/distributed/test_checkpoint.py", "-k", "save_under_one"]),
    # issue 21.1: the router losses become non-trainable in the stage objective
    "aux_detach": ("lightning_titan/train/objective.py",
                   "share = aux.sum() / self.local_sequences",
                   "share = aux.detach().sum() / self.local_sequences",
                   ["tests/distributed/test_reference.py"]),
    # the token loss normalised by the sequences instead of the tokens (every layout alike: only
    # the independent reference can tell)
    "loss_per_sequence": ("lightning_titan/train/objective.py",
                          "return share + loss_sum / self.tokens_per_data_rank, loss_sum",
                          "return share + loss_sum / self.local_sequences, loss_sum",
                          ["tests/distributed/test_reference.py"]),
    # an expert gradient twice too large (the expert reducer's scale)
    "expert_grad_x2": ("lightning_titan/train/engine.py",
                       "params, group, scale=scale, bucket_cap_mb",
                       "params, group, scale=2 * scale if params[0] is self.expert_params[0] else scale, bucket_cap_mb",
                       ["tests/distributed/test_reference.py"]),
    # issue 21.7: the same bug through the CLI (grad_norm of the ep configs against the single run)
    "expert_grad_x2_cli": ("lightning_titan/train/engine.py",
                           "params, group, scale=scale, bucket_cap_mb",
                           "params, group, scale=2 * scale if params[0] is self.expert_params[0] else scale, bucket_cap_mb",
                           ["tests/cli/test_cli.py", "-k", "single_process_curve"]),
    # issue 14: the sequence-parallel region's grads (norms, routers) not summed over the TP ranks
    "tp_norms_unreduced": ("lightning_titan/model/grad_kinds.py",
                           'EXPERT, TP_SHARDED, SEQUENCE = "expert_dp", "non_expert_dp", "sequence_dp"',
                           'EXPERT, TP_SHARDED, SEQUENCE = "expert_dp", "non_expert_dp", "non_expert_dp"',
                           ["tests/distributed/test_reference.py", "-k", "tp2"]),
    # issue 14: the aux loss's expert counts not summed over the sequence slices
    "tp_aux_local_counts": ("lightning_titan/model/moe/router.py",
                            "        _sum_over(assignments, sequence_group)\n",
                            "        pass\n",
                            ["tests/distributed/test_reference.py", "-k", "tp2"]),
    # issue 14: the padded vocabulary rows take part in the softmax
    "tp_padding_in_loss": ("lightning_titan/parallel/tensor_parallel.py",
                           'logits = logits.masked_fill(ids >= vocab_size, float("-inf"))',
                           "logits = logits.masked_fill(ids < 0, 0.0)",
                           ["tests/distributed/test_equivalence.py", "-k", "2"]),
    # issue 14: the optimizer state of a TP-cut weight saved as the rank's local tensor
    "tp_ckpt_local_state": ("lightning_titan/checkpoint/state.py",
                            "elif isinstance(value, Tensor) and id(full) in shards and value.shape == p.shape:",
                            "elif False:",
                            ["tests/distributed/test_checkpoint.py", "-k", "save_under_one"]),
    # issue 15: RoPE at the local order's positions instead of the tokens' global ones
    "cp_local_rope": ("lightning_titan/model/decoder.py",
                      "cos, sin, mask = cos[mine], sin[mine],",
                      "cos, sin, mask = cos[: mine.numel()], sin[: mine.numel()],",
                      ["tests/distributed/test_reference.py", "-k", "cp2"]),
    # issue 15: the aux losses' expert counts not summed over the CP ranks of a sequence
    "cp_local_counts": ("lightning_titan/model/decoder.py",
                        "            sequence_group=sequence_group,\n",
                        "            sequence_group=tp_group,\n",
                        ["tests/distributed/test_equivalence.py", "-k", "2"]),
    # issue 14: the norm counts the TP copies of the norms and routers on every TP rank
    "tp_norm_counts_copies": ("lightning_titan/parallel/mesh.py",
                              'if a in self.group_axes(kind))',
                              'if a in self.group_axes(kind) and (kind, a) != ("sequence_dp", "tp"))',
                              ["tests/distributed/test_reference.py", "-k", "tp2"]),
    # composed clipping: the per-dtype norms summed unsquared
    "clip_norms_unsquared": ("lightning_titan/parallel/dp/clipping.py",
                             "return torch.stack(norms).square().sum()",
                             "return torch.stack(norms).sum()",
                             ["tests/distributed/test_reducer.py"]),
    # ZeRO-2 clipping: every rank counts the grads left whole, not the group's first rank only
    "clip_shards_all_counted": ("lightning_titan/parallel/dp/clipping.py",
                                "_local_sq_norm([g for g, c in zip(grads, counted, strict=True) if c], device)",
                                "_local_sq_norm(grads, device)",
                                ["tests/distributed/test_reducer.py"]),
    # zero>0 takes an optimizer whose update of an element reads the whole tensor
    "zero_probe_off": ("lightning_titan/parallel/dp/zero.py",
                       "        if not same:\n",
                       "        if False:\n",
                       ["tests/distributed/test_strategy.py", "-k", "whole_tensor"]),
    # an optimizer that steps strided views wrongly (AdamW(fused=True)) still gets views of an
    # expert's rows: it updates other elements and writes into the neighbouring rank's rows
    "zero_fused_strided_leaves": ("lightning_titan/parallel/dp/zero.py",
                                  "    if not steps_strided_views(optimizer):\n",
                                  "    if False:\n",
                                  ["tests/distributed/test_equivalence.py", "-k", "2]"]),
    # gpt-oss: the sink key's logit not divided by the attention's scale
    "sink_unscaled": ("lightning_titan/model/sinks.py",
                      "sink = (sinks_H.to(k.dtype) / scale)",
                      "sink = (sinks_H.to(k.dtype))",
                      ["tests/unit/test_sinks.py"]),
    # DeepSeek-V3: v keeps its own head dim, and the attention runs in the math kernel (S x S)
    "mla_v_unpadded": ("lightning_titan/model/mla.py",
                       "            t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v)\n",
                       "            t for t in (q, k, v)\n",
                       ["tests/unit/test_sinks.py"]),
    # the loss divided by every target, not the counted ones (IGNORE_INDEX counted)
    "objective_counts_ignored": ("lightning_titan/train/objective.py",
                                 "    count = (targets != IGNORE_INDEX).sum()\n",
                                 "    count = (targets == targets).sum()\n",
                                 ["tests/distributed/test_reference.py", "-k", "one_process"]),
    # the step's count of this rank alone, not the mean over the ranks (another on each data rank)
    "objective_local_count": ("lightning_titan/train/objective.py",
                              "        return (count.double() / dist.get_world_size()).clamp(min=1).float()\n",
                              "        return (count.double() * 0 + (targets != IGNORE_INDEX).sum()).clamp(min=1).float()\n",
                              ["tests/distributed/test_reference.py", "-k", "eight"]),
    # under TP an ignored target's loss is log(sum exp), added to the sum
    "vocab_parallel_ignored_counted": ("lightning_titan/parallel/tensor_parallel.py",
                                       "    return torch.where(targets == IGNORE_INDEX, 0.0, losses)\n",
                                       "    return losses\n",
                                       ["tests/distributed/test_reference.py", "-k", "tp2"]),
    # the reported loss divided by every token of the reporting ranks, not the counted ones
    "stage_reports_every_token": ("lightning_titan/parallel/pipeline/stage.py",
                                  "        self.counted = torch.stack([(t != IGNORE_INDEX).sum() for t in self.targets]).sum()\n",
                                  "        self.counted = torch.stack([(t == t).sum() for t in self.targets]).sum()\n",
                                  ["tests/distributed/test_reference.py", "-k", "one_process"]),
    # top-p drops the token that crosses the threshold (the nucleus must reach top_p)
    "generate_nucleus_short": ("lightning_titan/tools/decoding.py",
                               "    keep = sorted_probs.cumsum(0) - sorted_probs < top_p\n",
                               "    keep = sorted_probs.cumsum(0) < top_p\n",
                               ["tests/unit/test_generate.py"]),
    # generation reads the logits of the first position, not the last
    "generate_first_position": ("lightning_titan/tools/decoding.py",
                                "        return out[0, -1]\n",
                                "        return out[0, 0]\n",
                                ["tests/unit/test_generate.py"]),
    # the uncached window one token short of seq_len (the last token read without the first)
    "generate_window_short": ("lightning_titan/tools/decoding.py",
                              "            window, cache = torch.tensor([ids[-seq_len:]], device=device), None\n",
                              "            window, cache = torch.tensor([ids[-seq_len + 1 :]], device=device), None\n",
                              ["tests/unit/test_generate.py"]),
    # generation never uses its KV cache (right tokens, a whole forward each)
    "generate_cache_unused": ("lightning_titan/tools/decoding.py",
                              "        if cache is not None and len(ids) <= seq_len:  # the tokens the cache does not hold yet\n",
                              "        if False:\n",
                              ["tests/unit/test_generate.py", "-k", "cache"]),
    # the cache stops one token before it is full
    "generate_cache_short": ("lightning_titan/tools/decoding.py",
                             "        if cache is not None and len(ids) <= seq_len:  # the tokens the cache does not hold yet\n",
                             "        if cache is not None and len(ids) < seq_len:\n",
                             ["tests/unit/test_generate.py", "-k", "cache"]),
    # every rank of a layout builds (and loads) the next stage's layers, not its own
    "generate_layout_other_stage": ("lightning_titan/tools/generate_layout.py",
                                    "        pp_rank=dims.pp_rank,\n",
                                    "        pp_rank=(dims.pp_rank + 1) % pp,\n",
                                    ["tests/distributed/test_generate_on_ranks.py"]),
    # every EP rank holds (and loads) EP rank 0's experts
    "generate_layout_experts_of_rank0": ("lightning_titan/tools/generate_layout.py",
                                         "        ep_rank=dims.ep_rank,\n",
                                         "        ep_rank=0,\n",
                                         ["tests/distributed/test_generate_on_ranks.py"]),
    # a layout that takes exactly the machine's GPUs is refused
    "generate_layout_gpus_off_by_one": ("lightning_titan/tools/generate_layout.py",
                                        "    if gpus and pp * ep > gpus:\n",
                                        "    if gpus and pp * ep >= gpus:\n",
                                        ["tests/unit/test_generate_layout.py", "-k", "gpus"]),
    # a rank's failure printed without its cause (the traceback's last line)
    "generate_layout_error_without_cause": ("lightning_titan/tools/generate.py",
                                            '        why = lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"\n',
                                            "        why = lines[0]\n",
                                            ["tests/unit/test_generate_layout.py", "-k", "fails"]),
    # a stage loads from a checkpoint of another config whose shapes fit (rope_theta, top_k...)
    "stage_load_config_unchecked": ("lightning_titan/checkpoint/stage.py",
                                    '    check_config(path, info.get("model_config"), model)\n',
                                    "",
                                    ["tests/unit/test_generate_layout.py", "-k", "another_config"]),
    # the new token's RoPE from position 0, not after the held tokens
    "kv_cache_rope_restarts": ("lightning_titan/model/kv_cache.py",
                               "        return cos[positions], sin[positions], attend_mask(positions, keys, 0), window_mask\n",
                               "        return cos[:new], sin[:new], attend_mask(positions, keys, 0), window_mask\n",
                               ["tests/unit/test_generate.py", "-k", "every_family and cached"]),
    # gpt-oss's window layers see every held key when decoding with the cache
    "kv_cache_window_ignored": ("lightning_titan/model/kv_cache.py",
                                "        window_mask = attend_mask(positions, keys, window) if window else None\n",
                                "        window_mask = attend_mask(positions, keys, 0) if window else None\n",
                                ["tests/unit/test_generate.py", "-k", "gpt_oss-cached"]),
    # the cache counts no positions: every token is position 0 and sees the first key only
    "kv_cache_length_kept": ("lightning_titan/model/kv_cache.py",
                             "        self.length = end\n",
                             "        pass\n",
                             ["tests/unit/test_generate.py", "-k", "every_family and cached"]),
    # --chat asks without the assistant's header (the model continues the user's turn)
    "chat_reply_headless": ("lightning_titan/data/chat.py",
                            "    return user + tokenizer.encode(_header(\"assistant\"))\n",
                            "    return user\n",
                            ["tests/unit/test_chat_data.py", "-k", "reply"]),
    # --chat in a tokenizer's own template without its generation prompt
    "chat_template_no_generation_prompt": ("lightning_titan/data/chat.py",
                                           "        return [int(i) for i in _apply(tokenizer, turns, generation_prompt=True)]\n",
                                           "        return [int(i) for i in _apply(tokenizer, turns, generation_prompt=False)]\n",
                                           ["tests/unit/test_chat_data.py", "-k", "reply"]),
    # under a pipeline the first stage's pick (none) is broadcast, not the last stage's
    "generate_pp_first_stage_token": ("lightning_titan/tools/decoding.py",
                                      "    last = dist.get_global_rank(pp_group, dist.get_world_size(pp_group) - 1)\n",
                                      "    last = dist.get_global_rank(pp_group, 0)\n",
                                      ["tests/distributed/test_generate_stages.py"]),
    # a config.json nested past the parser: Python's RecursionError, not the file named
    "hf_json_depth_raw": ("lightning_titan/hf/folder.py",
                          "    except RecursionError:  # json's decoder recurses once per nesting level\n",
                          "    except MemoryError:  # json's decoder recurses once per nesting level\n",
                          ["tests/unit/test_hf_refused.py", "-k", "nested"]),
    # a weight_map entry that is not a file name: a TypeError from path arithmetic
    "hf_weight_map_untyped": ("lightning_titan/hf/load.py",
                              "            if not isinstance(file, str):\n",
                              "            if False:\n",
                              ["tests/unit/test_hf_refused.py", "-k", "weight_map"]),
    # YaRN's ramp ends rounded when truncate is false (and not when true)
    "yarn_truncate_inverted": ("lightning_titan/model/yarn.py",
                               "    if yarn.get(\"truncate\", True):\n",
                               "    if not yarn.get(\"truncate\", True):\n",
                               ["tests/unit/test_yarn_truncate.py"]),
    # dualpipev with compile found only by the launcher (a traceback after the seed line)
    "cli_overlap_unchecked": ("lightning_titan/cli.py",
                              "                check_overlap_threads(strategy.options, recompute=recompute, compiled=compiled)\n",
                              "",
                              ["tests/cli/test_errors.py", "-k", "overlapped"]),
    # issue 21.2: the strategy does not clip
    "clip_none": ("lightning_titan/train/step.py",
                  "engine.finish_gradients(self.max_norm)",
                  "engine.finish_gradients(None)",
                  ["tests/distributed/test_strategy_step.py"]),
    # issue 21.3: the broadcast of replicated parameters does nothing / is not called
    "broadcast_noop": ("lightning_titan/train/engine.py",
                       "dist.broadcast(t.data, src=ranks[0], group=group)",
                       "pass",
                       ["tests/distributed/test_strategy_step.py"]),
    "broadcast_not_called": ("lightning_titan/lightning/strategy.py",
                             "        self._engine.broadcast_replicated()\n",
                             "",
                             ["tests/distributed/test_strategy_step.py"]),
    # issue 21.4: the old checkpoint is deleted before the new one is renamed in
    "delete_before_rename": ("lightning_titan/checkpoint/files.py",
                             "    if not (path.exists() or path.is_symlink()):\n        os.rename(tmp, path)",
                             "    _delete(path)\n    if not (path.exists() or path.is_symlink()):\n"
                             "        os.rename(tmp, path)",
                             ["tests/unit/test_checkpoint_install.py"]),
    # a damaged COMPLETE marker of a checkpoint saved with checksums reads as one from before them
    "damaged_marker_trusted": ("lightning_titan/checkpoint/integrity.py",
                               "    if info.get(CHECKSUMMED):",
                               "    if False:",
                               ["tests/distributed/test_checkpoint_security.py", "-k", "marker"]),
    # a background save writes the live tensors, which training changes while the thread writes
    "background_not_staged": ("lightning_titan/checkpoint/sharded.py",
                              "            state, fence = staged.state, staged.fence",
                              "            fence = staged.fence",
                              ["tests/distributed/test_checkpoint.py", "-k", "kill_during_save"]),
    # the end of fit does not wait for the background write in flight: `last` is not complete yet
    "end_of_fit_not_waited": ("lightning_titan/lightning/sharded_strategy.py",
                              "            self.checkpoints.wait()",
                              "            pass",
                              ["tests/distributed/test_strategy.py", "-k", "one_write and async"]),
    # a wait for the background write has no bound: a peer stopped during it holds the job for ever
    "background_wait_unbounded": ("lightning_titan/checkpoint/background.py",
                                  "if not self._done.wait(timeout_s):",
                                  "if not self._done.wait():",
                                  ["tests/unit/test_background_wait.py", "-k", "stuck_write"]),
    # a wait after one that timed out waits the whole timeout again (the failure's teardown does)
    "timed_out_wait_again": ("lightning_titan/checkpoint/background.py",
                             "timeout_s = 0.0 if self._timed_out else self.timeout.total_seconds()",
                             "timeout_s = self.timeout.total_seconds()",
                             ["tests/unit/test_background_wait.py", "-k", "stuck_write"]),
    # the writer's gloo group made without the job's timeout: torch's 30 minutes
    "writer_group_untimed": ("lightning_titan/checkpoint/background.py",
                             'dist.new_group(backend="gloo", timeout=self.timeout)',
                             'dist.new_group(backend="gloo")',
                             ["tests/unit/test_background_wait.py", "-k", "writer_group"]),
    # a SIGTERM that a failure overtook (a rank stalled in a background write) exits with 1, not 143
    "sigterm_failure_exits_1": ("lightning_titan/lightning/strategy.py",
                                "code = 128 + signum if signum else 1",
                                "code = 1",
                                ["tests/distributed/test_preemption.py", "-k",
                                 "stopped_during_a_background_write"]),
    # a top-k removal during a background write happens at once (a failed write leaves fewer)
    "removal_not_deferred": ("lightning_titan/checkpoint/background.py",
                             "            if self._writing:",
                             "            if False:",
                             ["tests/unit/test_checkpoint_install.py", "-k", "removes_older"]),
    # a staged DTensor rebuilt with from_local: on a CUDA mesh its host shard goes back to the device
    "staging_on_device": ("lightning_titan/checkpoint/background.py",
                          "    return DTensor(local, like._spec, requires_grad=False)",
                          "    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,"
                          " shape=like.shape, stride=like.stride())",
                          ["tests/unit/test_background_devices.py", "-k", "host_copies"]),
    # the writer reads the host buffers without waiting for the training stream's copies to finish
    "fence_not_waited": ("lightning_titan/checkpoint/background.py",
                         "                fence.synchronize()  # the host copies are complete: only now are their bytes read",
                         "                pass",
                         ["tests/unit/test_background_devices.py", "-k", "fence"]),
    # the writer thread never sets its device (on CUDA: current_stream() of GPU 0 on every rank)
    "writer_device_unset": ("lightning_titan/checkpoint/background.py",
                            "        (self._hooks or DeviceHooks()).set_device()  # once: the device is per thread",
                            "        pass",
                            ["tests/unit/test_background_devices.py", "-k", "fence"]),
    # `last` of a top-k event written in full a second time (background saves wait at every event)
    "second_write": ("lightning_titan/lightning/checkpoint_hooks.py",
                     "        source = self._same_event(str(path), trainer) if training else None",
                     "        source = None",
                     ["tests/distributed/test_strategy.py", "-k", "one_write and async"]),
    # `last` linked to whatever was written at its step, not only as ModelCheckpoint's `last`
    "link_any_save": ("lightning_titan/lightning/checkpoint_hooks.py",
                      "and source != path and path in lasts else None",
                      "and source != path else None",
                      ["tests/unit/test_checkpoint_links.py"]),
    # a link queued after its top-k write already failed runs anyway (one rank enters a collective)
    "link_after_failure": ("lightning_titan/checkpoint/background.py",
                           "            if self._error is not None:\n",
                           "            if False:\n",
                           ["tests/unit/test_checkpoint_links.py", "-k", "failed"]),
    # a failed removal on rank 0 skips the link queued after it (the other ranks wait in its collective)
    "failed_job_stops_queue": ("lightning_titan/checkpoint/background.py",
                               "                    error = error or e\n",
                               "                    raise\n",
                               ["tests/unit/test_checkpoint_links.py", "-k", "does_not_stop"]),
    # one backend options object shared by every group the mesh builds
    "shared_options": ("lightning_titan/parallel/mesh.py",
                       "    options_factory = options_factory or group_options",
                       "    options_factory = functools.cache(options_factory or group_options)",
                       ["tests/unit/test_group_options.py"]),
    # ckpt_path="last" with only an interrupted save starts a new run (Lightning's warning)
    "missing_last_accepted": ("lightning_titan/lightning/launchers.py",
                              '    refuse_missing_last(trainer, called.get("ckpt_path"))',
                              "    pass",
                              ["tests/distributed/test_resume_last.py"]),
    # a restart goes back to the ckpt_path the job was given, though newer ones are complete
    "restart_to_given": ("lightning_titan/lightning/restarts.py",
                         "    return max(found, key=files.completed_at) if found else None",
                         "    return max(found, key=files.completed_at) if found and given is None else None",
                         ["tests/unit/test_restarts.py"]),
    # the same, seen by a restarted job: steps trained twice, -v1 checkpoints
    "restart_to_given_job": ("lightning_titan/lightning/restarts.py",
                             "    return max(found, key=files.completed_at) if found else None",
                             "    return max(found, key=files.completed_at) if found and given is None else None",
                             ["tests/distributed/test_self_restart.py", "-k",
                              "restarts_by_itself and launcher"]),
    # a restart resumes an older complete checkpoint of the run's folder than the newest
    "restart_older_complete": ("lightning_titan/checkpoint/runs.py",
                               "    for path in sorted(complete, key=files.completed_at, reverse=True):",
                               "    for path in sorted(complete, key=files.completed_at):",
                               ["tests/distributed/test_self_restart.py", "-k",
                                "restarts_by_itself and launcher"]),
    # a restarted CSV logger deletes the earlier launches' metrics.csv when it is created
    "restart_rows_deleted": ("lightning_titan/lightning/restarts.py",
                             "        pass  # Lightning's deletes metrics.csv here",
                             "        super()._check_log_dir_exists()",
                             ["tests/unit/test_restarts.py", "-k", "appends"]),
    # issue 21.5: the resume after kill -9 restarts from scratch (a mutation of the test's command)
    "resume_without_ckpt": ("tests/distributed/test_reliability.py",
                            'job = titan_fit(config, root, cache, "--ckpt_path=last", fork)',
                            "job = titan_fit(config, root, cache, fork)",
                            ["tests/distributed/test_reliability.py", "-k", "kill_9"]),
    # issue 12.1: manual optimization may step on grads that were never reduced
    "step_unreduced": ("lightning_titan/lightning/strategy.py",
                       "                if self.engine.unfinished:\n",
                       "                if False:\n",
                       ["tests/distributed/test_agreement.py", "-k", "unreduced"]),
    # issue 21.6: the sampler gets the DP rank instead of the data rank
    "sampler_dp_rank": ("lightning_titan/lightning/strategy.py",
                        '"rank": self.parallel_dims.data_rank}',
                        '"rank": self.parallel_dims.dp_rank}',
                        ["tests/distributed/test_strategy_step.py"]),
    # issue 21.8: the inf fault action poisons nothing
    "inf_action_noop": ("lightning_titan/runtime/faults.py",
                        'value = float("nan") if fault.action == "nan" else float("inf")',
                        'value = float("nan") if fault.action == "nan" else 1.0',
                        ["tests/distributed/test_reliability.py", "-k", "skip_takes"]),
    # issue 19: the expert bias enters the combine weights, not only the selection
    "bias_in_combine": ("lightning_titan/model/moe/router.py",
                        "weights = probs.gather(-1, expert_ids)",
                        "weights = (probs + selection_bias).gather(-1, expert_ids)",
                        ["tests/unit/test_balance.py"]),
    # issue 19: the expert loads summed over the sequence's CP/TP ranks only, not the data ranks
    "bias_counts_not_over_data": ("lightning_titan/train/engine.py",
                                  "self.balanced_layers, counts, self.groups.sequence_dp,",
                                  "self.balanced_layers, counts, self.groups.sequence,",
                                  ["tests/distributed/test_equivalence.py", "-k", "2"]),
    # issue 19: activation checkpointing's recompute counts the tokens a second time
    "bias_counts_recompute": ("lightning_titan/model/moe/layer.py",
                              "torch.is_grad_enabled() and not recomputing():",
                              "torch.is_grad_enabled():",
                              ["tests/unit/test_balance.py"]),
    # issue 19: the grouped experts' row offsets in the wrong order (rows go to other experts)
    "grouped_offsets": ("lightning_titan/model/moe/experts.py",
                        "offsets = counts.cumsum(0, dtype=torch.int32)",
                        "offsets = counts.flip(0).cumsum(0, dtype=torch.int32)",
                        ["tests/unit/test_experts.py"]),
    # issue 43: a per-parameter flag written from a Python scalar (a host-to-device copy on CUDA)
    "reducer_flag_host_write": ("lightning_titan/parallel/dp/reducer.py",
                                "                view.copy_(param.grad)\n",
                                "                view.copy_(param.grad)\n"
                                "                bucket.buffer[self._flag_index(bucket, slot)] = 1.0\n",
                                ["tests/distributed/test_reducer.py", "-k", "four_gloo"]),
    # issue 43: ZeRO-2's per-parameter flag written the same way
    "zero2_flag_host_write": ("lightning_titan/parallel/dp/zero_grads.py",
                              "slots_N[:, flag : flag + 1].fill_(float(grad is not None))",
                              "slots_N[:, flag] = float(grad is not None)",
                              ["tests/distributed/test_reducer.py", "-k", "four_gloo"]),
    # issue 43: TP's sequence all-gather carries the fp32 norm output under autocast
    "tp_gather_fp32": ("lightning_titan/parallel/tensor_parallel.py",
                       "return gather_along(x.to(wire_dtype(x.dtype, x.device)), group, 1)",
                       "return gather_along(x, group, 1)",
                       ["tests/distributed/test_collective_order.py"]),
    # issue 43: the embedding's reduce-scatter in fp32 under autocast
    "tp_scatter_fp32": ("lightning_titan/parallel/tensor_parallel.py",
                        "return _ReduceScatter.apply(x.to(wire_dtype(x.dtype, x.device)), group, 1).to(x.dtype)",
                        "return _ReduceScatter.apply(x, group, 1)",
                        ["tests/distributed/test_collective_order.py"]),
    # issue 43: the step's token count copied from the host every step
    "tokens_from_host": ("lightning_titan/train/objective.py",
                         "tokens = sums.tokens.to(torch.float64)",
                         "tokens = sums.loss_sum.new_tensor(float(sums.tokens), dtype=torch.float64)",
                         ["tests/distributed/test_collective_order.py"]),
    # issue 43: the step's metrics logged as Python floats (Lightning copies each onto the device)
    "log_python_floats": ("lightning_titan/lightning/module.py",
                          "self.log(name, torch.tensor(float(value)), prog_bar=name in _PROGRESS_BAR)",
                          "self.log(name, float(value), prog_bar=name in _PROGRESS_BAR)",
                          ["tests/unit/test_flops.py", "-k", "titanlm"]),
    # issue 43: the padded grouped GEMMs' output keeps the padding rows (cut at the end instead)
    "grouped_padding_kept": ("lightning_titan/model/moe/experts.py",
                             "return out if rows is None else out.index_select(0, rows)",
                             "return out if rows is None else out[: rows.shape[0]]",
                             ["tests/unit/test_experts.py"]),
    # issue 43: under bf16-mixed (autocast) the loop runs on CUDA, as before the explicit casts
    "grouped_not_under_autocast": ("lightning_titan/model/moe/experts.py",
                                   "    if autocast_dtype is not None:\n        compute = autocast_dtype",
                                   "    if False:\n        compute = autocast_dtype",
                                   ["tests/unit/test_experts.py"]),
    # issue 19: an expanded output grad reaches _grouped_mm's backward, which rejects it
    "grouped_strided_grad": ("lightning_titan/model/moe/experts.py",
                             "out = _ContiguousGrad.apply(self._add_bias(",
                             "out = (self._add_bias(",
                             ["tests/unit/test_experts.py"]),
    # expert parallelism's bf16 wire rows with fp32 weights under autocast sent to the loop again
    "grouped_wire_dtype_loop": ("lightning_titan/model/moe/experts.py",
                                "    if autocast_dtype is not None:\n",
                                "    if autocast_dtype is not None and rows_dtype == weight_dtype:\n",
                                ["tests/unit/test_expert_gemm.py", "-k", "wire_dtype"]),
    # the loop indexes w[e]: each select's backward a zero-filled full-size grad per expert
    "loop_select_grads": ("lightning_titan/model/moe/experts.py",
                          "w1, w3, w2 = self.w1.unbind(0), self.w3.unbind(0), self.w2.unbind(0)",
                          "w1, w3, w2 = self.w1, self.w3, self.w2",
                          ["tests/unit/test_expert_gemm.py", "-k", "full_size"]),
    # the forward probes the grouped GEMMs itself (in an overlapped pair: a backward on the wrong thread)
    "probe_in_forward": ("lightning_titan/model/moe/experts.py",
                         "return dtype if dtype is not None and self.grouped_mm_runs.get(dtype, False) else None",
                         "return dtype if dtype is not None and grouped_mm_supported(x.device, dtype, d_model, ffn_dim) else None",
                         ["tests/unit/test_expert_gemm.py", "-k", "probes"]),
    # the probe's groups of one row: not the aligned offsets the weight-gradient GEMM wants on CUDA
    "probe_unaligned": ("lightning_titan/model/moe/experts.py",
                        "offsets = torch.tensor([ALIGN_ROWS, rows], device=device, dtype=torch.int32)",
                        "offsets = torch.tensor([1, rows], device=device, dtype=torch.int32)",
                        ["tests/unit/test_expert_gemm.py", "-k", "aligned"]),
    # with capacity the dispatch reads the counts back again (sizes not static)
    "capacity_counted_sizes": ("lightning_titan/model/moe/layer.py",
                               "        return keep, slots_per_expert(b, s, limit)\n",
                               "        return keep, None\n",
                               ["tests/unit/test_capacity_slots.py", "-k", "reads_nothing"]),
    # an empty static slot weighted like a kept row: its (biased) output reaches the experts' grads
    "slots_empty_weighted": ("lightning_titan/parallel/dispatch.py",
                             "row_weight = F.pad(w.reshape(-1), (0, 1)).index_select(0, order)",
                             "row_weight = F.pad(w.reshape(-1), (0, 1), value=1.0).index_select(0, order)",
                             ["tests/unit/test_capacity_slots.py", "-k", "biased"]),
    # the received slot blocks left source-major: rows reach other experts
    "slots_source_major": ("lightning_titan/parallel/dispatch.py",
                           "    return Pending(lambda: swap_major(pending.wait(), ep, n_local)), plan\n",
                           "    return Pending(lambda: pending.wait()), plan\n",
                           ["tests/distributed/test_dispatch.py", "-k", "expert_parallel"]),
    # a kept assignment's slot counted from the start of all slots, not of its expert's
    "slots_no_expert_start": ("lightning_titan/parallel/slots.py",
                              "slot_sorted = torch.where(sorted_ids < n_experts, sorted_ids * slots + place, rows)",
                              "slot_sorted = torch.where(sorted_ids < n_experts, place, rows)",
                              ["tests/unit/test_capacity_slots.py", "-k", "biased"]),
    # gpt-oss: the window lets a query see one key too many (transformers: k > q - window)
    "oss_window_off_by_one": ("lightning_titan/model/sinks.py",
                              "(k_pos.unsqueeze(0) > q_pos.unsqueeze(1) - window)",
                              "(k_pos.unsqueeze(0) >= q_pos.unsqueeze(1) - window)",
                              ["tests/distributed/test_hf_archs.py", "-k", "one_process_equals"]),
    # gpt-oss: gate taken from the odd columns of the interleaved gate_up_proj
    "oss_gate_up_swapped": ("lightning_titan/hf/families/gpt_oss.py",
                            '"w1": ("gate_up_proj", slice(0, None, 2)),',
                            '"w1": ("gate_up_proj", slice(1, None, 2)),',
                            ["tests/distributed/test_hf_archs.py", "-k", "one_process_equals"]),
    # gpt-oss under CP: the window masks keys by position order, not the rank order they arrive in
    "oss_cp_window_key_order": ("lightning_titan/model/decoder.py",
                                "                keys = context_parallel.all_positions(seq_len, self.cp_group, x.device)\n            window_mask",
                                "            window_mask",
                                ["tests/distributed/test_equivalence.py", "-k", "8]"]),
    # gpt-oss under TP: the o-projection's bias added by every TP rank before the reduction
    "oss_o_bias_per_tp_rank": ("lightning_titan/model/attention.py",
                               "out = adapters.without_bias(self.wo, heads_out)\n        out = scatter_sequence(out, self.tp_group)\n        return out if self.wo.bias is None else out + self.wo.bias",
                               "out = F.linear(heads_out, self.wo.weight, self.wo.bias)\n        return scatter_sequence(out, self.tp_group)",
                               ["tests/distributed/test_hf_archs.py", "-k", "eight_ranks"]),
    # gpt-oss: MXFP4's high nibble read as the even value
    "oss_mxfp4_nibbles": ("lightning_titan/hf/families/gpt_oss.py",
                          "out[..., 0::2] = lut[(blocks & 0x0F).to(torch.int)]",
                          "out[..., 0::2] = lut[(blocks >> 4).to(torch.int)]",
                          ["tests/unit/test_gpt_oss_mxfp4.py"]),
    # gpt-oss: MXFP4 blocks or scales of another dtype cast to bytes (int64 wraps modulo 256)
    "oss_mxfp4_dtype_cast": ("lightning_titan/hf/families/gpt_oss.py",
                             "        if tensor.dtype != torch.uint8:",
                             "        if False:",
                             ["tests/unit/test_gpt_oss_mxfp4.py", "-k", "refused"]),
    # gpt-oss: an e8m0 scale of 255 (NaN) read as 2**128
    "oss_mxfp4_nan_scale": ("lightning_titan/hf/families/gpt_oss.py",
                            "nan = (scales == 255).nonzero()",
                            "nan = (scales > 255).nonzero()",
                            ["tests/unit/test_gpt_oss_mxfp4.py", "-k", "refused"]),
    # gpt-oss: an unquantized fused expert tensor holding NaN loaded as it is
    "oss_fused_non_finite": ("lightning_titan/hf/families/gpt_oss.py",
                             "        hf_folder.check_finite(files[name], name, tensor)\n", "",
                             ["tests/unit/test_gpt_oss_mxfp4.py", "-k", "unquantized"]),
    # gpt-oss: MXFP4 values past float32's range (scale 254) dequantized to inf and loaded
    "oss_mxfp4_overflow": ("lightning_titan/hf/families/gpt_oss.py",
                           '    hf_folder.check_finite(files[f"{name}_scales"], f"{name} dequantized from MXFP4", out)\n',
                           "", ["tests/unit/test_gpt_oss_mxfp4.py", "-k", "refused"]),
    # a NaN or inf in a pretrained weight (or DeepSeek-V3's expert bias) loaded as it is
    "load_non_finite": ("lightning_titan/hf/load.py",
                        "                    hf_folder.check_finite(path, hf_name, tensor)\n                    target.copy_(",
                        "                    target.copy_(",
                        ["tests/unit/test_hf_refused.py", "-k", "non_finite"]),
    # DeepSeek-V3: topk_group 0 read as 1, or above n_group
    "deepseek_topk_group_range": ("lightning_titan/hf/families/deepseek.py",
                                  "if not (is_int(topk) and 1 <= topk <= groups):",
                                  "if not is_int(topk):",
                                  ["tests/unit/test_hf_refused.py", "-k", "deepseek"]),
    # DeepSeek-V3: q_lora_rank 0 taken as one q_proj ("lacks q_proj" at load)
    "deepseek_q_rank_zero": ("lightning_titan/hf/families/deepseek.py",
                             "is_int(q_rank) and q_rank >= 1)", "is_int(q_rank) and q_rank >= 0)",
                             ["tests/unit/test_hf_refused.py", "-k", "deepseek"]),
    # YaRN: beta_fast below beta_slow (the ramp runs backwards) accepted
    "yarn_betas_unordered": ("lightning_titan/model/options.py",
                             "        if not fast > slow:", "        if False:",
                             ["tests/unit/test_model_options.py", "-k", "each_group"]),
    # YaRN: an infinite factor accepted (cos and sin of NaN later)
    "yarn_inf_accepted": ("lightning_titan/model/options.py",
                          " and math.isfinite(value)", "",
                          ["tests/unit/test_model_options.py", "-k", "each_group"]),
    # top_k above n_experts reported as too few groups ("raise router_topk_groups")
    "top_k_checked_after_groups": ("lightning_titan/model/config.py",
                                   "        if self.top_k > self.n_experts:", "        if False:",
                                   ["tests/unit/test_model_options.py", "-k", "does_not_fit"]),
    # issue 17: the backwards of the interleaved schedule run the chunks forward, not reversed
    "interleaved_bwd_order": ("lightning_titan/parallel/pipeline/interleaved.py",
                              "chunk = r // pp if forward else v - 1 - r // pp",
                              "chunk = r // pp",
                              ["tests/unit/test_schedules.py", "-k", "interleaved"]),
    # issue 17: rank p holds virtual stages p*v .. p*v+v-1 (contiguous), not round-robin
    "split_not_round_robin": ("lightning_titan/parallel/pipeline/split.py",
                              "return list(range(pp_rank, pp * self.virtual_stages, pp))  # round-robin",
                              "return list(range(pp_rank * self.virtual_stages, (pp_rank + 1) * self.virtual_stages))",
                              ["tests/distributed/test_equivalence.py", "-k", "2"]),
    # issue 17: an explicit split silently drops the last layer (the peers' bug)
    "split_drops_a_layer": ("lightning_titan/parallel/pipeline/split.py",
                            "        return counts\n",
                            "        return counts[:-1] + [max(0, counts[-1] - 1)]\n",
                            ["tests/distributed/test_equivalence.py", "-k", "2"]),
    # issue 17: a split that does not sum to n_layers gets through
    "split_sum_unchecked": ("lightning_titan/parallel/pipeline/split.py",
                            "        if sum(counts) != n_layers:",
                            "        if False:",
                            ["tests/unit/test_split.py"]),
    # issue 17: a received message is filed under its stream's last id, not its next (the paired
    # transport's exchange and the CPU one's takes file through the same call)
    "stream_misfiled": ("lightning_titan/parallel/pipeline/stage.py",
                        'chunk, i = self._streams[kind == "g"].pop(0)',
                        'chunk, i = self._streams[kind == "g"].pop()',
                        ["tests/distributed/test_equivalence.py", "-k", "2"]),
    # issue 17: both streams share a tag (pp=2 with virtual stages: one peer for both)
    "ring_one_tag": ("lightning_titan/parallel/pipeline/p2p.py",
                     "FORWARD_TAG, BACKWARD_TAG = 0, 1",
                     "FORWARD_TAG, BACKWARD_TAG = 0, 0",
                     ["tests/distributed/test_equivalence.py", "-k", "2"]),
    # issue 17: the grads are reduced from the last microbatch's backward of chunk v-1 on, before
    # the other chunks' backwards have accumulated theirs
    "sync_before_last_chunk": ("lightning_titan/parallel/pipeline/stage.py",
                               "self._backwards_done == self.num_microbatches * self.num_chunks",
                               "self._backwards_done == self.num_microbatches",
                               ["tests/distributed/test_equivalence.py", "-k", "4"]),
    # issue 17: the planner prices ZBV's bubble as ZB-H1's (one chunk per rank)
    "plan_zbv_as_zb_h1": ("lightning_titan/plan/cost.py",
                          "        fill = (pp - 1) / 6",
                          "        fill = (pp - 1) / 3",
                          ["tests/cli/test_plan.py", "-k", "own_order"]),
    # issue 17: the planner holds every microbatch's activations under ZB-H1 (its old upper bound)
    "plan_zb_h1_holds_m": ("lightning_titan/plan/activations.py",
                           "        return min(m, pp)\n",
                           "        return m\n",
                           ["tests/cli/test_plan.py", "-k", "own_order"]),
    # titan plan --out writes the model field as a dotted key titan fit refuses
    "plan_overlay_model_key": ("lightning_titan/tools/plan_cli.py",
                               '    keys["model.model.init_args.activation_checkpointing"]',
                               '    keys["model.model.activation_checkpointing"]',
                               ["tests/cli/test_plan.py", "-k", "overlay"]),
    # titan plan offers GPipe with one microbatch: 1F1B's row twice
    "plan_gpipe_m1": ("lightning_titan/plan/rank.py",
                      'if schedule in ("1f1b_overlap", "gpipe") and m == 1:',
                      'if schedule == "1f1b_overlap" and m == 1:',
                      ["tests/cli/test_plan.py", "-k", "same_step"]),
    # titan plan --only cuts the named layouts' rows as one list (a slow layout disappears)
    "plan_only_one_list": ("lightning_titan/tools/plan_cli.py",
                           "        rows += priced[:top]\n",
                           "        rows += priced[:1]\n",
                           ["tests/cli/test_plan.py", "-k", "only_shows"]),
    # the planner at cluster scale: attention counted over every key, not the causal ones
    "flops_full_attention": ("lightning_titan/model/flops.py",
                             "return w * (w + 1) // 2 + (seq_len - w) * w",
                             "return seq_len * w",
                             ["tests/unit/test_flops.py"]),
    # latent attention's scores counted without the RoPE part of the query-key width
    "flops_latent_no_rope": ("lightning_titan/model/flops.py",
                             "width = config.n_heads * (latent.nope_dim + latent.rope_dim + latent.v_dim)",
                             "width = config.n_heads * (latent.nope_dim + latent.v_dim)",
                             ["tests/unit/test_flops.py", "-k", "sum_over_positions"]),
    # a sliding window's first w positions counted as seeing w keys each
    "flops_window_full_start": ("lightning_titan/model/flops.py",
                                "return w * (w + 1) // 2 + (seq_len - w) * w",
                                "return seq_len * w if window else w * (w + 1) // 2",
                                ["tests/unit/test_flops.py", "-k", "sum_over_positions"]),
    # the published DeepSeek-V3 runs planned with fewer routed experts a token than it routes
    "published_dsv3_top6": ("lightning_titan/tools/plan_published.py",
                               '"num_experts_per_tok": 8,', '"num_experts_per_tok": 6,',
                               ["tests/unit/test_plan_scale.py", "-k", "publisher_counts"]),
    # the pruned search's bound above what a layout can reach: rows are missed
    "plan_bound_too_high": ("lightning_titan/plan/rank.py",
                            "return one.compute + comm + one.optimizer",
                            "return 2 * (one.compute + comm + one.optimizer)",
                            ["tests/unit/test_plan_scale.py", "-k", "pruned"]),
    # a group's rank index taken as the sum of its coordinates
    "plan_group_place_order": ("lightning_titan/plan/memory.py",
                               "size, index = size * degree, index * degree + coords[axis]",
                               "size, index = size * degree, index + coords[axis]",
                               ["tests/unit/test_plan_scale.py", "-k", "group_place"]),
    # the EP dispatch's in-node peers priced on the network too
    "plan_dispatch_flat": ("lightning_titan/plan/cost.py",
                           "    far = copies * (n - g) / n\n",
                           "    far = copies * (n - 1) / n\n",
                           ["tests/unit/test_plan_scale.py", "-k", "tier"]),
    # --dispatch node-dedup priced as the flat all-to-all
    "plan_dedup_ignored": ("lightning_titan/plan/cost.py",
                           'if device.dispatch == "node-dedup" and inter is not None and copies:',
                           "if False:",
                           ["tests/unit/test_plan_scale.py", "-k", "tier"]),
    # the all-reduce always priced as NCCL's ring (n - 1 latency steps at 1,024 ranks)
    "plan_tree_never": ("lightning_titan/plan/cost.py",
                        "best = min(ring, 2 * depth + 2 * per_bucket / bw)",
                        "best = ring",
                        ["tests/unit/test_plan_scale.py", "-k", "ring_or_tree"]),
    # a group's ranks in one node share one network adapter
    "plan_one_adapter": ("lightning_titan/plan/cost.py",
                         "bw = min(bw, g * device.inter.bandwidth)",
                         "bw = min(bw, device.inter.bandwidth)",
                         ["tests/unit/test_plan_scale.py", "-k", "ring_or_tree"]),
    # a GPU plan puts every device in one node unless --nodes says otherwise
    "plan_one_node_default": ("lightning_titan/tools/plan_cli.py",
                              "    return max(1, args.devices // PER_NODE)",
                              "    return 1",
                              ["tests/unit/test_plan_scale.py", "-k", "link_flags"]),
    # a quantised config.json refused for planning
    "plan_quant_refused": ("lightning_titan/tools/plan_cli.py",
                           'quantization = hf.pop("quantization_config", None)',
                           'quantization = hf.get("quantization_config")',
                           ["tests/unit/test_plan_scale.py", "-k", "quantised"]),
    # --only drops a named layout's rows that do not fit
    "plan_only_fitting": ("lightning_titan/tools/plan_cli.py",
                          "priced = ranked(config, mine, batch, device, precision=precision, fitting=False, lora=lora)",
                          "priced = ranked(config, mine, batch, device, precision=precision, lora=lora)",
                          ["tests/unit/test_plan_scale.py", "-k", "only_prints"]),
    # "nothing fits" advises zero=2 to a layout that is zero2 already
    "plan_remedy_zero_always": ("lightning_titan/plan/layouts.py",
                                "if best.zero < 2 and data_parallel:",
                                "if data_parallel:",
                                ["tests/unit/test_plan_scale.py", "-k", "nothing_fits"]),
    # interleaved 1F1B offered with two chunks a rank only
    "plan_virtual_two_only": ("lightning_titan/plan/rank.py",
                              "chunks = list(range(2, MAX_VIRTUAL_STAGES + 1))",
                              "chunks = [2]",
                              ["tests/unit/test_plan_scale.py", "-k", "interleaved"]),
    # the search's progress never printed when it ends within the interval
    "plan_progress_silent": ("lightning_titan/tools/plan_cli.py",
                             "            self._show(*self.state)\n",
                             "            pass\n",
                             ["tests/unit/test_plan_scale.py", "-k", "stderr"]),
    # the balanced split ignores the head's work on the last stage (the naive split)
    "plan_split_no_head": ("lightning_titan/plan/cost.py",
                           "    return 0.0, layer, 2.0 * config.d_model * config.vocab_size",
                           "    return 0.0, layer, 0.0",
                           ["tests/unit/test_plan_split.py", "-k", "deepseek"]),
    # the planner's state of an uneven split counted as the even split's
    "plan_split_state_even": ("lightning_titan/plan/memory.py",
                              "config, ParallelDims(**degrees, rank=r, fold_ep=fold_ep), zero, split, lora,",
                              "config, ParallelDims(**degrees, rank=r, fold_ep=fold_ep), zero, None, lora,",
                              ["tests/unit/test_plan_split.py", "-k", "rank_state"]),
    # an uneven split priced by its last stage only
    "plan_split_last_stage": ("lightning_titan/plan/cost.py",
                              "for n, first, head in _slowest_candidates(flops, counts)",
                              "for n, first, head in [(counts[-1], len(counts) == 1, True)]",
                              ["tests/unit/test_plan_split.py", "-k", "deepseek"]),
    # --out drops the split (titan fit would cut the layers evenly or refuse)
    "plan_out_no_split": ("lightning_titan/tools/plan_cli.py",
                          "= list(split) if split else \"null\"",
                          "= \"null\"",
                          ["tests/unit/test_plan_split.py", "-k", "out_carries"]),
    # activations of an uneven split priced as the even split's
    "plan_split_activations_even": ("lightning_titan/plan/activations.py",
                                    "    layers = stage_layers or (config.n_layers / pp,) * pp",
                                    "    layers = (config.n_layers / pp,) * pp",
                                    ["tests/unit/test_plan_split.py", "-k", "even_split"]),
    # LoRA's trained parameters counted on the even split (which a pp not dividing the layers refuses)
    "plan_lora_split_even": ("lightning_titan/plan/rank.py",
                             "return trained_params(self.config, c.dims, self.lora, split)",
                             "return trained_params(self.config, c.dims, self.lora)",
                             ["tests/unit/test_plan_split.py", "-k", "one_chunk"]),
    # "nothing fits" advises a pp whose stages hold as many layers (no less state)
    "plan_remedy_pp_same_layers": ("lightning_titan/plan/layouts.py",
                                   "                continue  # a stage still holds as many layers: no less state\n",
                                   "                pass\n",
                                   ["tests/unit/test_plan_scale.py", "-k", "nothing_fits_names"]),
    # layout="auto" drops the chosen split
    "plan_auto_split_dropped": ("lightning_titan/plan/auto.py",
                                "            stage_layers=self.stage_layers,\n",
                                "",
                                ["tests/unit/test_plan_split.py", "-k", "one_chunk"]),
    # titan plan prints times with %g ("3.26e+03")
    "plan_ms_exponent": ("lightning_titan/tools/plan_cli.py",
                         '    return f"{ms:,.{digits}f}"',
                         '    return f"{ms:,.3g}"',
                         ["tests/cli/test_plan.py", "-k", "plain_milli"]),
    # issue 17: W keeps one weight-side grad per intermediate (a matmul's bias grad is lost)
    "zb_first_output_only": ("lightning_titan/parallel/pipeline/backward_split.py",
                             "            for k, edge in outputs:\n",
                             "            for k, edge in outputs[:1]:\n",
                             ["tests/unit/test_backward_split.py"]),
    # issue 17: the weight grads computed after the last flush never reach .grad
    "zb_last_flush_dropped": ("lightning_titan/parallel/pipeline/backward_split.py",
                              "                held = 0\n        self._accumulate(edges, grads)\n",
                              "                held = 0\n",
                              ["tests/unit/test_backward_split.py"]),
    # issue 17: B also accumulates the weight grads (they would come twice with W)
    "zb_b_accumulates": ("lightning_titan/parallel/pipeline/backward_split.py",
                         "    dx, *grads = torch.autograd.grad(objective, inputs, retain_graph=True,",
                         "    torch.autograd.backward(objective, inputs=[p for p in params if p.requires_grad],"
                         " retain_graph=True)\n    dx, *grads = torch.autograd.grad(objective, inputs, retain_graph=True,",
                         ["tests/distributed/test_equivalence.py", "-k", "2"]),
    # issue 17: the reducers sync from the first W on, not the last (grads reduced too early)
    "zb_sync_first_w": ("lightning_titan/parallel/pipeline/stage.py",
                        "        last = self._backwards_done == self.num_microbatches * self.num_chunks\n",
                        "        last = self._backwards_done == 1\n",
                        ["tests/distributed/test_equivalence.py", "-k", "4"]),
    # issue 17: ZB-H1 runs W before sending the input grad upstream (B's point lost) -- order test
    "zb_w_not_deferred": ("lightning_titan/parallel/pipeline/schedules.py",
                          "        if len(deferred) > delay:",
                          "        if len(deferred) > 0:",
                          ["tests/unit/test_schedules.py", "-k", "zb"]),
    # issue 17: stage_layers="auto" charges the head to the first stage
    "auto_head_on_first": ("lightning_titan/parallel/pipeline/split.py",
                           "extra[-1] += costs.head / block",
                           "extra[0] += costs.head / block",
                           ["tests/unit/test_split.py", "-k", "auto"]),
    # issue 17: one warmup forward too few per stage: a steady step waits for a grad that needs its
    # own next forward first (the ideal replay deadlocks)
    "interleaved_short_warmup": ("lightning_titan/parallel/pipeline/interleaved.py",
                                 "return min(v * m, (pp - pp_rank - 1) * 2 + (v - 1) * pp)",
                                 "return min(v * m, (pp - pp_rank - 1) * 2 + (v - 1) * pp - 1)",
                                 ["tests/distributed/test_bench.py", "-k", "interleaved_bubble"]),
    # issue 17: the compute-only replay ignores the chunks (interleaved spans replayed as one stage)
    "replay_ignores_chunks": ("lightning_titan/runtime/tracing.py",
                              'v_stage = s.args.get("stage", s.args.get("chunk", 0) * len(ranks) + p)',
                              'v_stage = s.args.get("stage", p)',
                              ["tests/distributed/test_bench.py", "-k", "replay_knows"]),
    # issue 17: the replay runs a deferred W as a backward (it then waits for the next stage's B)
    "replay_w_as_b": ("lightning_titan/runtime/tracing.py",
                      'kind = "weight" if s.name == "backward_weight" else s.kind',
                      "kind = s.kind",
                      ["tests/distributed/test_bench.py", "-k", "replay_sends"]),
    # issue 19: capacity's queue counted over this rank's tokens, not the sequence's cp x tp ranks
    "capacity_local_queue": ("lightning_titan/model/moe/capacity.py",
                             "    if parts == 1:\n",
                             "    if True:\n",
                             ["tests/distributed/test_equivalence.py", "-k", "2"]),
    # issue 19: the gathered sequence in rank order, not at its tokens' global positions (CP)
    "capacity_rank_order": ("lightning_titan/model/moe/capacity.py",
                            "whole_BSK[:, where_PS.reshape(-1)] = torch.cat(gathered, dim=1)",
                            "whole_BSK[:, :] = torch.cat(gathered, dim=1)",
                            ["tests/distributed/test_equivalence.py", "-k", "4"]),
    # issue 19: the over-capacity assignments are dispatched anyway
    "capacity_not_dropped": ("lightning_titan/parallel/dispatch.py",
                             "flat_ids = torch.where(keep.reshape(-1), flat_ids, n_experts)",
                             "flat_ids = flat_ids",
                             ["tests/unit/test_capacity.py"]),
    # issue 19: the queue position-major (a token's second choice before a later token's first)
    "capacity_position_major": ("lightning_titan/model/moe/capacity.py",
                                "flat_BN = expert_ids_BSK.transpose(1, 2).reshape(b, k * s)",
                                "flat_BN = expert_ids_BSK.reshape(b, s * k)",
                                ["tests/unit/test_capacity.py"]),
    # issue 19: a capacity factor that never drops is accepted silently
    "capacity_no_check": ("lightning_titan/model/config.py",
                          "    if factor * config.top_k >= config.n_experts:",
                          "    if False:",
                          ["tests/unit/test_capacity.py"]),
    # issue 19: a bad ModelConfig value reaches the user inside jsonargparse's dump of the union
    "cli_model_unchecked": ("lightning_titan/cli.py",
                            'check_strategy(trainer), check_model_config(config.get("model"))',
                            "check_strategy(trainer), None",
                            ["tests/cli/test_errors.py", "-k", "bad_model_argument"]),
    # issue 19: the model FLOPs leave the attention scores out
    "flops_no_attention": ("lightning_titan/model/flops.py",
                           "return 2 * keys * width",
                           "return 0 * keys * width",
                           ["tests/unit/test_flops.py"]),
    # issue 19: the training FLOPs counted as forward + one backward matmul per matmul
    "flops_forward_only": ("lightning_titan/model/flops.py",
                           "return 3 * forward_flops_per_token(config)",
                           "return 2 * forward_flops_per_token(config)",
                           ["tests/unit/test_flops.py"]),
    # issue 19: the layers' dropped counts never reach the step's totals
    "dropped_not_summed": ("lightning_titan/model/moe/layer.py",
                           "return torch.stack(list(self.dropped.values())).sum() if self.dropped else None",
                           "return next(iter(self.dropped.values())) if self.dropped else None",
                           ["tests/unit/test_capacity.py", "-k", "sum_over"]),
    # issue 19: ExpertLoad's "without the bias" load counted from the biased scores
    "unbiased_load_biased": ("lightning_titan/model/moe/layer.py",
                             "self.unbiased_tokens_per_expert = self._unbiased_counts(logits)",
                             "self.unbiased_tokens_per_expert = self._unbiased_counts(logits.softmax(-1) + self.expert_bias)",
                             ["tests/unit/test_expert_load.py"]),
    # issue 18: OLMoE's whole-projection QK-norm takes a TP rank's own channels for the whole
    "qk_full_no_tp_sum": ("lightning_titan/model/attention.py",
                          "squares = _SumOverGroup.apply(squares, self.group)",
                          "squares = squares * tp_size(self.group)",
                          ["tests/distributed/test_equivalence.py", "-k", "2"]),
    # issue 18: Qwen2-MoE's q/k/v biases not cut with their rows (grads summed over TP too)
    "qkv_bias_not_cut": ("lightning_titan/parallel/tensor_parallel.py",
                         'if s.dim == 0 and isinstance(getattr(m, "bias", None), Tensor):',
                         "if False:",
                         ["tests/distributed/test_equivalence.py", "-k", "2"]),
    # issue 18: the shared expert without its sigmoid gate
    "shared_expert_ungated": ("lightning_titan/model/moe/shared.py",
                              "return out_BSD if self.gate is None else torch.sigmoid(self.gate(x_BSD)) * out_BSD",
                              "return out_BSD",
                              ["tests/distributed/test_hf_archs.py", "-k", "one_process and qwen2"]),
    # the EP all-to-all's rows read before they arrived (its wait dropped)
    "a2a_no_wait": ("lightning_titan/parallel/all_to_all.py",
                    "            self.work.wait()",
                    "            pass",
                    ["tests/distributed/test_dispatch.py", "-k", "expert_parallel"]),
    # an overlapped pair whose halves never hand the rank over: the forward runs whole, then the
    # backward (the same numbers; nothing overlaps)
    "pair_never_hands_over": ("lightning_titan/parallel/overlap.py",
                              "            if other not in self.running:  # the other half is done: go on alone",
                              "            if True:",
                              ["tests/distributed/test_dispatch.py", "-k", "expert_parallel"]),
    # DualPipeV's pair sends its forward's output as its backward's input grad
    "pair_swaps_outputs": ("lightning_titan/parallel/pipeline/stage.py",
                           '        self._sent("dx", cb, j, dx)',
                           '        self._sent("dx", cb, j, y if y is not None else dx)',
                           ["tests/distributed/test_equivalence.py", "-k", "every_layout and 4"]),
    # DualPipeV's fill one forward short: another order than torch's (and a stalled V)
    "dualpipev_short_fill": ("lightning_titan/parallel/pipeline/zbv.py",
                             "    for _ in range(2 * later):",
                             "    for _ in range(max(0, 2 * later - 1)):",
                             ["tests/unit/test_schedules.py", "-k", "dualpipev"]),
    # the counts' exchange started and never waited for: the splits read before they arrive
    "counts_not_waited": ("lightning_titan/parallel/dispatch.py",
                          "        cast(dist.Work, work).wait()",
                          "        pass",
                          ["tests/distributed/test_dispatch.py", "-k", "expert_parallel"]),
    # the time an all-to-all is in flight counted as exposed, the compute under it lost
    "in_flight_exclusive": ("lightning_titan/runtime/tracing.py",
                            "s.end_ns > s.start_ns and s.kind not in BACKGROUND_KINDS]",
                            "s.end_ns > s.start_ns]",
                            ["tests/distributed/test_bench.py", "-k", "overlap_exposure"]),
    # DeepSeek-V3: group-limited routing, routed scaling, interleaved RoPE, the latent norms' eps,
    # the expert bias read from the folder, the CP payload of the latent
    "deepseek_groups_ignored": ("lightning_titan/model/moe/router.py",
                                "choice = group_limited(choice, *groups)", "pass",
                                ["tests/distributed/test_hf_archs.py", "-k", "one_process and deepseek"]),
    "deepseek_scaling_ignored": ("lightning_titan/model/moe/router.py",
                                 "weights = weights * scaling", "weights = weights",
                                 ["tests/distributed/test_hf_archs.py", "-k", "one_process and deepseek"]),
    "deepseek_rope_not_interleaved": ("lightning_titan/model/mla.py",
                                      "if self.interleave:", "if False:",
                                      ["tests/distributed/test_hf_archs.py", "-k", "one_process and deepseek"]),
    "deepseek_latent_eps": ("lightning_titan/model/mla.py",
                            "LATENT_NORM_EPS = 1e-6", "LATENT_NORM_EPS = 1e-2",
                            ["tests/distributed/test_hf_archs.py", "-k", "one_process and deepseek"]),
    "deepseek_bias_not_loaded": ("lightning_titan/hf/arch.py",
                                 "out += [(n, b) for n, b in model.named_buffers()",
                                 "out += [] and [(n, b) for n, b in model.named_buffers()",
                                 ["tests/distributed/test_hf_archs.py", "-k", "one_process and deepseek"]),
    "deepseek_yarn_ignored": ("lightning_titan/model/decoder.py",
                              "            if position.yarn:", "            if False:",
                              ["tests/distributed/test_hf_archs.py", "-k", "one_process and deepseek"]),
    "deepseek_yarn_mscale_ignored": ("lightning_titan/model/mla.py",
                                     " * softmax_scale_factor(yarn)", "",
                                     ["tests/distributed/test_hf_archs.py", "-k", "one_process and deepseek"]),
    "deepseek_dense_probed_as_moe": ("lightning_titan/train/auto_split.py",
                                     "model = StageModel(replace(config, n_layers=1, dense_layers=0))",
                                     "model = StageModel(replace(config, n_layers=1))",
                                     ["tests/unit/test_split.py", "-k", "dense"]),
    "deepseek_cp_payload_heads": ("lightning_titan/plan/cost.py",
                                  "    if config.attention.kind == LATENT:  # the latent",
                                  "    if False:  # the latent",
                                  ["tests/cli/test_plan.py", "-k", "deepseek"]),
    # issue 18: the top-K scores renormalised whatever norm_topk_prob says
    "norm_topk_ignored": ("lightning_titan/model/moe/router.py",
                          "    if norm_topk:",
                          "    if True:",
                          ["tests/unit/test_model_options.py"]),
    # issue 18: sigmoid scores computed as a softmax
    "sigmoid_as_softmax": ("lightning_titan/model/moe/router.py",
                           "return torch.sigmoid(logits)",
                           "return torch.softmax(logits, dim=-1)",
                           ["tests/unit/test_model_options.py"]),
    # issue 18: Qwen3-MoE's q and k norms swapped on load (both [head_dim])
    "qk_norm_names_swapped": ("lightning_titan/hf/family.py",
                              '"attn.q_norm.weight": "self_attn.q_norm.weight",',
                              '"attn.q_norm.weight": "self_attn.k_norm.weight",',
                              ["tests/distributed/test_hf_archs.py", "-k", "one_process and qwen3"]),
    # issue 18: every family exported as Mixtral
    "export_as_mixtral": ("lightning_titan/hf/arch.py",
                          '"architectures": [family.class_name],',
                          '"architectures": ["MixtralForCausalLM"],',
                          ["tests/distributed/test_hf_archs.py", "-k", "own_family"]),
    # issue 18: the explicit head_dim of Qwen3-MoE dropped (ours is d_model / n_heads again)
    "head_dim_dropped": ("lightning_titan/model/config.py",
                         "return self.attn_head_dim or self.d_model // self.n_heads",
                         "return self.d_model // self.n_heads",
                         ["tests/distributed/test_hf_archs.py", "-k", "one_process and qwen3"]),
    # issue 18: a TP rank reads the whole of its q/k/v bias rows instead of its slice
    "tp_load_slices_ignored": ("lightning_titan/hf/load.py",
                               "shard = cut.get(id(target))",
                               "shard = None",
                               ["tests/distributed/test_hf_archs.py", "-k", "eight_ranks"]),
    # issue 18: tokenizer="auto" never sees the model's folder (the byte tokenizer always)
    "auto_tokenizer_ignored": ("lightning_titan/data/pipeline.py",
                               "return resolve_tokenizer(self.tokenizer_spec, self.model_folder)",
                               "return resolve_tokenizer(self.tokenizer_spec, None)",
                               ["tests/distributed/test_hf_finetune.py", "-k", "data_module"]),
    # issue 18: the export leaves the init_from folder's tokenizer behind
    "export_tokenizer_not_copied": ("lightning_titan/hf/export.py",
                                    "        shutil.copyfile(path, out / path.name)",
                                    "        pass",
                                    ["tests/distributed/test_hf_finetune.py", "-k", "resumes"]),
    # titan export writes every tensor in the checkpoint's dtype, whatever --dtype says
    "export_dtype_ignored": ("lightning_titan/hf/shards.py",
                             "    if dtype is None or not tensor.is_floating_point():\n",
                             "    if True:\n",
                             ["tests/unit/test_export_shards.py", "-k", "transformers and bf16"]),
    # titan export writes one file whatever --max-shard-size says
    "export_shard_size_ignored": ("lightning_titan/hf/shards.py",
                                  "if not shards or used + size > max_bytes:",
                                  "if not shards:",
                                  ["tests/unit/test_export_shards.py", "-k", "transformers and fp32"]),
    # titan export reads every tensor of the checkpoint at once before it writes the first file
    "export_reads_whole_checkpoint": ("lightning_titan/hf/shards.py",
                                      "    made = [g.make(list(g.shapes)) for g in groups]",
                                      "    made = [g.make(read(list(g.sources))) for g in groups]",
                                      ["tests/unit/test_export_shards.py", "-k", "one_file"]),
    # config.json says float32 whatever dtype the weights were written in
    "export_config_dtype_stale": ("lightning_titan/hf/export.py",
                                  '    config["torch_dtype"] = str(written).removeprefix("torch.")\n',
                                  "",
                                  ["tests/unit/test_export_shards.py", "-k", "transformers and bf16"]),
    # an expert's row written as ours (x @ w), not as the family's nn.Linear weight
    "export_expert_not_transposed": ("lightning_titan/hf/shards.py",
                                     "    return {hf_name: tensors[0].t()}",
                                     "    return {hf_name: tensors[0]}",
                                     ["tests/unit/test_export_shards.py", "-k", "transformers and fp32"]),
    # every tensor the export reads goes through DCP's reader: a fresh tensor, then a copy (2x)
    "export_read_through_dcp": ("lightning_titan/checkpoint/reader.py",
                                "            if not records.read_into(self.path, self.metadata, key, out):",
                                "            if True:",
                                ["tests/unit/test_export_shards.py", "-k", "holds_a_tensor_once"]),
    # a record's bytes taken from where its zip entry's local header starts, not after its extra field
    "record_extra_field_ignored": ("lightning_titan/checkpoint/records.py",
                                   "_LOCAL_HEADER.size + name_len + extra_len",
                                   "_LOCAL_HEADER.size + name_len",
                                   ["tests/unit/test_export_shards.py", "-k", "rows_and_every"]),
    # a record saved with other strides (a transposed tensor) read as if contiguous
    "record_strides_ignored": ("lightning_titan/checkpoint/records.py",
                               "        or (numel > 1 and record.stride != _contiguous_stride(size))\n",
                               "",
                               ["tests/unit/test_export_shards.py", "-k", "rows_and_every"]),
    # every tensor of a safetensors file written by the export placed at offset 0 in its header
    "export_header_offsets_stuck": ("lightning_titan/hf/shards.py",
                                    "        offset = end\n",
                                    "",
                                    ["tests/unit/test_export_shards.py", "-k", "transformers and fp32"]),
    # gpt-oss's experts read a whole layer at a time, not one fused tensor's at a time
    "export_fused_whole_layer": ("lightning_titan/hf/shards.py",
                                 'fused.setdefault((name.split(".")[1], names[0]), [])',
                                 'fused.setdefault((name.split(".")[1], ""), [])',
                                 ["tests/unit/test_export_shards.py", "-k", "gpt_oss"]),
    # gpt-oss's fused experts stacked in the wrong order (expert e's rows under another id)
    "export_fused_rows_reversed": ("lightning_titan/hf/shards.py",
                                  "torch.stack(tensors[i * n : (i + 1) * n])",
                                  "torch.stack(tensors[i * n : (i + 1) * n][::-1])",
                                  ["tests/unit/test_export_shards.py", "-k", "gpt_oss"]),
    # issue 18: a rank reads every tensor of the file it opens, not only its own
    "load_reads_whole_file": ("lightning_titan/hf/load.py",
                              "tensor = f.get_tensor(hf_name)",
                              "tensor = [f.get_tensor(k) for k in f.keys()] and f.get_tensor(hf_name)",
                              ["tests/distributed/test_hf_load.py", "-k", "share"]),
    # issue 18: the same, through a checkpoint written under tp4 and read under tp2 and whole
    "ckpt_bias_not_cut": ("lightning_titan/parallel/tensor_parallel.py",
                          'if s.dim == 0 and isinstance(getattr(m, "bias", None), Tensor):',
                          "if False:",
                          ["tests/distributed/test_checkpoint.py", "-k", "save_under_one"]),
    # found with issue 18: the grouped-GEMM probe runs under the caller's no_grad and caches "no"
    "probe_under_no_grad": ("lightning_titan/model/moe/experts.py",
                            "with torch.inference_mode(False), torch.enable_grad():",
                            "if True:",
                            ["tests/unit/test_experts.py"]),
    # issue 43: ZBV sends an action's output in a batch of its own, ahead of the receives of the
    # step (the old exchange): NCCL, one stream per rank, deadlocks (the strict transport's wait)
    "zbv_send_alone": ("lightning_titan/parallel/pipeline/stage.py",
                       "xs, gs = self.links.exchange_many(to_next, to_prev, len(from_prev), len(from_next))",
                       "self.links.exchange_many(to_next, to_prev); xs, gs = self.links.exchange_many("
                       "[], [], len(from_prev), len(from_next))",
                       ["tests/distributed/test_nccl_strict.py", "-k", "pp2"]),
    # issue 43: the GPU path holds every send-only batch to the step's end (O(M) sent buffers)
    "sends_held_to_finish": ("lightning_titan/parallel/pipeline/p2p.py",
                             "            self._wait_sends(SENDS_IN_FLIGHT)\n",
                             "",
                             ["tests/unit/test_gpu_readiness.py", "-k", "send_only"]),
    # issue 43: the ranks' watch blind to a dead peer on its own host (only the store's silence left)
    "peer_watch_blind": ("lightning_titan/runtime/peer_watch.py",
                         "dead = [(r, pid) for r, pid in dead_peers(self.peers) if r != self.rank]",
                         "dead: list[tuple[int, int]] = []",
                         ["tests/distributed/test_multinode.py", "-k", "never_fails"]),
    # issue 43: the rank that announces a death leaves before the other nodes have read it
    "peer_watch_no_wait": ("lightning_titan/runtime/peer_watch.py",
                           "deadline = time.monotonic() + HEARD_S",
                           "deadline = time.monotonic()",
                           ["tests/distributed/test_multinode.py", "-k", "never_fails"]),
    # titan doctor: a row that hangs past its deadline reported as passing
    "doctor_timeout_passes": ("lightning_titan/tools/doctor.py",
                              "ok, numbers = False, _first_lines(str(err))",
                              "ok, numbers = True, _first_lines(str(err))",
                              ["tests/distributed/test_doctor.py", "-k", "hung"]),
    # titan doctor: a failed row leaves `titan doctor` with exit status 0
    "doctor_exit_zero": ("lightning_titan/cli.py",
                         "            sys.exit(status)\n",
                         "            pass\n",
                         ["tests/distributed/test_doctor.py", "-k", "hung"]),
    # titan doctor: the ep2 rows pass whatever their losses are
    "doctor_smoke_no_tolerance": ("lightning_titan/tools/doctor.py",
                                  "    ok = diff <= TOLERANCE[name] and same_gemm\n",
                                  "    ok = same_gemm\n",
                                  ["tests/distributed/test_doctor.py", "-k", "judges"]),
    # background_round_trip: a writer's context on another rank's GPU goes unreported
    "selfcheck_stray_context": ("lightning_titan/checkpoint/selfcheck.py",
                                "        if others:",
                                "        if False:",
                                ["tests/distributed/test_doctor.py", "-k", "judges"]),
    # every grad summed over the data ranks, not averaged: under Adam the losses barely move, the
    # grad norm doubles; titan doctor's ep2 rows compare the norms too and must fail
    "doctor_sees_grad_scale": ("lightning_titan/train/engine.py",
                               "scale = 1.0 / dims.data_world",
                               "scale = 1.0",
                               ["tests/distributed/test_doctor.py", "-k", "every_row"]),
    # a background save that does not stage: the thread writes the live tensors, which training
    # overwrites meanwhile; titan doctor's background_save row must fail
    "doctor_sees_unstaged_save": ("lightning_titan/checkpoint/background.py",
                                  "        return buffer.copy_(tensor.detach(), non_blocking=True)",
                                  "        return tensor.detach()",
                                  ["tests/distributed/test_doctor.py", "-k", "every_row"]),
    # `titan fit` with no --config under Lightning's strategy="auto" (which TitanLM refuses)
    "cli_default_strategy_auto": ("lightning_titan/cli.py",
                                  '"strategy": {"class_path": "lightning_titan.TitanStrategy"},',
                                  '"strategy": "auto",',
                                  ["tests/cli/test_errors.py", "-k", "without_a_config", "-m", "slow"]),
    # the degrees against devices x num_nodes left to the Trainer: the seed's line comes first
    "cli_world_unknown": ("lightning_titan/lightning/arguments.py",
                          "    return devices * num_nodes\n",
                          "    return None\n",
                          ["tests/cli/test_errors.py", "-k", "fit_the_world", "-m", "slow"]),
    # the layout against the model left to the launcher: a traceback after the Trainer's lines
    "cli_model_split_late": ("lightning_titan/lightning/arguments.py",
                             "        config.validate_layout(\n            **split, split=strategy.options.split, fold_ep=strategy.layout.fold_ep\n        )\n",
                             "        pass\n",
                             ["tests/cli/test_errors.py", "-k", "fit_the_model", "-m", "slow"]),
    # a misspelt schedule left to jsonargparse: its usage and every union type's complaint
    "cli_choice_unchecked": ("lightning_titan/cli.py",
                             "            arguments.check_choices_in_argv(argv)\n",
                             "            pass\n",
                             ["tests/cli/test_errors.py", "-k", "misspelt", "-m", "slow"]),
    # `--trainer.strategy.init_args.schedule gpipee` (the value as the next word) not checked
    "cli_choice_space_form": ("lightning_titan/lightning/arguments.py",
                              "            value = argv[i + 1]\n",
                              "            continue\n",
                              ["tests/cli/test_errors.py", "-k", "each_form"]),
    # Lightning's tips and accelerator lines let through
    "quiet_chatter_kept": ("lightning_titan/lightning/quiet.py",
                           "        return not str(record.msg).startswith(LIGHTNING_CHATTER)\n",
                           "        return True\n",
                           ["tests/unit/test_fit_summary.py", "-k", "tips"]),
    # datasets' bars shown while the packed data is saved
    "quiet_save_bars_shown": ("lightning_titan/data/prepare.py",
                              "    datasets.utils.disable_progress_bars()\n",
                              "    pass\n",
                              ["tests/unit/test_fit_summary.py", "-k", "progress_bars"]),
    # the mean tokens/s and MFU count the first step (compilation, warm-up)
    "summary_first_step_counted": ("lightning_titan/lightning/summary.py",
                                   "        if self._steps == 1:\n            return\n",
                                   "",
                                   ["tests/unit/test_fit_summary.py", "-k", "mean_leaves_out"]),
    # the summary's peak memory of rank 0 alone, not the range over the ranks
    "summary_memory_rank0": ("lightning_titan/lightning/summary.py",
                             '        high, low = trainer.strategy.reduce(mine.to(trainer.strategy.root_device), reduce_op="max")\n',
                             "        high, low = mine\n",
                             ["tests/unit/test_fit_summary.py", "-k", "range_over"]),
    # `titan fit` itself leaves Lightning's chatter on (the filter is never installed)
    "quiet_chatter_not_installed": ("lightning_titan/lightning/quiet.py",
                                    "    quiet_lightning_chatter()\n    # Lightning 2.6",
                                    "    # Lightning 2.6",
                                    ["tests/cli/test_errors.py", "-k", "without_a_config", "-m", "slow"]),
    # the loss curve keeps the first row of a step a restarted attempt redid, not the last
    "loss_curve_first_row": ("lightning_titan/lightning/summary.py",
                             '{int(r["step"]): float(r[key]) for r in rows if r.get(key)}',
                             '{int(r["step"]): float(r[key]) for r in reversed(rows) if r.get(key)}',
                             ["tests/unit/test_fit_summary.py", "-k", "loss_curve"]),
    # the loss curve without the val loss
    "loss_curve_no_val": ("lightning_titan/lightning/summary.py",
                          '    return curve("train_loss"), curve("val_loss")\n',
                          '    return curve("train_loss"), []\n',
                          ["tests/unit/test_fit_summary.py", "-k", "loss_curve"]),
    # `titan fit` draws no loss curve (and its summary names none)
    "loss_curve_not_drawn": ("lightning_titan/cli.py",
                             "            curve = draw_loss_curve(self.trainer)\n",
                             "            curve = None\n",
                             ["tests/cli/test_errors.py", "-k", "without_a_config", "-m", "slow"]),
    # a WandbLogger's files (and the run's checkpoints) outside the run folder
    "wandb_no_run_folder": ("lightning_titan/lightning/run_folders.py",
                            "        args.save_dir = str(folder)\n",
                            "        pass\n",
                            ["tests/unit/test_run_versions.py", "-k", "weights_and_biases"]),
    # a split too small for one batch: a plain ValueError, reported as a rank's failure
    "too_little_data_plain": ("lightning_titan/data/checks.py",
                              "            raise TooLittleData(\n",
                              "            raise ValueError(\n",
                              ["tests/cli/test_errors.py", "-k", "split_too_small"]),
    # the ranks report it as their failure, with a traceback
    "too_little_data_rank_report": ("lightning_titan/lightning/strategy.py",
                                    "        if isinstance(exception, TooLittleData):\n",
                                    "        if False:\n",
                                    ["tests/cli/test_errors.py", "-k", "one_line_from_the_ranks", "-m", "slow"]),
    # a forked rank's TooLittleData reaches the parent as torch's traceback text
    "too_little_data_fork_text": ("lightning_titan/lightning/launchers.py",
                                  "    return TooLittleData(said[-1][len(prefix) :]) if said else None\n",
                                  "    return None\n",
                                  ["tests/cli/test_errors.py", "-k", "forked_rank"]),
    # PipelineTimeline writes into the working directory, not the run's log folder
    "timeline_in_cwd": ("lightning_titan/lightning/callbacks.py",
                        "        self.out_dir = in_run_folder(trainer, self.out_dir)\n",
                        "        pass\n",
                        ["tests/unit/test_fit_summary.py", "-k", "log_folder"]),
    # ExpertLoad's plot in the working directory, not the run's log folder
    "expert_plot_in_cwd": ("lightning_titan/lightning/callbacks.py",
                           "            self.plot_path = str(in_run_folder(trainer, self.plot_path))\n",
                           "            pass\n",
                           ["tests/unit/test_fit_summary.py", "-k", "log_folder"]),
    # chat records: every turn trained, not only the assistant's
    "chat_prompt_trained": ("lightning_titan/data/chat.py",
                            'pieces.append((content, role == "assistant", True))',
                            "pieces.append((content, True, True))",
                            ["tests/unit/test_chat_data.py", "-k", "built_in_template"]),
    # instruction windows: the targets are the ids shifted, the labels ignored
    "chat_labels_ignored": ("lightning_titan/data/packing.py",
                            "inputs, targets = windows[:, 0, :-1].contiguous(), windows[:, 1, 1:].contiguous()",
                            "inputs, targets = windows[:, 0, :-1].contiguous(), windows[:, 0, 1:].contiguous()",
                            ["tests/unit/test_chat_data.py", "-k", "shifted_labels"]),
    # train_on left out of the prepared cache's key: train_on="all" reads the "responses" cache
    "chat_train_on_not_keyed": ("lightning_titan/data/prepare.py",
                                '        spec["records"] = [src.data_format, src.train_on]',
                                "        pass",
                                ["tests/unit/test_chat_data.py", "-k", "shifted_labels"]),
    # a record longer than the window kept instead of skipped and reported
    "chat_too_long_kept": ("lightning_titan/data/records.py",
                          "        if len(rendered.ids) > window:",
                          "        if False:",
                          ["tests/unit/test_chat_data.py", "-k", "longer_than_a_window"]),
    # titan fit starts its ranks before a malformed record is found
    "chat_records_unchecked": ("lightning_titan/cli.py",
                               "        check_records(config.get(\"data\"))\n",
                               "",
                               ["tests/unit/test_chat_data.py", "-k", "before_it_starts"]),
    # a tokenizer's own chat template ignored: its chats rendered in the built-in one
    "chat_template_ignored": ("lightning_titan/data/chat.py",
                              'if data_format == "chat" and isinstance(tokenizer, HFTokenizer) and tokenizer.chat_template:',
                              "if False:",
                              ["tests/unit/test_chat_data.py", "-k", "own_chat_template"]),
    # the template's assistant header (its generation prompt) trained with the answer
    "chat_template_header_trained": ("lightning_titan/data/chat.py",
                                     "before = _apply(tokenizer, turns[:i], generation_prompt=True)",
                                     "before = _apply(tokenizer, turns[:i], generation_prompt=False)",
                                     ["tests/unit/test_chat_data.py", "-k", "own_chat_template"]),
    # LoRA: a column-parallel projection's adapter cuts A (not B) under TP
    "lora_cut_swapped": ("lightning_titan/model/lora.py",
                         "factor = module.lora_B if shard.dim == 0 else module.lora_A",
                         "factor = module.lora_A if shard.dim == 0 else module.lora_B",
                         ["tests/distributed/test_lora_layouts.py"]),
    # LoRA: the adapters' factors not declared as TP-cut (reduced and checkpointed as whole)
    "lora_cuts_undeclared": ("lightning_titan/model/attention.py",
                             "        self.tp_cuts.update(adapters.factor_cuts(self.tp_cuts))  # the adapters' factors alike\n",
                             "",
                             ["tests/distributed/test_lora_layouts.py"]),
    # LoRA: the base left trainable
    "lora_base_trains": ("lightning_titan/model/decoder.py",
                         "            adapters.freeze_base(self)\n",
                         "            pass\n",
                         ["tests/distributed/test_lora_layouts.py"]),
    # LoRA: the experts' adapters unscaled on the grouped path
    "lora_experts_unscaled": ("lightning_titan/model/moe/experts.py",
                              "                out = out + torch._grouped_mm(low, b, offs=offsets) * self.lora_scale",
                              "                out = out + torch._grouped_mm(low, b, offs=offsets)",
                              ["tests/unit/test_lora.py", "-k", "peft"]),
    # LoRA: the experts' adapters unscaled on the loop
    "lora_loop_unscaled": ("lightning_titan/model/moe/experts.py",
                           "            return (self.lora_dropout(rows) @ a[e]) @ b[e] * self.lora_scale",
                           "            return (self.lora_dropout(rows) @ a[e]) @ b[e]",
                           ["tests/unit/test_lora.py", "-k", "peft"]),
    # PEFT export: a gate_up adapter's B not block-diagonal (up's rank reaches gate's rows)
    "peft_gate_up_dense": ("lightning_titan/hf/adapter.py",
                           "    b[:, :rank, :ffn], b[:, rank:, ffn:] = b1, b3",
                           "    b[:, :rank, :ffn], b[:, rank:, :ffn] = b1, b3",
                           ["tests/unit/test_lora.py", "-k", "peft"]),
    # LoRA: A drawn without the layout-free seed (each rank its own RNG)
    "lora_init_global_rng": ("lightning_titan/model/lora.py",
                             "    return (torch.rand(shape, generator=generator, device=\"cpu\") * 2 - 1) * bound",
                             "    return (torch.rand(shape, device=\"cpu\") * 2 - 1) * bound",
                             ["tests/distributed/test_lora_layouts.py"]),
    # LoRA: a checkpoint keeps the frozen base too (not adapter-only)
    "lora_ckpt_holds_base": ("lightning_titan/checkpoint/state.py",
                             "        if isinstance(value, nn.Parameter) and not value.requires_grad:\n            continue\n",
                             "",
                             ["tests/distributed/test_lora_layouts.py"]),
    # LoRA export: the merge leaves out the adapters' scale
    "lora_merge_unscaled": ("lightning_titan/model/lora.py",
                            "        self.weight.add_(update.to(self.weight.dtype), alpha=self.scale)",
                            "        self.weight.add_(update.to(self.weight.dtype))",
                            ["tests/cli/test_lora_cli.py"]),
    # LoRA export: the base rebuilt from the seed, not from the init_from folder it was trained on
    "lora_export_seed_base": ("lightning_titan/hf/export.py",
                              "        hf_load.load_stage(model, folder)\n",
                              "        model.init_weights(hparams[\"seed\"])\n",
                              ["tests/cli/test_lora_cli.py"]),
    # packed documents: RoPE positions run on across a sequence instead of restarting per document
    "docs_positions_not_restarted": ("lightning_titan/model/documents.py",
                                     "    return index - first\n",
                                     "    return index\n",
                                     ["tests/unit/test_packed_documents.py"]),
    # packed documents: a query also sees the earlier documents of its sequence
    "docs_mask_crosses": ("lightning_titan/model/documents.py",
                          "same_BQK = documents_BS[:, mine].unsqueeze(2) == documents_BS[:, keys].unsqueeze(1)",
                          "same_BQK = documents_BS[:, mine].unsqueeze(2) >= documents_BS[:, keys].unsqueeze(1)",
                          ["tests/unit/test_packed_documents.py"]),
    # packed documents under CP: each rank's queries take the ids of the first S/cp positions, not
    # of its two load-balanced chunks
    "docs_cp_slice": ("lightning_titan/model/documents.py",
                      "        mine = context_parallel.local_positions(seq_len, cp_group, device)\n",
                      "        mine = context_parallel.local_positions(seq_len, None, device)[: seq_len // tp_size(cp_group)]\n",
                      ["tests/distributed/test_equivalence.py", "-k", "2]"]),
    # packed documents under PP: the stages after the embedding's run without the ids
    "docs_first_stage_only": ("lightning_titan/parallel/pipeline/stage.py",
                              "            documents = None if self.documents is None else self.documents[i]\n",
                              "            documents = None if self.documents is None or not self.embeds(chunk) else self.documents[i]\n",
                              ["tests/distributed/test_equivalence.py", "-k", "2]"]),
    # packed records: a record's first token stays the previous record's last token's target
    "pack_first_label": ("lightning_titan/data/packing.py",
                         "        labels[0] = IGNORE_INDEX\n",
                         "",
                         ["tests/unit/test_chat_data.py", "-k", "packed_records"]),
    # packed records: every record of a window given document id 0 (one attention span)
    "record_packer_one_document": ("lightning_titan/data/packing.py",
                                   "        document = self._open[2, -1] + 1 if self._open.shape[1] else 0\n",
                                   "        document = 0\n",
                                   ["tests/unit/test_chat_data.py", "-k", "packed_records"]),
    # streamed records held out by their raw line, not the record the map-style path hashes
    "stream_records_held_out_by_line": ("lightning_titan/data/record_stream.py",
                                        "        return held_out_key(record), (where, record)\n",
                                        "        return example[\"record\"], (where, record)\n",
                                        ["tests/unit/test_chat_streaming.py", "-k", "map_style"]),
    # a streamed record's leftover saved end to end like text's (its rows run together)
    "stream_record_leftover_flattened": ("lightning_titan/data/streaming.py",
                                         "    if parts[-1].ndim == 1:\n",
                                         "    if True:\n",
                                         ["tests/unit/test_chat_streaming.py", "-k", "resumed"]),
    # a resumed record stream starts an empty window (the saved leftover not given to the packer)
    "stream_record_leftover_dropped": ("lightning_titan/data/record_stream.py",
                                       "        return RecordPacker(self.window, self.tokenizer.eod_id, self.pack, leftover)\n",
                                       "        return RecordPacker(self.window, self.tokenizer.eod_id, self.pack)\n",
                                       ["tests/unit/test_chat_streaming.py", "-k", "resumed"]),
    # a record packer rebuilt from a leftover with ready windows takes them for its open window
    "record_packer_ready_reopened": ("lightning_titan/data/packing.py",
                                     "            full = leftover.shape[1] // window * window  # the open window is never full\n",
                                     "            full = 0\n",
                                     ["tests/unit/test_chat_streaming.py", "-k", "rebuilt"]),
    # a streamed record longer than the window packed instead of skipped and counted
    "stream_records_too_long_kept": ("lightning_titan/data/record_stream.py",
                                     "        if len(rendered.ids) > self.window:\n",
                                     "        if False:\n",
                                     ["tests/unit/test_chat_streaming.py", "-k", "malformed"]),
    # a malformed streamed record raised without its file and line
    "stream_record_unnamed": ("lightning_titan/data/record_stream.py",
                              "        with named(where, kind):\n",
                              "        with named(\"a record\", kind):\n",
                              ["tests/unit/test_chat_streaming.py", "-k", "malformed"]),
    # records cached one a sequence by an older version served as if packed (never rebuilt)
    "pack_stale_cache_served": ("lightning_titan/data/prepare.py",
                                '    if "format" in meta and "packed" not in meta:',
                                "    if False:",
                                ["tests/unit/test_chat_data.py", "-k", "before_packing"]),
    # packed text: the end id's target (the next document's first token) still counted
    "pack_text_crossing_target": ("lightning_titan/data/packing.py",
                                  "    targets = targets.masked_fill(ends, IGNORE_INDEX)\n",
                                  "",
                                  ["tests/unit/test_chat_data.py", "-k", "packed_text"]),
    # titan fit --help without the strategy's options
    "cli_help_no_strategy": ("lightning_titan/cli.py",
                             "                print(arguments.strategy_help())\n",
                             "                pass\n",
                             ["tests/cli/test_help.py"]),
    # LoRA: base_dtype="bf16" leaves the frozen base in fp32
    "lora_base_not_stored": ("lightning_titan/model/decoder.py",
                             "        init_weights(self, self.config, seed, (tp_size(self.tp_group), self.tp_rank))\n        if self.lora is not None:\n            adapters.store_base_(self, self.lora)\n",
                             "        init_weights(self, self.config, seed, (tp_size(self.tp_group), self.tp_rank))\n",
                             ["tests/unit/test_lora.py", "-k", "bf16"]),
    # LoRA: the bf16 base without bf16 autocast is not refused while parsing
    "lora_base_precision_unchecked": ("lightning_titan/cli.py",
                                      "        check_lora(config.get(\"model\"), trainer.get(\"precision\"))\n",
                                      "",
                                      ["tests/cli/test_errors.py", "-k", "lora"]),
    # a bad --model.init_from is a traceback from TitanLM, not one line while parsing
    "cli_init_from_unchecked": ("lightning_titan/cli.py",
                                "        check_init_from(config.get(\"model\"))\n",
                                "",
                                ["tests/cli/test_errors.py", "-k", "init_from"]),
    # packed documents' attention by query chunks: each chunk over its own keys only
    "docs_chunk_own_keys": ("lightning_titan/model/documents.py",
                            "        keys, values = k[:, :, first:end], v[:, :, first:end]  # a query sees no later key",
                            "        keys, values = k[:, :, start:end], v[:, :, start:end]",
                            ["tests/unit/test_packed_documents.py", "-k", "chunks"]),
    # each chunk's keys from its documents' start: the latest start over the batch, not the earliest
    "docs_key_start_latest": ("lightning_titan/model/documents.py",
                              "    return tuple(first_BS[:, ::QUERY_CHUNK].amin(dim=0).tolist())",
                              "    return tuple(first_BS[:, ::QUERY_CHUNK].amax(dim=0).tolist())",
                              ["tests/unit/test_packed_documents.py"]),
    # ... and by chunks where the keys are not the queries' positions in order (CP)
    "docs_chunk_cp_unguarded": ("lightning_titan/model/documents.py",
                                "    if s <= QUERY_CHUNK or mask.shape[-1] != s:",
                                "    if s <= QUERY_CHUNK:",
                                ["tests/unit/test_packed_documents.py", "-k", "chunks"]),
    # a longer run resumed from one that reached max_steps starts Lightning's next epoch of data
    "resume_epoch_by_lightning": ("lightning_titan/data/sampler.py",
                                  "        epoch = self._resume_at[0] + passes\n",
                                  "        epoch = self.epoch\n",
                                  ["tests/distributed/test_data.py", "-k", "longer_run"]),
    # the train loader has no state Lightning can save: it warns "not resumable" on every resume
    "loader_not_stateful": ("lightning_titan/data/pipeline.py",
                            "        if resumable:  # the train loader",
                            "        if False:  # the train loader",
                            ["tests/distributed/test_data.py", "-k", "longer_run"]),
    # every run of a config saves in one checkpoint folder again (last-v1.ckpt, "not empty")
    "run_folder_shared": ("lightning_titan/lightning/run_folders.py",
                          "                callback.init_args.dirpath = str(folder / runs.CHECKPOINTS)\n",
                          "                callback.init_args.dirpath = str(root / runs.CHECKPOINTS)\n",
                          ["tests/unit/test_run_versions.py", "-k", "own_folder"]),
    # a rank the launcher started picks the next free version itself, not the launcher's
    "run_version_not_handed": ("lightning_titan/lightning/run_folders.py",
                               "    if given:  # a rank that process started",
                               "    if False:  # a rank that process started",
                               ["tests/unit/test_run_versions.py", "-k", "launchers"]),
    # `last` (and a run folder) names the oldest complete checkpoint, not the newest
    "last_oldest": ("lightning_titan/checkpoint/runs.py",
                    "    for path in sorted(complete, key=files.completed_at, reverse=True):",
                    "    for path in sorted(complete, key=files.completed_at):",
                    ["tests/unit/test_run_versions.py", "-k", "newest"]),
    # a corrupt newest checkpoint is taken for `last` and by every restart (each fails the same way)
    "corrupt_not_skipped": ("lightning_titan/checkpoint/runs.py",
                            '            return f"{name} changed after the save"',
                            "            pass",
                            ["tests/unit/test_run_versions.py", "tests/unit/test_restarts.py"]),
    # a stopped rank outlives a launcher killed with SIGKILL (it cannot act on the death signal)
    "reaper_absent": ("lightning_titan/runtime/orphans.py",
                      "    reap(int(sys.argv[1]), [int(line) for line in sys.stdin])",
                      "    pass",
                      ["tests/distributed/test_preemption.py", "-k",
                       "launcher_killed_during_start_up"]),
    # the same, seen in a 2-rank fit whose launcher (rank 0) is killed while rank 1 is stopped
    "reaper_absent_job": ("lightning_titan/runtime/orphans.py",
                          "    reap(int(sys.argv[1]), [int(line) for line in sys.stdin])",
                          "    pass",
                          ["tests/distributed/test_preemption.py", "-k",
                           "gone_soon_after_its_launcher"]),
    # a restart after a stopped rank stalled the job blames the rank that timed out waiting for it
    "restart_stalled_unnamed": ("lightning_titan/lightning/restarts.py",
                                "                if failed and stalled:",
                                "                if False:",
                                ["tests/unit/test_restarts.py", "-k", "stopped_rank"]),
    # a restart with no checkpoint left says it resumes "the newest complete checkpoint"
    "restart_from_nothing_unsaid": ("lightning_titan/lightning/restarts.py",
                                    "                resumes = restart_checkpoint(given, trainer)",
                                    '                resumes = Path("the newest complete checkpoint")',
                                    ["tests/unit/test_restarts.py", "-k", "stopped_rank"]),
    # a connection closed by a node lost whole is reported with no rank or host named
    "lost_node_unnamed": ("lightning_titan/lightning/failures.py",
                          "    blamed = blamed or supervisor.lost_hosts(exception, rank=rank, peers=peers)",
                          "    pass",
                          ["tests/distributed/test_reliability.py", "-k", "lost_node"]),
    # a SIGTERM to a restarting launcher waits for good on a stopped rank (it cannot save `last`)
    "restart_sigterm_unbounded": ("lightning_titan/lightning/restarts.py",
                                  "self._stop_all(signal.SIGTERM, self.grace_s)",
                                  "self._stop_all(signal.SIGTERM, 3600.0)",
                                  ["tests/unit/test_restarts.py", "-k", "sigterm"]),
    # the same, seen by two torchrun "nodes" when node 0 is killed whole
    "lost_node_unnamed_job": ("lightning_titan/lightning/failures.py",
                              "    blamed = blamed or supervisor.lost_hosts(exception, rank=rank, peers=peers)",
                              "    pass",
                              ["tests/distributed/test_multinode.py", "-k", "lost_whole"]),
    # rank 0 resumes without saying from which step and checkpoint
    "resume_unsaid": ("lightning_titan/lightning/strategy.py",
                      "        if line:\n            supervisor.say(line)\n",
                      "        if False:\n            supervisor.say(line)\n",
                      ["tests/cli/test_run_folders.py"]),
    # every rank a launcher starts reads the checksums of `last` again (N+1 reads of the checkpoint)
    "resume_reverified_by_ranks": ("lightning_titan/lightning/run_folders.py",
                                   "    if handed is not None and (",
                                   "    if False and (",
                                   ["tests/unit/test_run_versions.py", "-k", "newest"]),
    # the planner counts grads and optimizer state for LoRA's frozen base
    "plan_lora_frozen_state": ("lightning_titan/plan/memory.py",
                               "no grad, no state\n            out[f\"{part}_params\"] += itemsize * numel * count\n            continue\n",
                               "no grad, no state\n            out[f\"{part}_params\"] += itemsize * numel * count\n",
                               ["tests/unit/test_plan_lora.py", "-k", "frozen"]),
    # the planner prices a frozen base's backward as a full one
    "plan_lora_backward_full": ("lightning_titan/plan/cost.py",
                                "    passes = (2 if frozen_base else 3) + (1 if options.recompute == FULL else 0)",
                                "    passes = 3 + (1 if options.recompute == FULL else 0)",
                                ["tests/unit/test_plan_lora.py", "-k", "frozen"]),
    # a rank's one-write line fails under a notebook's stderr (no file descriptor)
    "say_needs_fileno": ("lightning_titan/lightning/supervisor.py",
                         "    except (OSError, ValueError):  # a notebook's stream (ipykernel) has no descriptor",
                         "    except ImportError:",
                         ["tests/unit/test_run_versions.py", "-k", "descriptor"]),
    # zero=3, bf16 weights: the gather buffers fp32 (the all-gathers move twice the bytes)
    "z3bf16_gather_fp32": ("lightning_titan/parallel/dp/zero.py",
                           "buffer = self.unit_kept[dtype] = like.new_empty(size * self.n)",
                           "buffer = self.unit_kept[dtype] = like.new_empty(size * self.n, dtype=torch.float32)",
                           ["tests/distributed/test_bf16_master.py", "-k", "layouts"]),
    # zero=3, bf16 weights: whole_params's take_rows overwrites the fp32 master rows with the
    # bf16 weights' (every update's low bits lost, a load's masters rounded)
    "z3bf16_masters_retaken": ("lightning_titan/parallel/dp/zero3.py",
                               "                if not s.master:  # an fp32 master's rows: what a load wrote",
                               "                if True:  # an fp32 master's rows: what a load wrote",
                               ["tests/distributed/test_bf16_master.py", "-k", "layouts"]),
    # zero=3 kept whole for the step, bf16 weights: the fp32 master leaves become views of their
    # bf16 rows in the gathered parameter
    "z3bf16_masters_viewed": ("lightning_titan/parallel/dp/zero3.py",
                              "                if not s.master:  # an fp32 master stays its own tensor",
                              "                if True:  # an fp32 master stays its own tensor",
                              ["tests/distributed/test_bf16_master.py", "-k", "layouts"]),
    # zero=3, bf16 weights: after remove the model is the bf16 weights gathered, not its fp32
    # masters restored whole
    "z3bf16_removed_bf16": ("lightning_titan/train/engine.py",
                            "            else:  # bf16 weights: ``restore_masters`` gathers the fp32 rows, not the bf16 ones\n                self.sharded_params.release_all()  # (a prefetch in flight waited)\n        if self.masters is not None:  # bf16 weights: the model is its fp32 masters again\n            self.masters.restore()\n            for g in self.zero_groups if whole else ():",
                            "            else:  # bf16 weights: ``restore_masters`` gathers the fp32 rows, not the bf16 ones\n                self.sharded_params.gather_all()  # (a prefetch in flight waited)\n        if self.masters is not None:  # bf16 weights: the model is its fp32 masters again\n            self.masters.restore()\n            for g in self.zero_groups if whole and not self.sharded_params else ():",
                            ["tests/distributed/test_bf16_master.py", "-k", "layouts"]),
    # zero=3, bf16 weights: the planner prices the gathered units at 4 bytes a parameter
    "z3bf16_plan_gathered_fp32": ("lightning_titan/plan/memory.py",
                                  "units[block] += (BF16_BYTES if masters else t.itemsize) * whole",
                                  "units[block] += t.itemsize * whole",
                                  ["tests/distributed/test_bf16_master.py", "-k", "layouts"]),
    # zero=3, bf16 weights: the planner does not offer zero=3 with bf16 weights
    "z3bf16_plan_not_offered": ("lightning_titan/plan/layouts.py",
                                "                if zero == 3 and policy.offload:",
                                "                if zero == 3 and policy != FP32_STATE:",
                                ["tests/cli/test_plan.py", "-k", "zero3"]),
    # zero=3, bf16 weights: the planner's candidates gather fp32 units
    "z3bf16_plan_layout_gathered_fp32": ("lightning_titan/plan/layouts.py",
                                         "                       reshard_after_forward=per_block, param_dtype=param_dtype)",
                                         "                       reshard_after_forward=per_block)",
                                         ["tests/cli/test_plan.py", "-k", "zero3"]),
    # zero=3, bf16 weights: the planner counts bf16 rows of the weights between steps
    "z3bf16_plan_bf16_rows": ("lightning_titan/plan/memory.py",
                              "            held = 0  # its rows are the fp32 masters only",
                              "            held = owned  # its rows are the fp32 masters only",
                              ["tests/distributed/test_bf16_master.py", "-k", "layouts"]),
    # bf16 weights: the grads of the bf16 parameters summed in bf16 buckets, not fp32
    "master_reduce_bf16": ("lightning_titan/parallel/dp/reducer.py",
                           "            dtype = torch.float32 if has_master else params[0].dtype\n",
                           "            dtype = params[0].dtype\n",
                           ["tests/distributed/test_bf16_master.py", "-k", "layouts"]),
    # bf16 weights: the masters taken after the cast (they start at the init's bf16 rounding)
    "master_from_rounded": ("lightning_titan/parallel/dp/master.py",
                            "            master = nn.Parameter(p.detach().to(torch.float32, copy=True))\n            p.data = p.data.to(dtype)\n",
                            "            p.data = p.data.to(dtype)\n            master = nn.Parameter(p.detach().to(torch.float32, copy=True))\n",
                            ["tests/distributed/test_bf16_master.py", "-k", "plain"]),
    # bf16 weights: the parameters never take their updated masters
    "master_not_written_back": ("lightning_titan/train/engine.py",
                                "            self.masters.write_back()\n            self.masters.drop_held_grads()\n",
                                "            self.masters.drop_held_grads()\n",
                                ["tests/distributed/test_bf16_master.py", "-k", "plain"]),
    # bf16 weights: the norm read off the parameters' grads (the masters hold the reduced ones)
    "master_clip_params": ("lightning_titan/train/engine.py",
                           "                masters_of(self.masters, self.params),\n",
                           "                self.params,\n",
                           ["tests/distributed/test_bf16_master.py", "-k", "plain"]),
    # bf16 weights: a checkpoint holds the bf16 parameters, not the fp32 masters
    "master_ckpt_bf16": ("lightning_titan/checkpoint/state.py",
                         "        weight = zero_shards.weight(value).detach()  # a whole master for a bf16 parameter\n",
                         "        weight = value.detach()\n",
                         ["tests/distributed/test_bf16_master.py", "-k", "layouts"]),
    # bf16 weights: a load writes the masters, and the parameters keep their old values
    "master_load_not_cast": ("lightning_titan/train/engine.py",
                             "                    self.masters.write_back()\n                    for g in self.zero_groups:  # zero=1: the rows of every rank's masters\n                        g.gather()\n",
                             "                    pass\n",
                             ["tests/distributed/test_bf16_master.py", "-k", "layouts"]),
    # bf16 weights under zero=1: each step's rows of the bf16 parameters overwrite the fp32 masters
    "master_rows_rounded": ("lightning_titan/parallel/dp/zero.py",
                            "            if not s.master:  # a master's rows are the fp32 original of the parameter's\n",
                            "            if True:\n",
                            ["tests/distributed/test_bf16_master.py", "-k", "layouts"]),
    # bf16 weights under zero=1: a rank keeps the whole fp32 masters besides its rows
    "master_rows_kept_whole": ("lightning_titan/parallel/dp/master.py",
                               "        master = self._master.pop(id(param), None)\n",
                               "        master = self._master.get(id(param))\n",
                               ["tests/distributed/test_bf16_master.py", "-k", "layouts"]),
    # bf16 weights under zero=1: the shards' grads bound from the bf16 grads (None: dropped), not the fp32 reduced ones
    "master_rows_bf16_grads": ("lightning_titan/train/engine.py",
                               "                g.bind_grads(None if self.masters is None else self._reduced_grad)\n",
                               "                g.bind_grads()\n",
                               ["tests/distributed/test_bf16_master.py", "-k", "layouts"]),
    # the planner prices bf16 weights without their fp32 masters
    "plan_bf16_no_master": ("lightning_titan/plan/memory.py",
                            "        out[f\"{part}_optimizer\"] += BYTES * (MOMENTS + masters) * owned * count\n",
                            "        out[f\"{part}_optimizer\"] += BYTES * MOMENTS * owned * count\n",
                            ["tests/distributed/test_bf16_master.py", "-k", "layouts"]),
    # bf16 weights under zero=2: the grads reduce-scattered in bf16, not fp32
    "master_zero2_bf16_scatter": ("lightning_titan/parallel/dp/zero_grads.py",
                                  "        dtype = torch.float32 if has_master else params[0].dtype\n",
                                  "        dtype = params[0].dtype\n",
                                  ["tests/distributed/test_bf16_master.py", "-k", "layouts"]),
    # bf16 weights under zero=2: the norm reads the bf16 parameters' grads for the whole ones
    "master_zero2_clip_params": ("lightning_titan/parallel/dp/zero_grads.py",
                                 "            grad = r.reduced_grad(p)  # bf16 weights: the master's\n",
                                 "            grad = p.grad\n",
                                 ["tests/distributed/test_bf16_master.py", "-k", "layouts"]),
    # titan plan --check runs a layout at the bench's microbatch count, not the one planned
    "check_bench_microbatches": ("lightning_titan/tools/plan_check.py",
                                 "        microbatches=r.options.microbatches,",
                                 "        microbatches=None,",
                                 ["tests/cli/test_plan.py", "-k", "microbatch_count_planned"]),
    # optimizer offload: the updated host copies never come back to the device
    "offload_no_copy_back": ("lightning_titan/parallel/dp/offload.py",
                             "            device.copy_(host, non_blocking=self.pinned)\n",
                             "            pass\n",
                             ["tests/distributed/test_bf16_master.py", "-k", "layouts"]),
    # optimizer offload: a resume leaves the host copies at their values before the load
    "offload_no_refresh": ("lightning_titan/parallel/dp/offload.py",
                           "            host.copy_(device)\n", "            pass\n",
                           ["tests/distributed/test_bf16_master.py", "-k", "layouts"]),
    # optimizer offload: the device keeps its fp32 masters while the host steps
    "offload_masters_kept": ("lightning_titan/parallel/dp/offload.py",
                             "            t.untyped_storage().resize_(0)\n", "            pass\n",
                             ["tests/distributed/test_bf16_master.py", "-k", "layouts"]),
    # optimizer offload: the CPU step reads the grads of the step before (the buffers not written)
    "offload_stale_grads": ("lightning_titan/parallel/dp/offload.py",
                            "            buffer.copy_(grad, non_blocking=self.pinned)\n", "",
                            ["tests/distributed/test_bf16_master.py", "-k", "layouts"]),
    # optimizer offload: a checkpoint cannot key the host copies by their parameters' names
    "offload_unkeyed": ("lightning_titan/parallel/dp/zero.py",
                        "        if self.offload is not None:\n            tensor = self.offload.device_tensor(tensor)\n        return self._by_leaf",
                        "        return self._by_leaf",
                        ["tests/distributed/test_bf16_master.py", "-k", "layouts"]),
    # the planner leaves offload's moments and masters on the device
    "plan_offload_state_kept": ("lightning_titan/plan/memory.py",
                                "        if not offload:\n            out[f\"{part}_optimizer\"]",
                                "        if True:\n            out[f\"{part}_optimizer\"]",
                                ["tests/cli/test_plan.py", "-k", "offload_prices"]),
    # the planner's offloaded step forgets the PCIe copies
    "plan_offload_no_copies": ("lightning_titan/plan/cost.py",
                               "        copies = owned * 2 * BYTES / device.host_link_bandwidth\n",
                               "        copies = 0.0\n",
                               ["tests/cli/test_plan.py", "-k", "offload_prices"]),
    # fold_ep: the expert grads still summed over the tp (and cp) ranks, which own other experts now
    "fold_expert_dp_over_tp": ("lightning_titan/parallel/mesh.py",
                               '    "expert_dp": ("dp",),\n',
                               '    "expert_dp": ("dp", "cp", "tp"),\n',
                               ["tests/unit/test_parallel_dims.py"]),
    # fold_ep: a rank owns the experts of its ep coordinate (two TP ranks the same ones)
    "fold_expert_rank_unfolded": ("lightning_titan/parallel/mesh.py",
                                  '        for axis in self.group_axes("ep"):\n',
                                  '        for axis in GROUPS["ep"]:\n',
                                  ["tests/unit/test_parallel_dims.py"]),
    # fold_ep: the process groups built unfolded under folded dims (the all-to-all over ep only)
    "fold_groups_built_unfolded": ("lightning_titan/parallel/mesh.py",
                                   "        axes = dims.group_axes(kind)\n",
                                   "        axes = GROUPS[kind]\n",
                                   ["tests/distributed/test_equivalence.py", "-k", "2]"]),
    # fold_ep: the norm counts an expert on tp rank 0 only, as if the TP ranks held copies
    "fold_norm_counts_tp0": ("lightning_titan/parallel/mesh.py",
                             'if a in self.group_axes(kind))',
                             'if a in GROUPS[kind])',
                             ["tests/distributed/test_equivalence.py", "-k", "2]"]),
    # fold_ep: an expert owner divides its grads by the folded EP degree (ep x tp) instead of ep (the
    # experts have a reducer of their own where ep > 1 and dp > 1: dp2 x ep2 x tp2 folded)
    "fold_expert_grad_scale": ("lightning_titan/train/engine.py",
                               "params, group, scale=scale, bucket_cap_mb",
                               "params, group, scale=scale * dims.ep / dims.expert_world if params[0] is self.expert_params[0] else scale, bucket_cap_mb",
                               ["tests/distributed/test_equivalence.py", "-k", "8]"]),
    # fold_ep: the grads averaged over dp x the folded EP degree (ep x cp x tp) instead of the data
    # ranks (dp x ep): the TP ranks of a fold read the same sequences
    "fold_grad_scale": ("lightning_titan/train/engine.py",
                        "        scale = 1.0 / dims.data_world  # the global mean",
                        "        scale = 1.0 / (dims.dp * dims.expert_world)  # the global mean",
                        ["tests/distributed/test_equivalence.py", "-k", "2]"]),
    # interleaved 1F1B's bubble without the v (1F1B's fill at every v)
    "plan_vstages_bubble_v": ("lightning_titan/plan/cost.py",
                              "    fill = (pp - 1) / virtual_stages\n",
                              "    fill = (pp - 1) / 1\n",
                              ["tests/unit/test_plan_split.py", "-k", "replay"]),
    # an uneven rank's layers all on its first chunk (the others emptied: the split unbalanced)
    "plan_vstages_split_lumped": ("lightning_titan/plan/cost.py",
                                  "            chunks.append((q + 1,) * extra + (q,) * (v - extra))",
                                  "            chunks.append((held,) + (0,) * (v - 1))",
                                  ["tests/unit/test_plan_split.py", "-k", "virtual or every_v"]),
    # the virtual stages dealt rank-major instead of round-robin (the ranks' sums not the layout's)
    "plan_vstages_split_order": ("lightning_titan/plan/cost.py",
                                 "    counts = tuple(chunks[s % pp][s // pp] for s in range(pp * v))",
                                 "    counts = tuple(chunks[s // v][s % v] for s in range(pp * v))",
                                 ["tests/unit/test_plan_split.py", "-k", "virtual or every_v"]),
    # the last rank's chunks dealt evenly, the head's chunk as full as the others
    "plan_vstages_split_no_head": ("lightning_titan/plan/cost.py",
                                   "        if rank == pp - 1:\n            chunks.append(",
                                   "        if False:\n            chunks.append(",
                                   ["tests/unit/test_plan_split.py", "-k", "virtual or every_v"]),
    # interleaved offered only where pp * v divides the layers (before uneven virtual splits)
    "plan_vstages_even_only": ("lightning_titan/plan/rank.py",
                               "                        virtual = virtual_split(config, pp, v, stage_layers)\n",
                               "                        virtual = virtual_split(config, pp, v, stage_layers)\n                        if virtual is not None:\n                            continue\n",
                               ["tests/unit/test_plan_split.py", "-k", "every_v"]),
    # --out writes the layout's per-rank split where interleaved runs a per-virtual-stage one
    "plan_vstages_out_per_rank": ("lightning_titan/tools/plan_cli.py",
                                  "    split = o.virtual_layers or c.stage_layers",
                                  "    split = c.stage_layers",
                                  ["tests/unit/test_plan_split.py", "-k", "every_v"]),
    # layout="auto" takes the layout's per-rank split where interleaved runs a per-virtual-stage one
    "plan_vstages_auto_per_rank": ("lightning_titan/plan/auto.py",
                                   "        o.virtual_layers or r.candidate.stage_layers,",
                                   "        r.candidate.stage_layers,",
                                   ["tests/unit/test_plan_split.py", "-k", "every_v"]),
    # the planner: a folded layout's all-to-all priced over the ep ranks only
    "foldplan_dispatch_unfolded": ("lightning_titan/plan/cost.py",
                                   '            groups("ep"),\n',
                                   '            ("ep",),\n',
                                   ["tests/unit/test_plan_fold.py", "-k", "dispatch"]),
    # the planner: a folded layout's expert grads priced as reduced over dp x cp x tp
    "foldplan_expert_grads_over_tp": ("lightning_titan/plan/cost.py",
                                      '    reduced = (groups("non_expert_dp"), groups("expert_dp"))\n    comm["dp"]',
                                      '    reduced = (groups("non_expert_dp"), ("dp", "cp", "tp"))\n    comm["dp"]',
                                      ["tests/unit/test_plan_fold.py", "-k", "dp_only"]),
    # the planner: a folded rank's state counted with the experts split over ep only
    "foldplan_state_unfolded": ("lightning_titan/plan/memory.py",
                                "config, ParallelDims(**degrees, rank=r, fold_ep=fold_ep), zero, split, lora,",
                                "config, ParallelDims(**degrees, rank=r), zero, split, lora,",
                                ["tests/unit/test_plan_fold.py", "-k", "state"]),
    # --out leaves fold_ep out of a folded row (titan fit would train it unfolded)
    "foldplan_out_unfolded": ("lightning_titan/tools/plan_cli.py",
                              '    keys["trainer.strategy.init_args.fold_ep"] = str(c.fold_ep).lower()',
                              '    keys["trainer.strategy.init_args.fold_ep"] = "false"',
                              ["tests/unit/test_plan_fold.py", "-k", "out_writes"]),
    # the planner probes selective recompute as no recompute (the norms' and activations' bytes kept)
    "plan_selective_probed_as_none": ("lightning_titan/plan/activations.py",
                                      "            activation_checkpointing=recompute,",
                                      "            activation_checkpointing=False,",
                                      ["tests/unit/test_plan_recompute.py"]),
    # selective recompute priced as free (it then ties with none, and ranks by chance)
    "plan_selective_free": ("lightning_titan/plan/cost.py",
                            "    if options.recompute == SELECTIVE:",
                            "    if False:",
                            ["tests/unit/test_plan_recompute.py"]),
    # --out writes selective as full recompute
    "plan_out_selective_as_full": ("lightning_titan/tools/plan_cli.py",
                                   '{NONE: "false", FULL: "true"}.get(',
                                   '{NONE: "false", FULL: "true", "selective": "true"}.get(',
                                   ["tests/unit/test_plan_recompute.py"]),
    # the search drops every unfolded layout with a folded twin, dominated or not
    "foldplan_twin_always_dominated": ("lightning_titan/plan/rank.py",
                                       "    if all(f <= p for f, p in zip(*reversed(sides), strict=True)):",
                                       "    if True:",
                                       ["tests/unit/test_plan_fold.py", "-k", "twin"]),
}  # fmt: skip

IGNORE = shutil.ignore_patterns(
    ".git", "__pycache__", ".pytest_cache", ".ruff_cache", "*.egg-info", ".benchmarks"
)


def apply(copy: Path, file: str, old: str, new: str) -> None:
    path = copy / file
    text = path.read_text()
    count = text.count(old)
    if count != 1:
        raise SystemExit(f"{file}: target {old!r} found {count} times (need exactly 1); update it")
    path.write_text(text.replace(old, new))


def run(name: str, timeout_s: float) -> tuple[str, float]:
    file, old, new, args = MUTATIONS[name]
    with tempfile.TemporaryDirectory(prefix=f"mutant-{name}-") as tmp:
        copy = Path(tmp) / "repo"
        shutil.copytree(ROOT, copy, ignore=IGNORE)
        apply(copy, file, old, new)
        env = {**os.environ, "PYTHONPATH": str(copy)}
        where = subprocess.run(
            [sys.executable, "-c", "import lightning_titan; print(lightning_titan.__file__)"],
            env=env, capture_output=True, text=True, cwd=copy,
        ).stdout.strip()  # fmt: skip
        if not where.startswith(str(copy)):
            raise SystemExit(f"the copy imports lightning_titan from {where!r}, not {copy}")
        # one process (no xdist): a failure is pytest rc 1, and -x stops at once
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-x",
            "-q",
            "-p",
            "no:cacheprovider",
            "-n",
            "0",
            *args,
        ]
        start = time.monotonic()
        try:
            proc = subprocess.run(
                cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout_s
            )
        except subprocess.TimeoutExpired:
            return "timeout", time.monotonic() - start
        seconds = time.monotonic() - start
    if proc.returncode == 1:
        # the first assertion line says what caught it
        caught = next(
            (ln[1:].strip() for ln in proc.stdout.splitlines() if ln.startswith("E ")), ""
        )
        return f"killed  {caught[:100]}", seconds
    if proc.returncode == 0:
        return "SURVIVED", seconds
    return f"error (pytest rc {proc.returncode}): {proc.stdout[-300:]}", seconds


def missing_targets(names: list[str]) -> list[str]:
    """One line per mutation whose file or target line is not there exactly once."""
    out = []
    for name in names:
        file, old, _, args = MUTATIONS[name]
        path = ROOT / file
        count = path.read_text().count(old) if path.is_file() else 0
        if count != 1:
            out.append(f"{name}: {file} has target {old!r} {count} times; update it")
        test_files = [a.split("::")[0] for a in args if a.startswith("tests/")]
        out += [f"{name}: no test file {t}" for t in test_files if not (ROOT / t).is_file()]
    return out


def main(argv: list[str]) -> int:
    unknown_flags = [a for a in argv if a.startswith("-") and a not in ("--check", "--all")]
    if unknown_flags or not argv:
        # every mutant runs its tests (an hour and more): only when asked for by name or --all
        print(__doc__)
        return 2 if unknown_flags else 0
    names = [a for a in argv if not a.startswith("--")] or list(MUTATIONS)
    unknown = [n for n in names if n not in MUTATIONS]
    if unknown:
        raise SystemExit(f"unknown mutations {unknown}; choose from {list(MUTATIONS)}")
    missing = missing_targets(
        names
    )  # every target first, so a moved line fails before anything runs
    if missing:
        raise SystemExit("\n".join(missing))
    if "--check" in argv:
        print(f"all {len(names)} targets found")
        return 0
    rows = []
    for name in names:
        verdict, seconds = run(name, timeout_s=900)
        rows.append((name, verdict, seconds))
        tests = " ".join(MUTATIONS[name][3])
        print(f"{name:22} {seconds:4.0f} s  {tests:45} {verdict}", flush=True)
    survived = [n for n, v, _ in rows if not v.startswith("killed")]
    print(
        f"\n{len(rows) - len(survived)}/{len(rows)} killed"
        + (f"; not killed: {survived}" if survived else "")
    )
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
