"""jax's GPU interpret mode (Mosaic GPU kernels run on CPU), with transposed wgmma operands.

jax 0.10.2's interpreter (`jax._src.pallas.mosaic_gpu.interpret`, private) computes a wgmma as
`acc + a @ b` over the operands' SMEM buffers and cannot read a `plgpu.transpose_ref` operand
(it fails on the transform). `q @ k^T` needs one, so `install()` wraps the interpreter's wgmma
callback: a B operand transposed with (1, 0) is read as stored and transposed before the
product; anything else goes to jax's own callback unchanged. Only the interpreter is touched,
never the lowering a GPU runs.
"""

from __future__ import annotations

import numpy as np


def install():
    """Patch the interpreter (idempotent) -> the `interpret=` value for `plgpu.kernel`."""
    import jax
    from jax._src.pallas.mosaic.interpret import utils as interpret_utils
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    from jax._src.state.types import TransposeTransform

    original = gpu_callbacks.wgmma
    if getattr(original, "handles_transposed_operands", False):
        return InterpretGPUParams()

    def wgmma(*, token, device_id, grid_point_coords, thread_id, acc_allocation_key_as_array, acc_transforms,
              acc_dtype, a_allocation_key_as_array, a_transforms, b_allocation_key_as_array, b_transforms,
              source_info=None):
        transposes = [tuple(t.permutation) for t in b_transforms if isinstance(t, TransposeTransform)]
        b_transforms = tuple(t for t in b_transforms if not isinstance(t, TransposeTransform))
        args = dict(token=token, device_id=device_id, grid_point_coords=grid_point_coords, thread_id=thread_id,
                    acc_allocation_key_as_array=acc_allocation_key_as_array, acc_transforms=acc_transforms,
                    acc_dtype=acc_dtype, a_allocation_key_as_array=a_allocation_key_as_array,
                    a_transforms=a_transforms, b_allocation_key_as_array=b_allocation_key_as_array,
                    b_transforms=b_transforms, source_info=source_info)
        if not transposes:
            return original(**args)
        if transposes != [(1, 0)] or any(isinstance(t, TransposeTransform) for t in a_transforms):
            raise NotImplementedError(f"interpreted wgmma with transposes {transposes} on B (or any on A)")
        memory = gpu_callbacks._get_shared_memory()
        thread = memory.get_global_thread_id(int(device_id), int(thread_id))
        log = interpret_utils.GPULoggingInfo(device_id=int(device_id), thread_id=int(thread_id),
                                             grid_point_coords=tuple(int(x) for x in grid_point_coords),
                                             source_info=source_info)
        keys = [gpu_callbacks.HostAllocationKey.from_array(x)
                for x in (acc_allocation_key_as_array, a_allocation_key_as_array, b_allocation_key_as_array)]
        ranges = [interpret_utils.to_range(jax.tree.map(int, gpu_callbacks._remove_noop_transforms(t)))
                  for t in (acc_transforms, a_transforms, b_transforms)]
        acc, a, b = (memory.get_buffer_content(k, r, thread, logging_info=log)[0] for k, r in zip(keys, ranges))
        memory.store_buffer_content(keys[0], ranges[0], acc + np.matmul(a, b.T, dtype=acc_dtype), thread,
                                    logging_info=log)
        return token

    wgmma.handles_transposed_operands = True
    gpu_callbacks.wgmma = wgmma
    return InterpretGPUParams()
