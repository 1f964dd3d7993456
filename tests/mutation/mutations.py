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
DDP = "tests/test_ddp_hook.py::"
GC = "tests/test_gpu_check.py::"
CS = "tests/test_csrc_compile.py::"
KR = "tests/test_kernels_reduce.py::"
KP = "tests/test_kernels_pack.py::"
NCCL_SELECT = "tests/test_cupy_nccl_select.py::"
PSGD = "tests/test_powersgd.py::"
PSGD_FILE = "hybridcomm/comm/powersgd.py"
OD = "tests/test_one_device.py::"
OD_EXACT = OD + "test_every_algorithm_is_exact_over_one_device[3-float32]"
OD_FILE = "hybridcomm/comm/transport/one_device.py"
DILOCO = "tests/test_diloco.py::"
GRAN = "tests/test_shard_granularity.py::"
COMPILE = "tests/test_compile.py::"

MUTATIONS = [
    # ---- issue 8: the ten old defects -------------------------------------------------------
    Mutation(
        "no-wait-before-use",
        "old 1",
        "hybridcomm/comm/channel.py",
        old="        stream.wait_event(event)\n",
        new="",
        guards=(NONE_PUT_BACK, GPU + "test_three_ranks_on_the_simulated_gpu_equal_one_process"),
        what="StreamChannel.wait: the trainer's stream does not wait for the bucket's done event",
    ),
    # (Dropping comm_scratch's own ``rt.use(transport.stream)`` is an equivalent mutant:
    # its one caller already runs under the transport's stream_context.)
    Mutation(
        "scratch-on-caller-stream",
        "old 2",
        "hybridcomm/comm/executor.py",
        old="    with transport.stream_context():\n"
        "        if schedule.world_size > 1:\n"
        "            plan = _plan(schedule, 1)  # one part: steps on one stream run in turn anyway\n"
        "            scratch = comm_scratch(transport, plan.scratch_numel, buf.dtype)\n",
        new="    if schedule.world_size > 1:  # allocated on the caller's stream, before the context\n"
        "        ws = transport.__dict__.setdefault(\n"
        '            "_caller_scratch", Workspace(lambda n, dt, _d: transport.runtime.empty(n, dt))\n'
        "        )\n"
        "        caller_scratch = ws.get(_plan(schedule, 1).scratch_numel, buf.dtype, transport.device)\n"
        "    with transport.stream_context():\n"
        "        if schedule.world_size > 1:\n"
        "            plan = _plan(schedule, 1)\n"
        "            scratch = caller_scratch\n",
        guards=(GPU + "test_scratch_reused_across_streams_is_reported[False]",),
        what="the scratch is allocated on the caller's stream and used on the comm stream "
        "without record_stream",
    ),
    Mutation(
        "buffer-no-record-stream",
        "old 2",
        "hybridcomm/comm/executor.py",
        old="        rt.record_stream(buf, transport.stream)\n",
        new="        pass\n",
        guards=(GPU + "test_a_buffer_freed_while_its_reduction_is_queued_is_not_reused",),
        what="the reduced buffer is not record_stream'd on the comm stream: freed and handed out "
        "again while the comm stream still uses it",
    ),
    Mutation(
        "rank1-reversed-order",
        "old 3",
        "hybridcomm/comm/engine.py",
        old="        order = self.plan.order\n",
        new="        order = self.plan.order[::-1] if self.transport.rank == 1 else self.plan.order\n",
        guards=(NONE_PUT_BACK,),
        what="rank 1 issues the buckets in the reverse of the plan's order",
    ),
    Mutation(
        "uid-tuple-as-bytes",
        "old 4",
        "hybridcomm/comm/transport/cupy_nccl.py",
        old="    return uid if isinstance(uid, bytes) else bytes(x & 0xFF for x in uid)\n",
        new="    return uid if isinstance(uid, bytes) else bytes(uid)\n",
        guards=(
            "tests/test_cupy_nccl_select.py::test_unique_ids_of_both_cupy_styles_round_trip",
            SIM + "test_both_cupy_unique_id_styles[tuple]",
        ),
        what="CuPy 13's tuple of signed chars stored with bytes(uid)",
    ),
    Mutation(
        "uid-unsigned-tuple",
        "old 4",
        "hybridcomm/comm/transport/cupy_nccl.py",
        old="        signed = tuple(b - 256 if b > 127 else b for b in uid)\n",
        new="        signed = tuple(uid)\n",
        guards=(
            "tests/test_cupy_nccl_select.py::test_unique_ids_of_both_cupy_styles_round_trip",
            SIM + "test_both_cupy_unique_id_styles[tuple]",
        ),
        what="the stored id handed to CuPy 13 as unsigned values (0..255), not signed chars",
    ),
    Mutation(
        "watchdog-unbound",
        "old 5",
        "hybridcomm/comm/transport/cupy_nccl.py",
        old="            self.runtime.bind_thread()  # else its event queries make a context on GPU 0\n",
        new="            pass\n",
        guards=(NONE_PUT_BACK,),
        what="the watchdog thread never binds to the rank's device",
    ),
    Mutation(
        "native-skips-ready",
        "old 6",
        "hybridcomm/comm/executor.py",
        old="        return None\n"
        "    start = _enter(transport, buf, ready=ready, timed=timed, reserved=reserved)\n",
        new="        return None\n"
        "    start = _enter(\n"
        "        transport, buf, ready=transport.record_event(), timed=timed, reserved=reserved\n"
        "    )\n",
        guards=(GPU + "test_twenty_steps_with_one_nccl_kernel_slot_do_not_deadlock",),
        what="native all-reduce ordered after the comm stream itself, not the gradients' event",
    ),
    Mutation(
        "comm-skips-ready",
        "old 6",
        "hybridcomm/comm/executor.py",
        old="    transport.wait_event(ready)\n",
        new="    pass\n",
        guards=(NONE_PUT_BACK,),
        what="no operation waits for the bucket's ready event",
    ),
    Mutation(
        "tolist-per-bucket",
        "old 7",
        "hybridcomm/sync/used.py",
        old="        if state.complete:\n",
        new="        if False:\n",
        guards=(
            GPU + "test_steady_state_steps_make_no_host_sync[forward]",
            GPU + "test_steady_state_steps_make_no_host_sync[backward]",
        ),
        what="the flags are read back (tolist, a host sync) for every bucket, every step",
    ),
    Mutation(
        "averager-pack-per-tensor",
        "old 8",
        "hybridcomm/averager.py",
        old="                self._pack([tensors[i] for i in b.spec.params], b.grads, offsets=b.offsets)\n",
        new="                for i, o in zip(b.spec.params, b.offsets):\n"
        "                    self._pack([tensors[i]], b.grads[o : o + tensors[i].numel()])\n",
        guards=("tests/test_averager.py::test_every_rank_gets_the_exact_mean[simgpu]",),
        what="TensorAverager packs each tensor with its own launch",
    ),
    Mutation(
        "averager-unpack-per-tensor",
        "old 8",
        "hybridcomm/averager.py",
        old="                    self._unpack(b.grads, [tensors[j] for j in b.spec.params], "
        "offsets=b.offsets)\n",
        new="                    for j, o in zip(b.spec.params, b.offsets):\n"
        "                        self._unpack(b.grads[o : o + tensors[j].numel()], [tensors[j]])\n",
        guards=("tests/test_averager.py::test_every_rank_gets_the_exact_mean[simgpu]",),
        what="TensorAverager unpacks each tensor with its own launch",
    ),
    Mutation(  # (the query now runs on the communicator's own thread: its race is close's)
        "close-destroys-on-callers-thread",
        "old 9",
        "hybridcomm/comm/transport/cupy_nccl.py",
        old='                self._failure = HybridCommError(f"rank {self.rank}: the NCCL transport was closed")\n',
        new='                self._failure = HybridCommError(f"rank {self.rank}: the NCCL transport was closed")\n'
        "                self.comm.destroy()  # on the caller's thread, racing the owner's query\n",
        guards=(GPU + "test_the_watchdogs_async_error_query_never_races_an_abort",),
        what="close() destroys while the async-error query runs on another thread",
    ),
    Mutation(
        "bench-torch-p2p",
        "old 10",
        "hybridcomm/tools/bench/harness.py",
        old="        base = select_transport(device, group)\n",
        new="        from ..transport.torch_dist import TorchDistTransport\n"
        "\n"
        "        base = TorchDistTransport()\n",
        guards=(GPU + "test_the_bench_times_the_transport_the_optimizer_uses",),
        what="the bench times torch.distributed's P2P, not the optimizer's transport",
    ),
    # ---- issue 20: the new defects fixed so far ---------------------------------------------
    Mutation(
        "lock-across-group-end",
        "new 1",
        "hybridcomm/comm/transport/cupy_nccl.py",
        old="            calls()\n",
        new="            with self.t._lock:\n                calls()\n",
        guards=(
            GPU + "test_a_peer_silent_before_its_first_operation_is_a_timeout_not_a_hang"
            "[step-step 0]",
            GPU + "test_a_peer_silent_before_its_first_operation_is_a_timeout_not_a_hang"
            "[native-native all-reduce]",
        ),
        what="the transport's lock held across groupStart..groupEnd: the watchdog cannot abort",
    ),
    Mutation(
        "no-issue-deadline",
        "new 1",
        "hybridcomm/comm/transport/cupy_nccl.py",
        old="        self._issuing[key] = (time.monotonic() + self.issue_timeout, what, self.issue_timeout)\n",
        new='        self._issuing[key] = (float("inf"), what, self.issue_timeout)\n',
        guards=(
            GPU + "test_a_peer_silent_before_its_first_operation_is_a_timeout_not_a_hang"
            "[step-step 0]",
            GPU + "test_a_peer_silent_before_its_first_operation_is_a_timeout_not_a_hang"
            "[native-native all-reduce]",
        ),
        what="nothing watched while issuing (the watch registered only after the schedule)",
    ),
    Mutation(
        "backend-undefined",
        "new 2",
        "hybridcomm/comm/backend.py",
        old='    if name != "undefined":\n'
        "        return parse_backend_config(name)\n"
        "    return parse_backend_config(str(dist.get_backend_config(group)))\n",
        new="    return parse_backend_config(name)\n",
        guards=(
            "tests/test_backend.py::test_a_mixed_group_communicates_on_the_gpu_when_one_is_there",
            "tests/test_backend.py::test_a_group_made_without_a_backend_works",
        ),
        what='get_backend()\'s "undefined" taken as the backend of every device',
    ),
    Mutation(
        "comm-device-get-backend",
        "new 2",
        "hybridcomm/comm/backend.py",
        old='    if backend_for("cuda", group) == "nccl" and torch.cuda.is_available():\n',
        new='    if str(dist.get_backend(group)) == "nccl" and torch.cuda.is_available():\n',
        guards=(
            "tests/test_backend.py::test_a_mixed_group_communicates_on_the_gpu_when_one_is_there",
        ),
        what="the probe's and the bench's device from get_backend(), not the per-device config",
    ),
    Mutation(
        "transport-get-backend",
        "new 2",
        "hybridcomm/comm/transport/torch_dist.py",
        old='        self.backend = backend_for("cuda" if self.stream_ordered else "cpu", group) or str(\n'
        "            dist.get_backend(group)\n"
        "        )\n",
        new="        self.backend = str(dist.get_backend(group))\n",
        guards=("tests/test_backend.py::test_a_group_made_without_a_backend_works",),
        what='TorchDistTransport\'s backend from get_backend() ("undefined")',
    ),
    Mutation(
        "control-get-backend",
        "new 2",
        "hybridcomm/comm/control.py",
        old='    if backend_for("cpu", group) == "gloo":  # (also a "cpu:gloo,cuda:nccl" group)\n',
        new='    if str(dist.get_backend(group)) == "gloo":\n',
        guards=("tests/test_backend.py::test_a_group_made_without_a_backend_works",),
        what='a "cpu:gloo" group not recognised as gloo: an extra control group made',
    ),
    Mutation(
        "nsys-bench-torch",
        "new 10",
        "benchmarks/profile/nsys_bench.sh",
        old="    set -- --algo ring,butterfly,halving_doubling,native -b 4K -e 64M -f 4 -n 5 -w 2\n",
        new="    set -- --algo ring,butterfly,halving_doubling,torch -b 4K -e 64M -f 4 -n 5 -w 2\n",
        guards=("tests/test_profile_scripts.py::test_with_stand_in_nsys",),
        what="nsys_bench.sh's default --algo names 'torch', which the bench refuses",
    ),
    # ---- issue 20, new defects 3-9 ------------------------------------------------------------
    # Add one mutation per defect here once its fix has landed (git log), re-introducing
    # it, with the test that guards the fix. Landed so far: 3, 4, 5, 6, 7, 8, 9.
    Mutation(
        "issue-in-hooks",
        "new 3",
        "hybridcomm/sync/synchronizer.py",
        old="            self.registry.device,\n"
        "            process_group,\n"
        "            cfg.timeout,\n"
        "            self.timeline,\n"
        "            issue_thread=cfg.issue_thread,\n",
        new="            self.registry.device, process_group, cfg.timeout, self.timeline, issue_thread=False\n",
        guards=(GPU + "test_buckets_are_issued_by_the_channels_thread_not_in_the_hooks[True]",),
        what="the optimizer's buckets issued by the gradient hooks, on autograd's thread",
    ),
    Mutation(
        "issue-thread-off-by-default",
        "new 3",
        "hybridcomm/config/env.py",
        old='            "HYBRIDCOMM_ISSUE_THREAD",\n'
        "            parse_bool,\n"
        "            True,\n"
        "            \"GPU path: the optimizer's buckets are issued by the transport's communicator \"\n",
        new='            "HYBRIDCOMM_ISSUE_THREAD",\n'
        "            parse_bool,\n"
        "            False,\n"
        "            \"GPU path: the optimizer's buckets are issued by the transport's communicator \"\n",
        guards=(GPU + "test_buckets_are_issued_by_the_channels_thread_not_in_the_hooks[True]",),
        what="the issuing thread off unless HYBRIDCOMM_ISSUE_THREAD=1",
    ),
    Mutation(
        "unused-read-from-flags",
        "new 4",
        "hybridcomm/sync/synchronizer.py",
        old="            cfg.find_unused_parameters and rt is not None,\n",
        new="            False,\n",
        guards=(
            GPU + "test_a_missing_gradient_costs_no_host_sync_when_agreed_on_the_host[forward]",
            GPU + "test_a_missing_gradient_costs_no_host_sync_when_agreed_on_the_host[backward]",
        ),
        what="find_unused_parameters=True still reads the reduced flags back (a host sync per "
        "bucket lacking a gradient, every step)",
    ),
    Mutation(
        "apply-only-finished",
        "new 5",
        "hybridcomm/sync/deferred.py",
        old="                if o is not s\n"
        "                and o.phase is Phase.PENDING\n"
        "                and group.engine.done_with(o.index, s.index)\n",
        new="                if o is not s and o.phase is Phase.PENDING and group.engine.done(o.index)\n",
        guards=(GPU + "test_steady_state_steps_make_no_host_sync[forward]",),
        what="forward mode applies with a bucket only the others already finished (an event "
        "query), not every one issued before it: an optimizer call per bucket",
    ),
    Mutation(
        "apply-pending-in-index-order",
        "new 5",
        "hybridcomm/sync/deferred.py",
        old="        for s in sorted(group.states, key=lambda s: -group.engine.issue_seq(s.index)):\n",
        new="        for s in group.states:\n",
        guards=(GPU + "test_steady_state_steps_make_no_host_sync[forward]",),
        what="synchronize() applies the pending buckets in index order, not from the last issued",
    ),
    Mutation(
        "table-empty-programs",
        "new 6",
        "kernels/_triton.py",
        old="        for start in range(0, n, block):\n"
        "            rows.append((addr + start * size, min(block, n - start), offset + start))\n",
        new="        for start in range(0, max(m.numel() for m, _ in members), block):\n"
        "            rows.append((addr + start * size, max(0, min(block, n - start)), offset + start))\n",
        guards=(
            "tests/test_kernels_pack.py::test_one_launch_per_bucket_whatever_its_tensor_count",
        ),
        what="a table row (a program) per block of the largest tensor for every tensor: "
        "mostly-empty programs",
    ),
    Mutation(
        "table-cache-256",
        "new 6",
        "kernels/_triton.py",
        old="_TABLES_MAX = 4096\n",
        new="_TABLES_MAX = 256\n",
        guards=(
            "tests/test_kernels_pack.py::"
            "test_launch_tables_are_kept_for_every_bucket_of_a_large_model",
        ),
        what="a launch-table cache of 256: a model with more buckets rebuilds tables every step",
    ),
    Mutation(
        "ring-chunks-unaligned",
        "new 7",
        "hybridcomm/algorithms/schedule.py",
        old="    return aligned_split(0, numel, i, parts), aligned_split(0, numel, i + 1, parts)\n",
        new="    return i * numel // parts, (i + 1) * numel // parts\n",
        guards=("tests/test_schedules.py::test_chunks_start_at_aligned_offsets[ring]",),
        what="ring chunks split at any element, not multiples of 8",
    ),
    Mutation(
        "halving-unaligned",
        "new 7",
        "hybridcomm/algorithms/halving_doubling.py",
        old="        peer, mid = rank ^ mask, aligned_split(lo, hi, 1, 2)  # both partners alike\n",
        new="        peer, mid = rank ^ mask, (lo + hi) // 2  # both partners alike\n",
        guards=("tests/test_schedules.py::test_chunks_start_at_aligned_offsets[halving_doubling]",),
        what="halving-doubling halves split at any element",
    ),
    Mutation(
        "segments-unaligned",
        "new 7",
        "hybridcomm/plan/planner.py",
        old="    step = 0 if not split_bytes else max(align, split_bytes // esize // align * align)\n",
        new="    step = 0 if not split_bytes else max(1, split_bytes // esize)\n",
        guards=("tests/test_planner.py::test_segments_start_at_aligned_offsets",),
        what="a bucket's segments start at any element (split_bytes not rounded to 16 bytes)",
    ),
    Mutation(
        "record-stream-per-submit",
        "new 7",
        "hybridcomm/comm/engine.py",
        old="            reserved=True,  # bucket memory: recorded when allocated\n",
        new="            reserved=False,\n",
        guards=(
            GPU + "test_steady_state_steps_make_no_host_sync[forward]",
            GPU + "test_steady_state_steps_make_no_host_sync[backward]",
        ),
        what="record_stream on every submit of a bucket (bucket memory is recorded once)",
    ),
    Mutation(
        "exposure-not-measured",
        "new 8",
        "hybridcomm/comm/channel.py",
        old="        self._waits.append((point, event))\n",
        new="",
        guards=(GPU + "test_exposed_communication_is_measured_on_the_gpus_clock",),
        what="a stream wait is not timed: exposed communication reads 0 on the GPU path",
    ),
    Mutation(
        "windows-on-host-clock",
        "new 8",
        "hybridcomm/sync/synchronizer.py",
        old="        self.clock = clock_for(self.rt)  # the planner's inputs: the GPU's clock there\n",
        new="        self.clock = clock_for(None)  # the planner's inputs: the GPU's clock there\n",
        guards=(GPU + "test_the_planners_windows_are_measured_on_the_gpus_clock",),
        what="the planner's windows and ready times taken on the host's clock",
    ),
    Mutation(
        "ddp-setup-in-backward",
        "new 9",
        "hybridcomm/ddp.py",
        old="    return state.prepare(next(ddp.module.parameters()).device)\n",
        new="    return state\n",
        guards=(
            "tests/test_ddp_hook.py::test_hook_gives_ddps_numbers_on_every_rank[register-ring]",
        ),
        what="hybridcomm.ddp.register leaves the set-up (agreement, probe, communicator) to the "
        "first backward",
    ),
    # ---- the per-parameter pack launch ----------------------------------------------------------
    Mutation(
        "pack-launch-per-tensor",
        "pack per parameter",
        "kernels/pack.py",
        old="    if simulated(\n"
        '        "pack", out, impl, _pack_torch, (tensors, out, scale, offsets), reads=tensors, writes=[out]\n',
        new="    if tensors and all(\n"
        "        [\n"
        "            simulated(\n"
        '                "pack", out, impl, _pack_torch, ([t], out, scale, [o]), reads=[t], writes=[out]\n'
        "            )\n"
        "            for t, o in zip(tensors, offsets)\n"
        "        ]\n",
        guards=("tests/test_averager.py::test_every_rank_gets_the_exact_mean[simgpu]",),
        what="pack launches one kernel per tensor (the simulated GPU's launch seam)",
    ),
    Mutation(
        "table-launch-per-tensor",
        "pack per parameter",
        "kernels/_triton.py",
        old="        for dtype, members in groups.items():\n",
        new="        for dtype, members in [(d, [m]) for d, ms in groups.items() for m in ms]:\n",
        guards=(
            "tests/test_kernels_pack.py::test_one_launch_per_bucket_whatever_its_tensor_count",
        ),
        what="the Triton table launch: one kernel per tensor instead of one per bucket",
    ),
    # ---- issue 29: the review's GPU defects -----------------------------------------------
    # 1: fp64 averages scaled by an fp32 scale (a plain float kernel argument is .param .f32)
    Mutation(
        "reduce-scale-fp32-param",
        "i29 1",
        "kernels/reduce.py",
        old="        scale: tl.float64,  # a plain float parameter would be fp32 on a GPU (check_scale)\n",
        new="        scale,\n",
        guards=(KR + "test_on_a_gpu_the_scale_is_fp64_and_fp32_data_rounds_it_to_fp32[fp64]",),
        what="reduce's scale a plain float parameter: fp32 on a GPU, fp64 averages off by up to "
        "3e-8 relative",
    ),
    Mutation(
        "pack-scale-fp32-param",
        "i29 1",
        "kernels/pack.py",
        old="        scale: tl.float64,  # a plain float parameter would be fp32 on a GPU (check_scale)\n",
        new="        scale,\n",
        guards=(KP + "test_on_a_gpu_the_scale_is_fp64_and_fp32_data_rounds_it_to_fp32[pack-fp64]",),
        what="pack's scale a plain float parameter: fp32 on a GPU",
    ),
    Mutation(
        "unpack-scale-fp32-param",
        "i29 1",
        "kernels/unpack.py",
        old="        scale: tl.float64,  # a plain float parameter would be fp32 on a GPU (check_scale)\n",
        new="        scale,\n",
        guards=(
            KP + "test_on_a_gpu_the_scale_is_fp64_and_fp32_data_rounds_it_to_fp32[unpack-fp64]",
        ),
        what="unpack's scale a plain float parameter: fp32 on a GPU",
    ),
    Mutation(
        "reduce-fp32-data-fp64-scale",
        "i29 1",
        "kernels/reduce.py",
        old="            r *= scale if ACC == tl.float64 else tl.cast(scale, tl.float32)\n",
        new="            r *= scale\n",
        guards=(KR + "test_on_a_gpu_the_scale_is_fp64_and_fp32_data_rounds_it_to_fp32[fp32]",),
        what="fp32 data multiplied by the fp64 scale in fp64 on a GPU (not the reference's fp32)",
    ),
    Mutation(
        "pack-fp32-data-fp64-scale",
        "i29 1",
        "kernels/pack.py",
        old="                x = x.to(tl.float32) * tl.cast(scale, tl.float32)\n",
        new="                x = x.to(tl.float32) * scale\n",
        guards=(KP + "test_on_a_gpu_the_scale_is_fp64_and_fp32_data_rounds_it_to_fp32[pack-fp32]",),
        what="pack: fp32 data multiplied by the fp64 scale in fp64 on a GPU",
    ),
    Mutation(
        "unpack-fp32-data-fp64-scale",
        "i29 1",
        "kernels/unpack.py",
        old="                x = x.to(tl.float32) * tl.cast(scale, tl.float32)\n",
        new="                x = x.to(tl.float32) * scale\n",
        guards=(
            KP + "test_on_a_gpu_the_scale_is_fp64_and_fp32_data_rounds_it_to_fp32[unpack-fp32]",
        ),
        what="unpack: fp32 data multiplied by the fp64 scale in fp64 on a GPU",
    ),
    Mutation(
        "pack-fp32-into-fp64-in-fp32",
        "i29 1",
        "kernels/pack.py",
        old="            if TENSOR == tl.float64 or out_ptr.dtype.element_ty == tl.float64:\n",
        new="            if TENSOR == tl.float64:\n",
        guards=(
            KP + "test_every_dtype_pair_scales_like_the_reference_in_fp64_where_either_is"
            "[float32-float64]",
        ),
        what="pack scales fp32 tensors bound for an fp64 buffer in fp32 (the reference: fp64)",
    ),
    Mutation(
        "unpack-ref-fp32-into-fp64-in-fp32",
        "i29 1",
        "kernels/unpack.py",
        old="        elif dst.dtype == torch.float64 and flat.dtype != torch.float64:\n",
        new="        elif False:\n",
        guards=(
            KP + "test_every_dtype_pair_scales_like_the_reference_in_fp64_where_either_is"
            "[float32-float64]",
        ),
        what="unpack's reference scales an fp32 buffer into fp64 tensors in fp32, the kernel in fp64",
    ),
    # 2: a rank missing a gradient paid a host sync in backward (pageable mask copied in)
    Mutation(
        "flags-from-host-mask",
        "i29 2",
        "hybridcomm/sync/buckets.py",
        old="        n = len(self.params)\n",
        new="        n = len(self.params)\n"
        "        if len(positions) < n:  # the host mask copied in (memcpy_and_sync)\n"
        "            mask = torch.zeros(n, dtype=self.flags.dtype)\n"
        "            mask[list(positions)] = 1\n"
        "            self.flags.copy_(mask)\n"
        "            return\n",
        guards=(
            GPU + "test_flags_are_written_on_the_device_without_a_host_sync",
            GPU + "test_a_missing_gradient_in_a_topk_bucket_costs_no_host_sync[backward]",
            GPU + "test_a_missing_gradient_costs_no_host_sync_when_agreed_on_the_host[forward]",
        ),
        what="GradBucket.set_flags copies a pageable host mask into the device flags: a host sync "
        "in backward per incomplete bucket",
    ),
    Mutation(
        "sim-h2d-copy-uncounted",
        "i29 2 (simulator)",
        "hybridcomm/testing/simgpu.py",
        old='            if name in _SYNC_FUNCS or (name == "copy_" and _syncing_copy(dev, args, kwargs)):\n',
        new="            if name in _SYNC_FUNCS:\n",
        guards=(SIM + "test_a_copy_between_pageable_host_memory_and_the_device_is_a_host_sync",),
        what="the simulator does not count a copy_ between pageable host memory and the device",
    ),
    # 3: the watchdog died silently and broke CUDA graph capture
    Mutation(
        "watchdog-dies-silently",
        "i29 3",
        "hybridcomm/comm/transport/cupy_nccl.py",
        old="        try:\n"
        "            self.runtime.bind_thread()  # else its event queries make a context on GPU 0\n"
        "            self._watch()\n"
        "        except BaseException as e:  # noqa: BLE001 - a sticky CUDA error: fail, never die silently\n"
        "            self._fail(\n"
        "                HybridCommError(\n"
        '                    f"rank {self.rank}: the NCCL watchdog failed ({type(e).__name__}: {e}): NCCL "\n'
        '                    "work could no longer be watched for hangs, so the communicator was aborted; "\n'
        '                    "create a new transport"\n'
        "                )\n"
        "            )\n",
        new="        self.runtime.bind_thread()  # else its event queries make a context on GPU 0\n"
        "        self._watch()\n",
        guards=(GPU + "test_an_exception_in_the_watchdog_fails_the_transport",),
        what="no try/except in the watchdog: an exception (a sticky CUDA error) ends it silently",
    ),
    Mutation(
        "watchdog-global-capture-mode",
        "i29 3",
        "hybridcomm/comm/transport/cupy_nccl.py",
        old="CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1  # CUstreamCaptureMode (cuda.h)\n",
        new="CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 0  # CUstreamCaptureMode (cuda.h)\n",
        guards=(NCCL_SELECT + "test_the_watchdog_exempts_its_thread_from_global_graph_capture",),
        what="the watchdog's thread left in global capture mode",
    ),
    Mutation(
        "watchdog-queries-in-global-mode",
        "i29 3",
        "hybridcomm/comm/transport/cupy_nccl.py",
        old='        self._exempt_from_capture("NCCL watchdog")\n',
        new="",
        guards=(NCCL_SELECT + "test_the_watchdog_exempts_its_thread_from_global_graph_capture",),
        what="the watchdog queries events without the thread-local capture mode",
    ),
    Mutation(
        "nccl-thread-in-global-mode",
        "i29 3",
        "hybridcomm/comm/transport/comm_thread.py",
        old='            t._exempt_from_capture("NCCL communicator\'s thread")\n',
        new="",
        guards=(
            NCCL_SELECT + "test_the_communicators_thread_exempts_itself_and_makes_the_last_call",
        ),
        what="the thread polling NCCL's async error left in global capture mode",
    ),
    # the abort path: a communicator is never used by two threads at once
    Mutation(
        "close-aborts-on-callers-thread",
        "i29 abort",
        "hybridcomm/comm/transport/cupy_nccl.py",
        old="                self._aborted, self._destroy_on_close = True, not self._issuing\n",
        new="                self._aborted, self._destroy_on_close = True, not self._issuing\n"
        "                if self._issuing:\n"
        "                    self.comm.abort()  # on the caller's thread, under the call in flight\n",
        guards=(GPU + "test_an_abort_never_overlaps_a_blocked_group_end[close]",),
        what="close() aborts on its own thread while groupEnd blocks on the owner's",
    ),
    Mutation(
        "watchdog-aborts-at-issue-deadline",
        "i29 abort",
        "hybridcomm/comm/transport/cupy_nccl.py",
        old="                what, timeout = late[0]\n",
        new="                what, timeout = late[0]\n"
        "                self.comm.abort()  # on the watchdog's thread, under the blocked groupEnd\n",
        guards=(GPU + "test_an_abort_never_overlaps_a_blocked_group_end[deadline]",),
        what="the watchdog aborts a blocked groupEnd from its own thread",
    ),
    # 4: the DDP hook's ready event on the wrong stream
    Mutation(
        "ddp-ready-on-issuing-thread",
        "i29 4",
        "hybridcomm/ddp.py",
        old="        ready=ready,\n",
        new="",
        guards=(
            DDP + "test_backward_on_a_side_stream_with_an_issuing_thread[ring]",
            DDP + "test_backward_on_a_side_stream_with_an_issuing_thread[native]",
        ),
        what="the DDP hook's ready event is recorded on the issuing thread's current stream",
    ),
    Mutation(
        "ddp-future-not-stream-ordered",
        "i29 4 (simulator)",
        "hybridcomm/ddp.py",
        old="        if not buf.is_cuda:  # the simulated GPU: a CPU tensor's future has no stream\n"
        "            return rt.stream_future(buf, t.stream)\n"
        "        fut = torch.futures.Future(devices=[buf.device])\n",
        new="        fut = torch.futures.Future(devices=[buf.device] if buf.is_cuda else None)\n",
        guards=(
            DDP + "test_hook_gives_ddps_numbers_on_the_simulated_gpu[hand]",
            DDP + "test_hook_gives_ddps_numbers_on_the_simulated_gpu[register]",
            DDP + "test_backward_on_a_side_stream_with_an_issuing_thread[ring]",
        ),
        what="the DDP hook's future on the simulated GPU completes before the reduction",
    ),
    Mutation(
        "sim-keep-alive-at-record",
        "i29 4 (simulator)",
        "hybridcomm/testing/simgpu.py",
        old="        with self.cv:\n"
        "            self._alive = [(t, s) for t, s in self._alive if s._done < s._seq]\n"
        "            self._alive.append((tensor, stream))\n",
        new="        ev = SimEvent(self, _internal=True)\n"
        "        ev.record(stream)\n"
        "        with self.cv:\n"
        "            self._alive = [(t, e) for t, e in self._alive if not e.query()]\n"
        "            self._alive.append((tensor, ev))\n",
        guards=(
            SIM
            + "test_user_memory_given_to_record_stream_outlives_the_work_queued_before_its_free",
        ),
        what="record_stream on user memory holds it only for work queued before the call",
    ),
    # 5: the table kernels rebuilt one Python row per block at every launch
    Mutation(
        "table-rows-per-launch",
        "i29 5",
        "kernels/_triton.py",
        old="    key = (\n"
        "        device,\n"
        "        stream,\n"
        "        members[0][0].dtype,\n"
        "        block,\n"
        "        tuple([(t.data_ptr(), t.numel(), offset) for t, offset in members]),\n"
        "    )\n",
        new="    key = (device, stream, members[0][0].dtype, block, tuple(block_rows(members, block)))\n",
        guards=(
            KP + "test_a_seen_layout_builds_no_rows_and_costs_the_same_whatever_its_blocks[pack]",
        ),
        what="the table cache keyed by the rows: a Python row per block built and hashed at every "
        "launch (9 ms host time for a 100 MiB bucket)",
    ),
    # 6: the 2+-GPU optimizer test ran TF32 against a 64-eps bound
    Mutation(
        "optimizer-cuda-tf32",
        "i29 6",
        "tests/gpu/test_optimizer_cuda.py",
        old="    ieee_fp32()  # TF32 keeps 10 mantissa bits (~5e-4 relative); the tolerance is 7.6e-6\n",
        new="",
        guards=(GC + "test_gpu_ranks_pin_ieee_fp32_first[test_optimizer_cuda]",),
        what="the optimizer test's ranks run TF32 convolutions on their shards against a 12-sample "
        "reference at 64 eps",
    ),
    Mutation(
        "optimizer-cuda-reference-tf32",
        "i29 6",
        "tests/gpu/test_optimizer_cuda.py",
        old="def test_training_on_gpus_matches_one_process(ieee, overlap):\n",
        new="def test_training_on_gpus_matches_one_process(overlap):\n",
        guards=(GC + "test_gpu_ranks_pin_ieee_fp32_first[test_optimizer_cuda]",),
        what="the same test's one-process GPU reference runs under TF32",
    ),
    # 7: failures that hide
    Mutation(
        "csrc-build-error-swallowed",
        "i29 7",
        "hybridcomm/gpu/cuda_ext.py",
        old='                    reason, failed = f"building the extension failed: {e}", True\n'
        '                    log.warning("hybridcomm: the CUDA C++ extension (csrc/) did not build: %s", e)\n',
        new='                    reason = f"building the extension failed: {e}"\n',
        guards=(
            CS + "test_a_failing_build_is_reported_not_swallowed",
            CS + "test_the_gpu_tests_fail_on_a_failed_build_and_skip_only_without_a_toolkit",
        ),
        what="cuda_ext.load() turns a failed csrc build into None, quietly: the GPU tests skip",
    ),
    Mutation(
        "csrc-required-ignored",
        "i29 7",
        "hybridcomm/gpu/cuda_ext.py",
        old="    if module is None and required:\n",
        new='    if module is None and required and not _state["failed"]:\n',
        guards=(CS + "test_a_failing_build_is_reported_not_swallowed",),
        what="load(required=True) returns None after a failed build",
    ),
    Mutation(
        "csrc-failed-build-skips",
        "i29 7",
        "tests/gpu/gpu_common.py",
        old="    if cuda_ext.build_failed():\n"
        '        pytest.fail(f"the csrc build failed: {cuda_ext.why_not()}", pytrace=False)\n',
        new="",
        guards=(CS + "test_the_gpu_tests_fail_on_a_failed_build_and_skip_only_without_a_toolkit",),
        what="the csrc kernel tests skip when the build failed",
    ),
    Mutation(
        "gpu-check-csrc-failure-ok",
        "i29 7",
        "tests/gpu/gpu_check.py",
        old='    if csrc["build_failed"]:\n',
        new="    if False:\n",
        guards=(GC + "test_the_verdict",),
        what="make gpu-check passes though the csrc build failed",
    ),
    Mutation(
        "gpu-check-exit-5-ok",
        "i29 7",
        "tests/gpu/gpu_check.py",
        old="    if rc == 5:\n"
        '        found.append("pytest collected no tests (exit 5): nothing was checked")\n'
        "    elif rc != 0:\n"
        '        found.append(f"pytest exited {rc}")\n'
        "    if not tests and rc != 5:\n"
        '        found.append("no test reported an outcome")\n',
        new="    if rc not in (0, 5):  # 5: nothing collected\n"
        '        found.append(f"pytest exited {rc}")\n',
        guards=(GC + "test_nothing_collected_is_a_failure_not_a_dry_run", GC + "test_the_verdict"),
        what="make gpu-check exits 0 when pytest collected nothing (exit 5)",
    ),
    Mutation(
        "gpu-check-collection-error-unnamed",
        "i29 7",
        "tests/gpu/gpu_check.py",
        old='            t["outcome"] = {"call": "failed", "collect": "collection_error"}.get(r["when"], "error")\n',
        new='            t["outcome"] = "failed" if r["when"] == "call" else "error"\n',
        guards=(GC + "test_a_module_that_does_not_collect_is_a_failure",),
        what="a module that does not collect reads as one test's error in the report",
    ),
    Mutation(
        "gpu-check-all-skipped-on-gpu-ok",
        "i29 7",
        "tests/gpu/gpu_check.py",
        old='    if not dry_run and tests and not any(t["outcome"] == "passed" for t in tests):\n',
        new="    if False:\n",
        guards=(GC + "test_the_verdict",),
        what="on a GPU machine, every test skipping (nothing checked) passes the check",
    ),
    Mutation(
        "gpu-check-no-gpus-needed",
        "i29 report",
        "tests/gpu/gpu_check.py",
        old='    item.user_properties.append(("gpus_needed", gpus_needed(item)))  # copied to each report\n',
        new="    pass\n",
        guards=(GC + "test_dry_run_writes_the_report_and_exits_zero",),
        what="the report gives every test gpus_needed 1, the multi-GPU ones too",
    ),
    Mutation(
        "gpu-check-share-of-all",
        "i29 report",
        "tests/gpu/gpu_check.py",
        old='        "one_gpu_share": round(by_gpus.get("1", 0) / counted, 4) if counted else None,\n',
        new='        "one_gpu_share": round(by_gpus.get("1", 0) / len(tests), 4) if counted else None,\n',
        guards=(GC + "test_the_summary_counts_tests_by_gpus_needed",),
        what="the one-GPU share counts collection errors as tests",
    ),
    Mutation(
        "sync-watch-misses-event",
        "i29 7",
        "tests/gpu/gpu_common.py",
        old='        (torch.cuda.Event, "synchronize", "torch.cuda.Event.synchronize"),\n',
        new="",
        guards=(GC + "test_the_host_sync_watch_sees_the_waits_sync_debug_mode_misses",),
        what="the no-host-sync check relies on set_sync_debug_mode, which misses Event.synchronize",
    ),
    Mutation(
        "sync-watch-caught-syncs-pass",
        "i29 7",
        "tests/gpu/gpu_common.py",
        old='    assert not seen.found, f"{len(seen.found)} host sync(s):\\n" + "\\n".join(seen.found)\n',
        new="",
        guards=(GC + "test_the_host_sync_watch_sees_the_waits_sync_debug_mode_misses",),
        what="a host sync whose error the library (or a helper thread) caught passes",
    ),
    # ---- issue 29: the one-device transport's ordering and failure paths -----------------------
    Mutation(
        "one-device-no-consumed-wait",
        "i29 one-device",
        OD_FILE,
        old="                op.stream.wait_event(self.peer_consumed[q])  # q read the mailbox out\n",
        new="                pass\n",
        guards=(OD_EXACT,),
        what="the sender overwrites the mailbox before the receiver's copy out of it has run",
    ),
    Mutation(
        "one-device-no-filled-wait",
        "i29 one-device",
        OD_FILE,
        old="            op.stream.wait_event(self.peer_filled[q])  # q's piece is in the mailbox\n",
        new="",
        guards=(OD_EXACT,),
        what="the receiver copies out of the mailbox before the sender's copy into it has run",
    ),
    Mutation(
        "one-device-no-posted-check",
        "i29 one-device",
        OD_FILE,
        old="        if host.get(self.rank, q, CONSUMED) < k - 1:\n",
        new="        if False:\n",
        guards=(OD_EXACT,),
        what="the sender fills the next piece before the receiver has posted the previous one's "
        "copy out (its stream wait then finds an older record)",
    ),
    Mutation(
        "one-device-no-size-check",
        "i29 one-device",
        OD_FILE,
        old="        if got != (op.data.numel(), op.dtype):\n",
        new="        if False:\n",
        guards=(OD + "test_a_wrong_size_is_reported_and_a_peers_abort_ends_a_wait",),
        what="a receive of another size than the send takes the bytes silently",
    ),
    Mutation(
        "one-device-abort-unpublished",
        "i29 one-device",
        OD_FILE,
        old="            self._host.set_aborted(self.rank)\n",
        new="",
        guards=(OD + "test_a_wrong_size_is_reported_and_a_peers_abort_ends_a_wait",),
        what="a rank's abort is not seen by peers blocked on it (they wait for good)",
    ),
    # issue 30: PowerSGD (comm/powersgd.py, engine.py)
    Mutation(
        "powersgd-no-orthogonalize",
        "i30 powersgd",
        PSGD_FILE,
        old="            orthogonalize(p)\n",
        new="",
        guards=(PSGD + "test_one_step_matches_the_reference_and_every_rank_agrees",),
        what="P is used as summed, not orthogonalized: the estimate P Q^T is scaled wrong",
    ),
    Mutation(
        "powersgd-q-not-averaged",
        "i30 powersgd",
        PSGD_FILE,
        old="        self.q.div_(self.world)\n",
        new="",
        guards=(PSGD + "test_one_step_matches_the_reference_and_every_rank_agrees",),
        what="Q is the ranks' sum, not their average: the gradient comes out world times too large",
    ),
    Mutation(
        "powersgd-no-error-feedback",
        "i30 powersgd",
        PSGD_FILE,
        old="            x.sub_(approx)\n",
        new="            x.zero_()\n",
        guards=(PSGD + "test_error_feedback_keeps_what_was_not_sent",),
        what="what low rank did not send is dropped instead of kept for the next step",
    ),
    Mutation(
        "powersgd-project-before-its-all-reduce",
        "i30 powersgd",
        "hybridcomm/comm/engine.py",
        old="        start, projected = self._reduction(lr.p, self.ready, lr.project)()\n",
        new="        lr.project()\n        start, projected = self._reduction(lr.p, self.ready)()\n",
        guards=(PSGD + "test_powersgd_on_the_simulated_gpu_keeps_ranks_identical",),
        what="the comm stream's P is orthogonalized on the issuing thread before it is all-reduced "
        "(each rank's own P: the ranks' estimates differ)",
    ),
    Mutation(
        "join-joined-rank-sends-its-stale-gradients",
        "i39 join",
        "hybridcomm/sync/bucket_group.py",
        old="                p.grad = None  # absorb zeroes the view and marks the position unused\n",
        new="                pass\n",
        guards=("tests/test_join.py::test_join_gives_ddps_join_numbers_in_every_mode[host]",),
        what="a joined rank's shadow round sends the reduced gradients of its last round "
        "instead of zeros",
    ),
    Mutation(
        "join-divides-by-the-initial-world-always",
        "i39 join",
        "hybridcomm/sync/join.py",
        old="            self.sync.group.engine.scale = 1.0 / ranks\n",
        new="            pass\n",
        guards=("tests/test_join.py::test_join_gives_ddps_join_numbers_in_every_mode[host]",),
        what="divide_by_initial_world_size=False still divides by the initial world size",
    ),
    Mutation(
        "shard-no-gather",
        "i40 shard",
        "hybridcomm/sync/shard.py",
        old='            tickets = all_gather(g, s, f"bucket {s.index}\'s parameters (all_gather)")\n',
        new="            tickets = []\n",
        guards=("tests/test_shard.py::test_sharded_state_gives_one_process_numbers[P2-host]",),
        what="each rank's updated shard is never sent: the other ranks keep stale parameters",
    ),
    Mutation(
        "shard-clip-local-norm",
        "i40 shard",
        "hybridcomm/sync/shard.py",
        old="            total = sum(\n                control.all_gather_object(\n",
        new="            total = sum(\n"
        "                [local]\n"
        "                or control.all_gather_object(\n",
        guards=("tests/test_shard.py::test_sharded_state_gives_one_process_numbers[P2-host]",),
        what="clip_grad_norm_ clips by this rank's part of the gradient's norm",
    ),
    Mutation(
        "shard-late-pass-adds-to-partial-sums",
        "i40 shard",
        "hybridcomm/sync/bucket_group.py",
        old="        if s.scattered:  # (shard: a late pass) whole again before more is added\n",
        new="        if False:\n",
        guards=(
            "tests/test_training_loops.py::test_training_loops_with_sharded_state"
            "[forward-optimizer-host]",
        ),
        what="a late pass adds its gradients to a reduce-scattered bucket (other ranks' "
        "partial sums) and reduces it again",
    ),
    Mutation(
        "pre-hooks-off-in-flight",
        "i38 host cost",
        "hybridcomm/sync/bucket_group.py",
        old="GUARDED = frozenset({Phase.LAUNCHED, Phase.IN_FLIGHT, Phase.PENDING})\n",
        new="GUARDED = frozenset({Phase.LAUNCHED, Phase.PENDING})\n",
        guards=(
            "tests/test_step_cost.py::"
            "test_a_late_pass_enters_the_pre_hook_of_every_launched_parameter[backward-None]",
        ),
        what="the gradient pre-hooks are off while a bucket is in flight: a late pass adds "
        "into a buffer being reduced without waiting for it",
    ),
    Mutation(
        "pre-hooks-never-off",
        "i38 host cost",
        "hybridcomm/sync/grad_hooks.py",
        old="            self._set(s.guards, on)\n",
        new="            self._set(s.guards, True)\n",
        guards=(
            "tests/test_step_cost.py::test_a_steady_host_step_calls_no_pre_hook[backward-None]",
        ),
        what="the pre-hooks stay on after the buckets are consumed: autograd calls into "
        "Python for every parameter of every steady backward",
    ),
    Mutation(
        "lean-closer-unchecked",
        "i38 host cost",
        "hybridcomm/sync/grad_hooks.py",
        old="            if s.kept is not None:\n",
        new="            if True:\n",
        guards=(
            "tests/test_one_hook_per_bucket.py::test_a_step_that_changes_under_lean_hooks_"
            "is_still_reduced_exactly[forward-host]",
        ),
        what="a closer launches its bucket without checking that the bucket's other "
        "gradients came before it: early on the one rank whose graph changed",
    ),
    Mutation(
        "lean-unseen-pass-dropped",
        "i38 host cost",
        "hybridcomm/sync/grad_hooks.py",
        old="        if self.sync.group.set_by_hand() or self._unseen_pass():\n",
        new="        if self.sync.group.set_by_hand():\n",
        guards=(
            "tests/test_one_hook_per_bucket.py::test_a_step_that_changes_under_lean_hooks_"
            "is_still_reduced_exactly[none-host]",
        ),
        what="a backward pass that reached no closer and added into the views in place is "
        "not reduced: the step uses this rank's gradients alone",
    ),
    Mutation(
        "lean-never-learns",
        "i38 host cost",
        "hybridcomm/sync/grad_hooks.py",
        old="        if pos == s.closer:\n",
        new="        if False:\n",
        guards=(
            "tests/test_step_cost.py::test_a_steady_host_step_calls_no_pre_hook[backward-None]",
        ),
        what="the closers are never learned: every parameter keeps its post-accumulate "
        "hook in every step",
    ),
    Mutation(
        "engine-op-outlives-buffer",
        "i38 host cost",
        "hybridcomm/sync/buckets.py",
        old="        self.operations = {}  # (each holds a view of the buffer)\n",
        new="",
        guards=(
            "tests/test_shard.py::test_each_rank_keeps_a_pth_of_the_state_and_gradients_"
            "free_their_buckets",
        ),
        what="the engine's kept operations outlive a released bucket: each holds a view of "
        "the buffer, so shard='gradients' frees nothing",
    ),
    Mutation(
        "engine-op-cycle",
        "i38 host cost",
        "hybridcomm/comm/engine.py",
        old="                extra=extra,\n",
        new="                extra=extra or b.from_wire,\n",
        guards=(
            "tests/test_optimizer_features.py::test_a_replan_frees_the_old_buckets_"
            "memory_at_once[host]",
        ),
        what="a kept operation refers to its bucket (bucket -> operations -> bucket): a "
        "re-plan's old buckets wait for a cycle collection",
    ),
    Mutation(
        "engine-op-stale-scale",
        "i38 host cost",
        "hybridcomm/comm/engine.py",
        old="            key = (s, self.phase, self.scale)\n",
        new="            key = (s, self.phase)\n",
        guards=("tests/test_join.py::test_join_gives_ddps_join_numbers_in_every_mode[host]",),
        what="a kept operation keeps the scale it was built with: after a rank joins, the "
        "others still divide by the whole world",
    ),
    Mutation(
        "shard-view-keeps-memory",
        "i40 sharded state",
        "hybridcomm/sync/shard.py",
        old="            for sl in self.by_bucket[s.index]:\n                sl.drop_grad()\n",
        new="",
        guards=(
            "tests/test_shard.py::test_each_rank_keeps_a_pth_of_the_state_and_gradients_"
            "free_their_buckets",
        ),
        what="shard='gradients' releases a bucket while each slice's cached gradient view "
        "still holds its memory: nothing is freed",
    ),
    Mutation(
        "reshard-drops-later-parts",
        "i40 sharded state",
        "hybridcomm/sync/reshard.py",
        old="    for sl in by_start.values():\n",
        new="    for sl in old.slices:\n",
        guards=(
            "tests/test_shard.py::test_sharded_state_gives_one_process_numbers"
            "[P3-host-reshard-by-parameter]",
        ),
        what="a re-plan drops every old slice's state once its first run is moved: the "
        "later runs' state is lost",
    ),
    Mutation(
        "reshard-piece-misplaced",
        "i40 sharded state",
        "hybridcomm/sync/reshard.py",
        old="                        piece = (j, key, dtype, start, lo - start, (a, z), lo - a, hi - lo)\n",
        new="                        piece = (j, key, dtype, start, lo - start, (a, z), 0, hi - lo)\n",
        guards=("tests/test_shard.py::test_sharded_state_gives_one_process_numbers[P2-host]",),
        what="a re-plan writes each piece of state it receives at the start of the new "
        "slice, not where the piece belongs in it",
    ),
    Mutation(
        "reshard-kept-slice-dropped",
        "i40 sharded state",
        "hybridcomm/sync/reshard.py",
        old="            state[starts[sl.start].tensor] = state.pop(sl.tensor)\n",
        new="            state.pop(sl.tensor)\n",
        guards=("tests/test_shard.py::test_sharded_state_gives_one_process_numbers[P2-host]",),
        what="a re-plan that keeps a parameter's slicing drops its state instead of "
        "re-keying it to the new slice (Adam starts that parameter over)",
    ),
    Mutation(
        "reshard-frozen-not-whole",
        "i40 sharded state",
        "hybridcomm/sync/reshard.py",
        old="        left = id(p) not in new.placement  # (keyed by itself, whole)\n",
        new="        left = False\n",
        guards=(
            "tests/test_training_loops.py::test_training_loops_with_sharded_state"
            "[forward-optimizer-host]",
        ),
        what="a parameter frozen since the last plan keeps its state sliced under slices "
        "that no longer exist, not whole: it is lost when the layer joins again",
    ),
    Mutation(
        "reshard-cut-skips-a-part",
        "i40 sharded state",
        "hybridcomm/sync/reshard.py",
        old="    for i in range(bisect.bisect_right(stops, start), len(ranges)):\n",
        new="    for i in range(bisect.bisect_right(stops, start) + 1, len(ranges)):\n",
        guards=(
            "tests/test_shard.py::test_every_ranks_cut_of_a_parameter_is_its_slice_of_"
            "that_ranks_parts[ring]",
        ),
        what="the look-up of the ranges that overlap a slice skips the first: a rank's "
        "cut of a parameter, and the pieces a re-plan sends, lose a part",
    ),
    Mutation(
        "reshard-frozen-lost-at-one-rank",
        "i40 sharded state",
        "hybridcomm/sync/reshard.py",
        old="                state[p] = {\n"
        "                    k: v.view(p.shape) if _per_element(v, sl) else v\n"
        "                    for k, v in state.pop(sl.tensor).items()\n"
        "                }\n",
        new="                state.pop(sl.tensor)\n",
        guards=(
            "tests/test_shard.py::test_replans_keep_the_slices_they_can_and_move_the_"
            "rest_as_one_process[1]",
        ),
        what="at one rank, a parameter frozen since the last plan loses its state (its one "
        "slice is the whole, so nothing is exchanged): Adam starts it over when it "
        "joins again",
    ),
    Mutation(
        "shard-flags-wrong-copy",
        "i40 sharded state",
        "hybridcomm/sync/buckets.py",
        old="        flags = self.flags if self.flags.dim() == 1 else self.flags[rank]\n",
        new="        flags = self.flags if self.flags.dim() == 1 else self.flags[0]\n",
        guards=(
            "tests/test_shard.py::test_a_parameter_some_ranks_have_no_gradient_for_steps_as_"
            "in_one_process[2]",
        ),
        what="under shard every rank reads rank 0's copy of the usage flags, which only "
        "rank 0 has summed: a parameter this rank lacked reads as unused by all",
    ),
    Mutation(
        "shard-unused-bucket-stays-scattered",
        "i40 sharded state",
        "hybridcomm/sync/shard.py",
        old="                if s.scattered:\n"
        "                    s.scattered = False\n"
        "                    g.rearm(s)\n",
        new="",
        guards=(
            "tests/test_shard.py::test_a_parameter_some_ranks_have_no_gradient_for_steps_as_"
            "in_one_process[2]",
        ),
        what="a bucket no rank had a gradient for keeps its reduce-scattered mark after "
        "the step: the ranks make it whole at different points of the next backward "
        "(a collective mismatch)",
    ),
    Mutation(
        "shard-no-restore-after-pending-gather",
        "i40 sharded state",
        "hybridcomm/sync/bucket_group.py",
        old='        elif s.bucket.released:  # (shard="gradients": freed since the last step)\n'
        "            s.bucket.restore()\n",
        new="",
        guards=(
            "tests/test_shard.py::test_a_parameter_some_ranks_have_no_gradient_for_steps_as_"
            "in_one_process[2]",
        ),
        what="shard='gradients', forward mode: a pending bucket opened before its first "
        "read (a layer this rank did not use) is not restored after its gather frees "
        "it (the restore came first, when nothing was freed yet)",
    ),
    Mutation(
        "shard-release-keeps-no-part",
        "i40 sharded state",
        "hybridcomm/sync/scatter.py",
        old="    b.release(keep=ranges if s.content else (), reserved=reserved)\n",
        new="    b.release(reserved=reserved)\n",
        guards=(
            "tests/test_shard_release.py::test_buckets_keep_only_their_part_from_backward_"
            "and_train_as_one_process[backward-host]",
        ),
        what="shard='gradients' releases a bucket in backward without keeping this rank's "
        "part: the step takes a fresh zeroed buffer's gradients",
    ),
    Mutation(
        "shard-released-grad-none",
        "i40 sharded state",
        "hybridcomm/sync/scatter.py",
        old="            p.grad = placeholders[id(p)]\n",
        new="            p.grad = None\n",
        guards=(
            "tests/test_shard_release.py::test_a_released_gradient_refuses_use_until_synchronize",
        ),
        what="a released bucket's .grad is None: a user's own clip_grad_norm_ or "
        "scaler.unscale_(opt) skips it silently, and synchronize() leaves it None",
    ),
    Mutation(
        "shard-late-pass-onto-released",
        "i40 sharded state",
        "hybridcomm/sync/grad_hooks.py",
        old="                    sync.open(s)  # whole again, .grad its view: autograd adds into it\n",
        new="                    pass\n",
        guards=(
            "tests/test_shard_release.py::test_buckets_keep_only_their_part_from_backward_"
            "and_train_as_one_process[forward-host]",
        ),
        what="a later backward pass reaches a released bucket's placeholder without making "
        "the bucket whole first: autograd adds into the placeholder",
    ),
    Mutation(
        "shard-released-content-kept",
        "i40 sharded state",
        "hybridcomm/sync/shard.py",
        old="                s.content = {pos for pos in s.content if is_released(s.bucket.params[pos].grad)}\n",
        new="                pass\n",
        guards=(
            "tests/test_shard_release.py::test_ranks_that_released_different_buckets_gather_alike",
        ),
        what="a bucket released in backward keeps the content it had then: after zero_grad() "
        "the rank that released it gathers it, the rank that kept it whole does not, "
        "and the ranks' collectives mismatch",
    ),
    Mutation(
        "shard-in-flight-part-not-copied",
        "i40 sharded state",
        "hybridcomm/comm/engine.py",
        old="            self.extra()\n",
        new="            pass\n",
        guards=(
            "tests/test_shard_release.py::test_buckets_keep_only_their_part_from_backward_"
            "and_train_as_one_process[backward-simgpu]",
        ),
        what="on a GPU, a bucket released in flight keeps a part its reduce-scatter was never "
        "copied into: the step takes whatever the new memory held",
    ),
    Mutation(
        "shard-in-flight-buffer-kept",
        "i40 sharded state",
        "hybridcomm/comm/engine.py",
        old="                self._after[i] = None  # (in the operation now: it holds the buffer's views)\n",
        new="                pass\n",
        guards=(
            "tests/test_shard_release.py::test_buckets_keep_only_their_part_from_backward_"
            "and_train_as_one_process[backward-simgpu]",
        ),
        what="on a GPU, the engine keeps a launch's part copy (and so the bucket's buffer) until "
        "the bucket's next launch: the released buffer's memory is not freed in backward",
    ),
    Mutation(
        "shard-in-flight-never-dropped",
        "i40 sharded state",
        "hybridcomm/sync/bucket_group.py",
        old="            self.in_flight_release.drop(s)  # (its part reserved at the launch)\n",
        new="            pass\n",
        guards=(
            "tests/test_shard_release.py::test_buckets_keep_only_their_part_from_backward_"
            "and_train_as_one_process[backward-simgpu]",
        ),
        what="on a GPU, shard='gradients' reserves a part at each launch but never drops the "
        "buffer: backward holds every bucket whole, and the part besides",
    ),
    Mutation(
        "checkpoint-plan-across-shard",
        "i40 sharded state",
        "hybridcomm/sync/checkpoint.py",
        old="    if any(b.flag_copies != copies for b in saved.buckets):\n",
        new="    if False:\n",
        guards=("tests/test_shard.py::test_a_checkpoints_plan_is_not_adopted_across_shard",),
        what="a checkpoint's plan is adopted by an optimizer with another shard=: a plain "
        "plan's butterfly has no reduce-scatter (KeyError), a sharded one's layout is "
        "kept",
    ),
    Mutation(
        "pending-registration-kept",
        "i38 host cost",
        "hybridcomm/sync/pending.py",
        old="        if fn is apply:\n",
        new="        if fn is apply and ref() is not None and _bases.get(ref().__class__):\n",
        guards=(
            "tests/test_forward_mode.py::test_a_closed_optimizer_is_freed_even_after_a_"
            "layer_left_its_buckets",
        ),
        what="close() unregisters only the parameters still pending: the others' "
        "registrations keep the closed synchronizer and its buckets alive",
    ),
    Mutation(
        "zeroed-grad-shown",
        "i38 host cost",
        "hybridcomm/sync/deferred.py",
        old="            if s.zeroed and s.phase is Phase.PENDING and grad is s.bucket.views[pos]:\n",
        new="            if False:\n",
        guards=(
            "tests/test_forward_mode.py::test_gradients_zeroed_while_an_update_waits_read_"
            "as_in_one_process[False]",
        ),
        what="zero_grad() while forward mode's update waits leaves p.grad reading the "
        "reduced gradient until the next forward",
    ),
    Mutation(
        "zeroed-grad-kept-after-update",
        "i38 host cost",
        "hybridcomm/sync/deferred.py",
        old="        grad_fields.set_grads(\n",
        new="        (lambda *_: None)(\n",
        guards=(
            "tests/test_forward_mode.py::test_gradients_zeroed_while_an_update_waits_read_"
            "as_in_one_process[False]",
        ),
        what="a gradient zeroed while its update waited is still the view after the "
        "update: the next backward adds into last step's reduced gradient",
    ),
    Mutation(
        "pre-hook-reads-shown-grad",
        "i38 host cost",
        "hybridcomm/sync/grad_hooks.py",
        old="            if grad_field(p) is not None:\n",
        new="            if p.grad is not None:\n",
        guards=(
            "tests/test_forward_mode.py::test_gradients_zeroed_while_an_update_waits_read_"
            "as_in_one_process[False]",
        ),
        what="the pre-hook reads the None a zeroed pending parameter shows: a backward over "
        "a graph from before step() adds into the view its update has not taken yet",
    ),
    Mutation(
        "zeroed-hand-set-grad-kept",
        "i38 host cost",
        "hybridcomm/sync/deferred.py",
        old="                        if not (kept and pos in s.taken) and p.grad is not None:\n",
        new="                        if pos not in s.taken and p.grad is not None:\n",
        guards=(
            "tests/test_forward_mode.py::test_gradients_zeroed_while_an_update_waits_read_"
            "as_in_one_process[False]",
        ),
        what="zero_grad() skips every parameter of a pending bucket: a gradient set by hand "
        "after step() survives it",
    ),
    Mutation(
        "grad-writes-unseen",
        "i38 host cost",
        "hybridcomm/sync/pending.py",
        old="                _watcher(args[0], 1, _unseen)(args[0])\n",
        new="                pass\n",
        guards=(
            "tests/test_forward_mode.py::test_gradients_zeroed_while_an_update_waits_read_"
            "as_in_one_process[False]",
        ),
        what="a .grad written while its update is pending goes unseen: zero_grad() keeps a "
        "gradient set by hand, the update takes one set after zero_grad()",
    ),
    Mutation(
        "rebound-ignored-at-settle",
        "i38 host cost",
        "hybridcomm/sync/deferred.py",
        old="            whole = not o.rebound and len(o.taken) == len(o.bucket.params)\n",
        new="            whole = len(o.taken) == len(o.bucket.params)\n",
        guards=(
            "tests/test_forward_mode.py::test_gradients_zeroed_while_an_update_waits_read_"
            "as_in_one_process[False]",
        ),
        what="a bucket whose .grad was set by hand while pending is taken as all views: the "
        "hand-set gradient goes None after the update",
    ),
    Mutation(
        "rebound-ignored-at-update",
        "i38 host cost",
        "hybridcomm/sync/deferred.py",
        old="            bound = not any(o.rebound for o in together)\n",
        new="            bound = True\n",
        guards=(
            "tests/test_forward_mode.py::test_gradients_zeroed_while_an_update_waits_read_"
            "as_in_one_process[False]",
        ),
        what="the deferred update steps on whatever .grad holds, a gradient set by hand "
        "since step() included, not on the reduced views",
    ),
    Mutation(
        "zeroed-others-kept",
        "i38 host cost",
        "hybridcomm/sync/deferred.py",
        old="            for p in self._others(group, param_groups, states):\n",
        new="            for p in []:\n",
        guards=(
            "tests/test_reliability.py::test_sparse_embeddings_train_like_one_process[forward]",
        ),
        what="zero_grad() while an update waits leaves the gradient of a parameter in no "
        "pending bucket (a sparse one, reduced apart) as it was",
    ),
    Mutation(
        "dropped-grads-kept",
        "i38 host cost",
        "hybridcomm/sync/pending.py",
        old="        grad_fields.set_grads(params)\n",
        new="        pass\n",
        guards=("tests/test_optimizer_features.py",),
        what="zero_grad() with nothing pending leaves every .grad: the next backward adds "
        "into last step's reduced gradients",
    ),
    Mutation(
        "host-kept-apart-view-unseen",
        "i38 host cost",
        "csrc/host_ops.cpp",
        old="      if (!g.defined() || same(g, *vs[i])) Py_RETURN_NONE;\n",
        new="      if (!g.defined()) Py_RETURN_NONE;\n",
        guards=("tests/test_grad_fields.py",),
        what="the C++ kept_apart takes a .grad that is its own view for a gradient of "
        "autograd's: a bucket is copied onto itself and launched from a closer",
    ),
    Mutation(
        "host-copy-version-kept",
        "i38 host cost",
        "csrc/host_ops.cpp",
        old="        v.unsafeGetTensorImpl()->bump_version();\n",
        new="",
        guards=("tests/test_grad_fields.py",),
        what="the C++ copy into a bucket's views leaves their version: a write since the "
        "step is not seen (lean hooks' unseen pass)",
    ),
    Mutation(
        "host-subclass-unseen",
        "i38 host cost",
        "csrc/host_ops.cpp",
        old="    } else if (THPVariable_CheckExact(items[i])) {\n",
        new="    } else if (THPVariable_Check(items[i])) {\n",
        guards=("tests/test_grad_fields.py",),
        what="the C++ loops read and write a pending parameter's .grad behind its "
        "__torch_function__: forward mode's watch misses them",
    ),
    Mutation(
        "host-class-switch-leaks",
        "i38 host cost",
        "csrc/host_ops.cpp",
        old="    Py_DECREF(from);\n",
        new="",
        guards=("tests/test_grad_fields.py",),
        what="a known class switch keeps its reference to the class it leaves: every "
        "forward-mode step leaks two references per parameter",
    ),
    Mutation(
        "host-class-switch-unchecked",
        "i38 host cost",
        "csrc/host_ops.cpp",
        old="  if (known) {\n",
        new="  if (known || PyType_Check(cls)) {\n",
        guards=("tests/test_grad_fields.py",),
        what="every class switch skips object.__class__'s checks: an incompatible class "
        "is set on a tensor",
    ),
    Mutation(
        "pending-read-misses-keywords",
        "i38 host cost",
        "hybridcomm/sync/pending.py",
        old="            _resolve_in(kwargs.values())\n",
        new="            pass\n",
        guards=(
            "tests/test_forward_mode.py::test_a_read_applies_the_update_of_every_pending_argument",
        ),
        what="a pending parameter passed by keyword is read before its update: "
        "torch.add(x, other=p) sees the stale weight",
    ),
    Mutation(
        "pending-read-misses-lists",
        "i38 host cost",
        "hybridcomm/sync/pending.py",
        old="                _resolve_in(a)\n",
        new="                pass\n",
        guards=(
            "tests/test_forward_mode.py::test_a_read_applies_the_update_of_every_pending_argument",
        ),
        what="a pending parameter inside a list or tuple argument is not applied: "
        "torch.stack([p, q]) recurses into its own __torch_function__",
    ),
    Mutation(
        "guard-never-on",
        "i38 host cost",
        "csrc/host_ops.cpp",
        old="  return each_guard(args[0], [on](Guard* g) { g->on->store(on != 0, std::memory_order_release); });\n",
        new="  return each_guard(args[0], [on](Guard* g) { g->on->store(false, std::memory_order_release); });\n",
        guards=(
            "tests/test_grad_fields.py::test_guards_of_cpp_call_before_the_add_only_while_on",
            "tests/test_step_cost.py::test_a_late_pass_enters_the_pre_hook_of_every_launched_"
            "parameter",
        ),
        what="the guards never go on: a late gradient is added into a bucket while it is "
        "reduced, or into a view whose update is still pending",
    ),
    Mutation(
        "guard-not-dropped",
        "i38 host cost",
        "csrc/host_ops.cpp",
        old="  if (guard->hook == nullptr) return;\n",
        new="  return;\n",
        guards=("tests/test_grad_fields.py::test_guards_of_cpp_call_before_the_add_only_while_on",),
        what="a dropped guard stays on its parameter's node: a closed optimizer's hooks keep "
        "being called",
    ),
    Mutation(
        "native-scatter-unscaled",
        "i40 native",
        "hybridcomm/comm/transport/torch_dist.py",
        old="        )\n"
        "        wait_work(work, self.rank, label, timeout)\n"
        "        if average:\n"
        "            mine.mul_(1.0 / self.world_size)\n",
        new="        )\n"
        "        wait_work(work, self.rank, label, timeout)\n"
        "        if False:\n"
        "            mine.mul_(1.0 / self.world_size)\n",
        guards=(
            "tests/test_native_phases.py::test_native_reduce_scatter_then_all_gather_is_the_"
            "all_reduce[3-host-float32]",
        ),
        what="gloo's reduce-scatter leaves each rank's part summed where the average was asked "
        "for: P times the gradient",
    ),
    Mutation(
        "native-flags-not-scattered",
        "i40 native",
        "hybridcomm/comm/executor.py",
        old="    for part in (buf[:body], buf[body:]) if tail else (buf,):\n",
        new="    for part in (buf[:body],) if tail else (buf,):\n",
        guards=(
            "tests/test_shard.py::test_a_parameter_some_ranks_have_no_gradient_for_steps_as_"
            "in_one_process[3]",
        ),
        what="a native bucket's usage flags are not reduce-scattered: each rank sees only "
        "its own, and a parameter another rank used is skipped",
    ),
    Mutation(
        "native-unpadded",
        "i40 native",
        "hybridcomm/plan/layout.py",
        old="    padded = equal_padding(grad_numel, world)\n",
        new="    padded = grad_numel\n",
        guards=(
            "tests/test_shard.py::test_the_process_groups_own_reduce_scatter_forced_or_chosen_"
            "gives_one_process_numbers[P3-host]",
        ),
        what="a native bucket is not padded to equal parts: the collective cannot cut it",
    ),
    Mutation(
        "sim-scatter-keeps-rank0-part",
        "i40 native",
        "hybridcomm/testing/simgpu.py",
        old="        acc = acc[comm.rank * count : (comm.rank + 1) * count]\n",
        new="        acc = acc[:count]\n",
        guards=(
            "tests/test_native_phases.py::test_native_reduce_scatter_then_all_gather_is_the_"
            "all_reduce[2-simgpu-float16]",
        ),
        what="the simulated NCCL reduce-scatter gives every rank rank 0's part",
    ),
    Mutation(
        "compiled-forward-not-applied",
        "i38 host cost",
        "hybridcomm/sync/pending.py",
        old="        if _tracing():\n            self.compiled_whole = True\n",
        new="        if False:\n            self.compiled_whole = True\n",
        guards=(COMPILE + "test_every_compile_pattern_gives_one_process_numbers[forward-host]",),
        what="the model's pre-hook no longer tells that the whole forward is compiled: its "
        "updates stay deferred, so every read in the graph pays an operator call and the "
        "forward compiles again for the pending class",
    ),
    Mutation(
        "compiled-forward-frames-unseen",
        "i38 host cost",
        "hybridcomm/sync/pending.py",
        old="    if _waiting and _under_torch_compile():\n",
        new="    if False:\n",
        guards=(
            "tests/test_forward_mode.py::test_a_compiled_forward_reads_each_pending_update_"
            "first[frame_walk-compiled_function]",
        ),
        what="on a torch without dynamo's flags, the hook's frame walk is gone: the pending "
        "parameters reach the compiled function, whose graph must apply them read by read",
    ),
    # ---- torch.compile as its users run it -----------------------------------------------
    Mutation(
        "in-graph-read-stale",
        "i71 compile",
        "hybridcomm/sync/pending.py",
        old="        if _classify(func) == LOUD:  # (not _kind's cache: dynamo keys no dict by a "
        "function)\n",
        new="        if False:\n",
        guards=(
            "tests/test_forward_mode.py::test_a_compiled_forward_reads_each_pending_update_"
            "first[in_graph-optimized_module]",
        ),
        what="a pending parameter traced by dynamo is read with no call of the operator "
        "that applies its update: the graph reads last step's weights",
    ),
    # (was in-graph-copy-missing, the operator's copy into functionalization's value:
    # on torch 2.13 dynamo's own look at the real parameter applies the update at trace
    # time, before any copy is made, so no test can see the copy go: docs/ARCHITECTURE.md)
    Mutation(
        "in-graph-read-unnoted",
        "i71 compile",
        "hybridcomm/sync/compiled.py",
        old='        _counts["version"] += 1\n',
        new="        pass\n",
        guards=(COMPILE + "test_every_compile_pattern_gives_one_process_numbers[forward-host]",),
        what="a pending parameter read inside a graph is applied but not noted: the blocks "
        "compiled after the optimizer are never given an entry, and each step that finds the "
        "parameter pending compiles the graph again",
    ),
    Mutation(
        "block-entry-applies-nothing",
        "i71 compile",
        "hybridcomm/sync/compiled.py",
        old="            if is_pending(p):  # (its bucket's update applies the bucket's others too)\n",
        new="            if False:\n",
        guards=(COMPILE + "test_every_compile_pattern_gives_one_process_numbers[forward-host]",),
        what="a compiled block's entry applies nothing: every step its graph applies the "
        "updates read by read, recompiled for the pending class",
    ),
    Mutation(
        "late-blocks-never-found",
        "i71 compile",
        "hybridcomm/sync/compiled.py",
        old="            self.scan()\n            self.in_step.update(_read_in_graph - self.at_entry)\n",
        new="            self.in_step.update(_read_in_graph)\n",
        guards=(COMPILE + "test_every_compile_pattern_gives_one_process_numbers[forward-host]",),
        what="blocks compiled after the optimizer was made are never given an entry: their "
        "updates are applied in step() and do not overlap the forward",
    ),
    Mutation(
        "step-verbs-traced",
        "i71 compile",
        "hybridcomm/optimizer.py",
        old="    verbs = {\n        name: eager_only(",
        new="    verbs = {} and {\n        name: eager_only(",
        guards=(COMPILE + "test_every_compile_pattern_gives_one_process_numbers[backward-host]",),
        what="a compiled training step traces step() and zero_grad() (threads, the channel, "
        "the buckets' phases) instead of calling them",
    ),
    Mutation(
        "post-hook-traced",
        "i71 compile",
        "hybridcomm/sync/grad_hooks.py",
        old="        hook = eager_only(self.after_grad, why=_HOOK_WHY)\n",
        new="        hook = self.after_grad\n",
        guards=(COMPILE + "test_compiled_autograd_in_every_loop[backward-host]",),
        what="compiled autograd's graph inlines the post-accumulate hook: dynamo traces the "
        "bucket bookkeeping and the launch",
    ),
    Mutation(
        "guard-absent-under-compiled-autograd",
        "i71 compile",
        "csrc/host_ops.cpp",
        old="    if (!on->load(std::memory_order_acquire)) return;\n    pybind11::gil_scoped_acquire "
        "gil;\n    if (traced == nullptr) {",
        new="    return;\n    pybind11::gil_scoped_acquire gil;\n    if (traced == nullptr) {",
        guards=("tests/test_grad_fields.py::test_guards_of_cpp_call_before_the_add_only_while_on",),
        what="a gradient guard that is on hands compiled autograd nothing: its graph adds into "
        "a bucket's view with no check that the bucket may be written",
    ),
    Mutation(
        "simulator-traced-by-dynamo",
        "i71 compile",
        "hybridcomm/testing/simgpu.py",
        old="        if _compiling():  # dynamo traces this mode: a compiled graph's ops are not seen\n",
        new="        if False:\n",
        guards=(COMPILE + "test_every_compile_pattern_gives_one_process_numbers[backward-simgpu]",),
        what="the simulated GPU's torch-function mode is traced into compiled code: dynamo "
        "meets its locks and condition variables",
    ),
    # ---- DiLoCo / Streaming DiLoCo ---------------------------------------------------------
    Mutation(
        "diloco-fragment-synced-at-wrong-step",
        "i69 diloco",
        "hybridcomm/strategies/fragments.py",
        old="        phase = step % self.sync_every\n",
        new="        phase = (step + 1) % self.sync_every\n",
        guards=(
            DILOCO + "test_streaming_keeps_the_ranks_equal_and_follows_the_algorithm",
            "tests/test_diloco_schedule.py::test_every_fragment_starts_once_a_period_at_its_offset",
        ),
        what="every fragment starts its sync one inner step early (at offset - 1)",
    ),
    Mutation(
        "diloco-delayed-update-on-wrong-base",
        "i69 diloco",
        "hybridcomm/strategies/diloco.py",
        old="                p.copy_(self._global[i])\n",
        new="                pass\n",
        guards=(DILOCO + "test_streaming_keeps_the_ranks_equal_and_follows_the_algorithm",),
        what="a fragment's outer update is applied to the local parameters it has now (tau "
        "inner steps after its sync started) instead of to the global copy",
    ),
    Mutation(
        "diloco-delta-against-local-copy",
        "i69 diloco",
        "hybridcomm/strategies/diloco.py",
        old="            for p, i in zip(params, idx):\n"
        "                self._global[i].copy_(p)  # the outer step's result: the same on every "
        "rank\n"
        "            if mixing:\n"
        "                torch._foreach_lerp_(params, local, mixing)\n",
        new="            if mixing:\n"
        "                torch._foreach_lerp_(params, local, mixing)\n"
        "            for p, i in zip(params, idx):\n"
        "                self._global[i].copy_(p)  # the outer step's result: the same on every "
        "rank\n",
        guards=(DILOCO + "test_streaming_keeps_the_ranks_equal_and_follows_the_algorithm",),
        what="the copy Δ is taken against holds the rank's own merged (mixed) parameters: "
        "the next Δ is taken against this rank's local parameters, not the global ones",
    ),
    Mutation(
        "diloco-carry-progress-dropped",
        "i69 diloco",
        "hybridcomm/strategies/diloco.py",
        old="            if carry:\n                torch._foreach_sub_(params, progress_back)\n",
        new="            if carry:\n                pass\n",
        guards=(DILOCO + "test_streaming_keeps_the_ranks_equal_and_follows_the_algorithm",),
        what="mixing='carry' merges the new global parameters alone: the rank's progress "
        "while the sync was in flight is dropped",
    ),
    # ---- sharding by whole parameters and DCP checkpoints ---------------------------------
    Mutation(
        "unknown-optimizer-sliced",
        "i68 granularity",
        "hybridcomm/sync/granularity.py",
        old="    return PARAMETERS, (\n",
        new="    return ELEMENTS, (\n",
        guards=(
            GRAN
            + "test_every_optimizer_sharded_either_way_gives_one_process_numbers[rest-P2-host]",
        ),
        what="an optimizer the library does not know (Adafactor, Muon, a LARS) gets element "
        "slices, stepped as if each were a tensor",
    ),
    Mutation(
        "whole-parameter-stepped-as-a-slice",
        "i68 granularity",
        "hybridcomm/sync/shard.py",
        old="        self.tensor = param.detach() if whole else param.detach().view(-1)[start:stop]\n",
        new="        self.tensor = param.detach().view(-1)[start:stop]\n",
        guards=(
            GRAN
            + "test_every_optimizer_sharded_either_way_gives_one_process_numbers[rest-P2-host]",
        ),
        what="a whole parameter's slice is flat: the optimizer steps a 1-D tensor (Adafactor "
        "unfactored, Muon refused, a LARS's norm right but its shape lost)",
    ),
    Mutation(
        "rank-steps-what-it-does-not-own",
        "i68 granularity",
        "hybridcomm/sync/shard.py",
        old="            for lo, hi in self.owned[s.index]:\n",
        new="            for lo, hi in [(0, b.spec.segments[-1][1])] if whole else self.owned[s.index]:\n",
        guards=(
            GRAN
            + "test_every_optimizer_sharded_either_way_gives_one_process_numbers[rest-P2-host]",
        ),
        what="every rank steps every parameter of a bucket of whole parameters (on its partial "
        "sums; the all-gather then overwrites them) and keeps their state",
    ),
    Mutation(
        "dcp-save-gathers",
        "i68 checkpoint",
        "hybridcomm/optimizer.py",
        old="        elif sharding.dcp.asked_by_dcp():",
        new="        elif False:",
        guards=(
            "tests/test_shard_dcp.py::test_a_dcp_checkpoint_holds_each_ranks_part_and_resumes_"
            "anywhere[backward-host-adamw]",
        ),
        what="DCP's get_state_dict gets the consolidated state: every rank gathers and hands "
        "DCP the whole optimizer state",
    ),
]
