"""The mutations `make mutation` applies, one at a time, to a copy of the checkout.

Each re-introduces one known defect of the GPU path (docs/GPU.md: the ten of
issue 8, "old N"; issue 20's, "new N") or the per-parameter pack launch, as an
exact text replacement: ``old`` must occur exactly once in ``file`` (else the
mutation is stale: a harness error, never "caught"), and ``new`` replaces it.
``guards`` are the pytest node ids that should catch it; they run first (under
HYBRIDCOMM_SIMULATE_GPU=1 where the Makefile's SIM_TESTS run, without it
elsewhere); if they pass, the whole simulated suite runs to see whether
anything else does.

Not collected by pytest (no ``test_`` prefix); tests/test_mutation_list.py checks
that every ``old`` still applies to the current source.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple


@dataclass(frozen=True)
class Mutation:
    id: str
    defect: str  # "old 1" .. "old 10" (issue 8), "new 1" ... (issue 20), "pack per parameter"
    file: str  # relative to the repository root
    old: str
    new: str
    guards: Tuple[str, ...]
    what: str = ""


GPU = "tests/test_gpu_path.py::"
SIM = "tests/test_simgpu.py::"
NONE_PUT_BACK = GPU + "test_each_defect_put_back_is_reported[none-None]"

MUTATIONS = [
    # ---- issue 8: the ten old defects -------------------------------------------------------
    Mutation(
        "no-wait-before-use", "old 1", "hybridcomm/comm/channel.py",
        old="        stream.wait_event(event)\n",
        new="",
        guards=(NONE_PUT_BACK, GPU + "test_three_ranks_on_the_simulated_gpu_equal_one_process"),
        what="StreamChannel.wait: the trainer's stream does not wait for the bucket's done event"),
    # (Dropping comm_scratch's own ``rt.use(transport.stream)`` is an equivalent mutant:
    # its one caller already runs under the transport's stream_context.)
    Mutation(
        "scratch-on-caller-stream", "old 2", "hybridcomm/comm/executor.py",
        old="    with transport.stream_context():\n"
            "        if schedule.world_size > 1:\n"
            "            plan = _plan(schedule, 1)  # one part: steps on one stream run in turn anyway\n"
            "            scratch = comm_scratch(transport, plan.scratch_numel, buf.dtype)\n",
        new="    if schedule.world_size > 1:  # allocated on the caller's stream, before the context\n"
            "        ws = transport.__dict__.setdefault(\"_caller_scratch\", Workspace(\n"
            "            lambda n, dt, _d: transport.runtime.empty(n, dt)))\n"
            "        caller_scratch = ws.get(_plan(schedule, 1).scratch_numel, buf.dtype, "
            "transport.device)\n"
            "    with transport.stream_context():\n"
            "        if schedule.world_size > 1:\n"
            "            plan = _plan(schedule, 1)\n"
            "            scratch = caller_scratch\n",
        guards=(GPU + "test_scratch_reused_across_streams_is_reported[False]",),
        what="the scratch is allocated on the caller's stream and used on the comm stream "
             "without record_stream"),
    Mutation(
        "buffer-no-record-stream", "old 2", "hybridcomm/comm/executor.py",
        old="rt.record_stream(buf, transport.stream)\n",
        new="pass\n",
        guards=(GPU + "test_a_buffer_freed_while_its_reduction_is_queued_is_not_reused",),
        what="the reduced buffer is not record_stream'd on the comm stream: freed and handed out "
             "again while the comm stream still uses it"),
    Mutation(
        "rank1-reversed-order", "old 3", "hybridcomm/comm/engine.py",
        old="        order = self.plan.order\n        while order:\n",
        new="        order = self.plan.order[::-1] if self.transport.rank == 1 else self.plan.order\n"
            "        while order:\n",
        guards=(NONE_PUT_BACK,),
        what="rank 1 issues the buckets in the reverse of the plan's order"),
    Mutation(
        "uid-tuple-as-bytes", "old 4", "hybridcomm/comm/transport/cupy_nccl.py",
        old="    return uid if isinstance(uid, bytes) else bytes(x & 0xFF for x in uid)\n",
        new="    return uid if isinstance(uid, bytes) else bytes(uid)\n",
        guards=("tests/test_cupy_nccl_select.py::test_unique_ids_of_both_cupy_styles_round_trip",
                SIM + "test_both_cupy_unique_id_styles[tuple]"),
        what="CuPy 13's tuple of signed chars stored with bytes(uid)"),
    Mutation(
        "uid-unsigned-tuple", "old 4", "hybridcomm/comm/transport/cupy_nccl.py",
        old="        signed = tuple(b - 256 if b > 127 else b for b in uid)\n",
        new="        signed = tuple(uid)\n",
        guards=("tests/test_cupy_nccl_select.py::test_unique_ids_of_both_cupy_styles_round_trip",
                SIM + "test_both_cupy_unique_id_styles[tuple]"),
        what="the stored id handed to CuPy 13 as unsigned values (0..255), not signed chars"),
    Mutation(
        "watchdog-unbound", "old 5", "hybridcomm/comm/transport/cupy_nccl.py",
        old="        self.runtime.bind_thread()  # else its event queries make a context on GPU 0\n",
        new="        pass\n",
        guards=(NONE_PUT_BACK,),
        what="the watchdog thread never binds to the rank's device"),
    Mutation(
        "native-skips-ready", "old 6", "hybridcomm/comm/executor.py",
        old="        return None\n    start = _enter(transport, buf, ready, timed",
        new="        return None\n    start = _enter(transport, buf, transport.record_event(), timed",
        guards=(GPU + "test_twenty_steps_with_one_nccl_kernel_slot_do_not_deadlock",),
        what="native all-reduce ordered after the comm stream itself, not the gradients' event"),
    Mutation(
        "comm-skips-ready", "old 6", "hybridcomm/comm/executor.py",
        old="    transport.wait_event(ready)\n",
        new="    pass\n",
        guards=(NONE_PUT_BACK,),
        what="no operation waits for the bucket's ready event"),
    Mutation(
        "tolist-per-bucket", "old 7", "hybridcomm/sync/used.py",
        old="        if state.complete:\n            return list(range(len(b.params)))\n",
        new="        if False:\n            return list(range(len(b.params)))\n",
        guards=(GPU + "test_steady_state_steps_make_no_host_sync[forward]",
                GPU + "test_steady_state_steps_make_no_host_sync[backward]"),
        what="the flags are read back (tolist, a host sync) for every bucket, every step"),
    Mutation(
        "averager-pack-per-tensor", "old 8", "hybridcomm/averager.py",
        old="                pack([tensors[i] for i in b.spec.params], b.grads, offsets=b.offsets)\n",
        new="                for i, o in zip(b.spec.params, b.offsets):\n"
            "                    pack([tensors[i]], b.grads[o:o + tensors[i].numel()])\n",
        guards=("tests/test_averager.py::test_every_rank_gets_the_exact_mean[simgpu]",),
        what="TensorAverager packs each tensor with its own launch"),
    Mutation(
        "averager-unpack-per-tensor", "old 8", "hybridcomm/averager.py",
        old="                unpack(b.grads, [tensors[j] for j in b.spec.params], offsets=b.offsets)\n",
        new="                for j, o in zip(b.spec.params, b.offsets):\n"
            "                    unpack(b.grads[o:o + tensors[j].numel()], [tensors[j]])\n",
        guards=("tests/test_averager.py::test_every_rank_gets_the_exact_mean[simgpu]",),
        what="TensorAverager unpacks each tensor with its own launch"),
    Mutation(
        "async-error-outside-lock", "old 9", "hybridcomm/comm/transport/cupy_nccl.py",
        old="            with self._lock:  # never races an abort or destroy on another thread\n",
        new="            if True:  # the query outside the lock\n",
        guards=(GPU + "test_the_watchdogs_async_error_query_never_races_an_abort",),
        what="the watchdog queries NCCL's async error outside the abort lock"),
    Mutation(
        "bench-torch-p2p", "old 10", "hybridcomm/tools/bench/harness.py",
        old="        base = select_transport(device, group)\n",
        new="        from ..transport.torch_dist import TorchDistTransport\n"
            "        base = TorchDistTransport()\n",
        guards=(GPU + "test_the_bench_times_the_transport_the_optimizer_uses",),
        what="the bench times torch.distributed's P2P, not the optimizer's transport"),

    # ---- issue 20: the new defects fixed so far ---------------------------------------------
    Mutation(
        "lock-across-group-end", "new 1", "hybridcomm/comm/transport/cupy_nccl.py",
        old="        try:\n            calls()\n        except self.nccl.NcclError as e:\n",
        new="        try:\n            with self._lock:\n                calls()\n"
            "        except self.nccl.NcclError as e:\n",
        guards=(GPU + "test_a_peer_silent_before_its_first_operation_is_a_timeout_not_a_hang"
                "[step-step 0]",
                GPU + "test_a_peer_silent_before_its_first_operation_is_a_timeout_not_a_hang"
                "[native-native all-reduce]"),
        what="the transport's lock held across groupStart..groupEnd: the watchdog cannot abort"),
    Mutation(
        "no-issue-deadline", "new 1", "hybridcomm/comm/transport/cupy_nccl.py",
        old="            self._issuing[key] = (time.monotonic() + self.issue_timeout, what,\n"
            "                                  self.issue_timeout)\n",
        new="            self._issuing[key] = (float(\"inf\"), what, self.issue_timeout)\n",
        guards=(GPU + "test_a_peer_silent_before_its_first_operation_is_a_timeout_not_a_hang"
                "[step-step 0]",
                GPU + "test_a_peer_silent_before_its_first_operation_is_a_timeout_not_a_hang"
                "[native-native all-reduce]"),
        what="nothing watched while issuing (the watch registered only after the schedule)"),
    Mutation(
        "backend-undefined", "new 2", "hybridcomm/comm/backend.py",
        old="    if name != \"undefined\":\n        return parse_backend_config(name)\n"
            "    return parse_backend_config(str(dist.get_backend_config(group)))\n",
        new="    return parse_backend_config(name)\n",
        guards=("tests/test_backend.py::test_a_mixed_group_communicates_on_the_gpu_when_one_is_there",
                "tests/test_backend.py::test_a_group_made_without_a_backend_works"),
        what="get_backend()'s \"undefined\" taken as the backend of every device"),
    Mutation(
        "comm-device-get-backend", "new 2", "hybridcomm/comm/backend.py",
        old="    if backend_for(\"cuda\", group) == \"nccl\" and torch.cuda.is_available():\n",
        new="    if str(dist.get_backend(group)) == \"nccl\" and torch.cuda.is_available():\n",
        guards=("tests/test_backend.py::test_a_mixed_group_communicates_on_the_gpu_when_one_is_there",),
        what="the probe's and the bench's device from get_backend(), not the per-device config"),
    Mutation(
        "transport-get-backend", "new 2", "hybridcomm/comm/transport/torch_dist.py",
        old="        self.backend = backend_for(\"cuda\" if self.stream_ordered else \"cpu\", group) \\\n"
            "            or str(dist.get_backend(group))\n",
        new="        self.backend = str(dist.get_backend(group))\n",
        guards=("tests/test_backend.py::test_a_group_made_without_a_backend_works",),
        what="TorchDistTransport's backend from get_backend() (\"undefined\")"),
    Mutation(
        "control-get-backend", "new 2", "hybridcomm/comm/control.py",
        old="    if backend_for(\"cpu\", group) == \"gloo\":  # (also a \"cpu:gloo,cuda:nccl\" group)\n",
        new="    if str(dist.get_backend(group)) == \"gloo\":\n",
        guards=("tests/test_backend.py::test_a_group_made_without_a_backend_works",),
        what="a \"cpu:gloo\" group not recognised as gloo: an extra control group made"),
    Mutation(
        "nsys-bench-torch", "new 10", "benchmarks/profile/nsys_bench.sh",
        old="    set -- --algo ring,butterfly,halving_doubling,native -b 4K -e 64M -f 4 -n 5 -w 2\n",
        new="    set -- --algo ring,butterfly,halving_doubling,torch -b 4K -e 64M -f 4 -n 5 -w 2\n",
        guards=("tests/test_profile_scripts.py::test_with_stand_in_nsys",),
        what="nsys_bench.sh's default --algo names 'torch', which the bench refuses"),
    # ---- issue 20, new defects 3-9 ------------------------------------------------------------
    # Add one mutation per defect here once its fix has landed (git log), re-introducing
    # it, with the test that guards the fix. Landed so far: 3, 4, 5, 6, 7, 8, 9.
    Mutation(
        "issue-in-hooks", "new 3", "hybridcomm/sync/synchronizer.py",
        old="issue_thread=cfg.issue_thread)\n",
        new="issue_thread=False)\n",
        guards=(GPU + "test_buckets_are_issued_by_the_channels_thread_not_in_the_hooks[True]",),
        what="the optimizer's buckets issued by the gradient hooks, on autograd's thread"),
    Mutation(
        "issue-thread-off-by-default", "new 3", "hybridcomm/config/env.py",
        old="    Variable(\"HYBRIDCOMM_ISSUE_THREAD\", parse_bool, True,\n",
        new="    Variable(\"HYBRIDCOMM_ISSUE_THREAD\", parse_bool, False,\n",
        guards=(GPU + "test_buckets_are_issued_by_the_channels_thread_not_in_the_hooks[True]",),
        what="the issuing thread off unless HYBRIDCOMM_ISSUE_THREAD=1"),
    Mutation(
        "unused-read-from-flags", "new 4", "hybridcomm/sync/synchronizer.py",
        old="    used = UsedAgreement(cfg.find_unused_parameters and rt is not None, sync.rank,\n",
        new="    used = UsedAgreement(False, sync.rank,\n",
        guards=(GPU + "test_a_missing_gradient_costs_no_host_sync_when_agreed_on_the_host[forward]",
                GPU + "test_a_missing_gradient_costs_no_host_sync_when_agreed_on_the_host"
                "[backward]"),
        what="find_unused_parameters=True still reads the reduced flags back (a host sync per "
             "bucket lacking a gradient, every step)"),
    Mutation(
        "apply-only-finished", "new 5", "hybridcomm/sync/deferred.py",
        old="                              group.engine.done_with(o.index, s.index)]\n",
        new="                              group.engine.done(o.index)]\n",
        guards=(GPU + "test_steady_state_steps_make_no_host_sync[forward]",),
        what="forward mode applies with a bucket only the others already finished (an event "
             "query), not every one issued before it: an optimizer call per bucket"),
    Mutation(
        "apply-pending-in-index-order", "new 5", "hybridcomm/sync/deferred.py",
        old="        for s in sorted(group.states, key=lambda s: -group.engine.issue_seq(s.index)):\n",
        new="        for s in group.states:\n",
        guards=(GPU + "test_steady_state_steps_make_no_host_sync[forward]",),
        what="synchronize() applies the pending buckets in index order, not from the last issued"),
    Mutation(
        "table-empty-programs", "new 6", "kernels/_triton.py",
        old="        for start in range(0, n, block):\n"
            "            rows.append((addr + start * size, min(block, n - start), offset + start))\n",
        new="        for start in range(0, max(m.numel() for m, _ in members), block):\n"
            "            rows.append((addr + start * size, max(0, min(block, n - start)), "
            "offset + start))\n",
        guards=("tests/test_kernels_pack.py::test_one_launch_per_bucket_whatever_its_tensor_count",),
        what="a table row (a program) per block of the largest tensor for every tensor: "
             "mostly-empty programs"),
    Mutation(
        "table-cache-256", "new 6", "kernels/_triton.py",
        old="_TABLES_MAX = 4096\n",
        new="_TABLES_MAX = 256\n",
        guards=("tests/test_kernels_pack.py::"
                "test_launch_tables_are_kept_for_every_bucket_of_a_large_model",),
        what="a launch-table cache of 256: a model with more buckets rebuilds tables every step"),
    Mutation(
        "ring-chunks-unaligned", "new 7", "hybridcomm/algorithms/schedule.py",
        old="    return aligned_split(0, numel, i, parts), aligned_split(0, numel, i + 1, parts)\n",
        new="    return i * numel // parts, (i + 1) * numel // parts\n",
        guards=("tests/test_schedules.py::test_chunks_start_at_aligned_offsets[ring]",),
        what="ring chunks split at any element, not multiples of 8"),
    Mutation(
        "halving-unaligned", "new 7", "hybridcomm/algorithms/halving_doubling.py",
        old="aligned_split(lo, hi, 1, 2)  # both partners alike\n",
        new="(lo + hi) // 2  # both partners alike\n",
        guards=("tests/test_schedules.py::test_chunks_start_at_aligned_offsets[halving_doubling]",),
        what="halving-doubling halves split at any element"),
    Mutation(
        "segments-unaligned", "new 7", "hybridcomm/plan/planner.py",
        old="        step = total if not split_bytes else max(align, split_bytes // esize // align * align)\n",
        new="        step = total if not split_bytes else max(1, split_bytes // esize)\n",
        guards=("tests/test_planner.py::test_segments_start_at_aligned_offsets",),
        what="a bucket's segments start at any element (split_bytes not rounded to 16 bytes)"),
    Mutation(
        "record-stream-per-submit", "new 7", "hybridcomm/comm/engine.py",
        old="reserved=True,  # bucket memory: recorded when allocated\n",
        new="reserved=False,\n",
        guards=(GPU + "test_steady_state_steps_make_no_host_sync[forward]",
                GPU + "test_steady_state_steps_make_no_host_sync[backward]"),
        what="record_stream on every submit of a bucket (bucket memory is recorded once)"),
    Mutation(
        "exposure-not-measured", "new 8", "hybridcomm/comm/channel.py",
        old="        self._waits.append((point, event))\n",
        new="",
        guards=(GPU + "test_exposed_communication_is_measured_on_the_gpus_clock",),
        what="a stream wait is not timed: exposed communication reads 0 on the GPU path"),
    Mutation(
        "windows-on-host-clock", "new 8", "hybridcomm/sync/synchronizer.py",
        old="        self.clock = clock_for(self.rt)",
        new="        self.clock = clock_for(None)",
        guards=(GPU + "test_the_planners_windows_are_measured_on_the_gpus_clock",),
        what="the planner's windows and ready times taken on the host's clock"),
    Mutation(
        "ddp-setup-in-backward", "new 9", "hybridcomm/ddp.py",
        old="    return state.prepare(next(ddp.module.parameters()).device)\n",
        new="    return state\n",
        guards=("tests/test_ddp_hook.py::test_hook_gives_ddps_numbers_on_every_rank[register-ring]",),
        what="hybridcomm.ddp.register leaves the set-up (agreement, probe, communicator) to the "
             "first backward"),

    # ---- the per-parameter pack launch ----------------------------------------------------------
    Mutation(
        "pack-launch-per-tensor", "pack per parameter", "kernels/pack.py",
        old="    if simulated(\"pack\", out, impl, _pack_torch, (tensors, out, scale, offsets), "
            "reads=tensors,\n                 writes=[out]):\n",
        new="    if tensors and all([simulated(\"pack\", out, impl, _pack_torch, ([t], out, scale, [o]),"
            " reads=[t], writes=[out]) for t, o in zip(tensors, offsets)]):\n",
        guards=("tests/test_averager.py::test_every_rank_gets_the_exact_mean[simgpu]",),
        what="pack launches one kernel per tensor (the simulated GPU's launch seam)"),
    Mutation(
        "table-launch-per-tensor", "pack per parameter", "kernels/_triton.py",
        old="        for dtype, members in groups.items():\n",
        new="        for dtype, members in [(d, [m]) for d, ms in groups.items() for m in ms]:\n",
        guards=("tests/test_kernels_pack.py::test_one_launch_per_bucket_whatever_its_tensor_count",),
        what="the Triton table launch: one kernel per tensor instead of one per bucket"),
]
