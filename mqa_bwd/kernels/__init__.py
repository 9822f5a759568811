"""TileLang kernels of the sparse absorbed-MQA backward (Hopper, sm_90a).

Every kernel here has a CPU twin in ``mqa_bwd.model`` with the same launch
contract: the same arguments, the same tile derived from the configuration it
is built from, the same rows read and written, the same bf16 rounding points
and the same explicit reduction orders. The host wrapper (``mqa_bwd.wrapper``)
drives either through ``mqa_bwd.launch``.

Layouts (the wrapper prepares them): query rows of every batch element are
flattened into R = B*S rows, kv rows into NKV = B*S_kv rows, and a slot index
is either a global kv row in [0, NKV) or -1. The main backward reads one
head group in place: heads [head_base, head_base + tile) of [R, HQ, ...]
tensors that hold every (padded) head, so no per-group copies exist.

Modules, by what they build
  config.py            the configurations (MainConfig, KernelConfig), constants, the launch policy
  delta.py             Lse2 (base 2, sink-inclusive) from lse and the sink; Delta =
                       rowsum(O * dO); DSinkRows = -exp2(Sink * log2(e) - Lse2) * Delta
                       (fixed design: also max |dO| per row and head, as bf16 bits)
  main_bwd.py          one CTA per query row, KV rows gathered with cp.async one slot
                       block ahead: dQ of the group, and the per-slot dKV
                       contributions added into an int64 fixed-point accumulator
                       (deterministic: integer adds commute), or into fp32 with
                       atomics (the control)
  wide.py              the wide 64-head tile (two 32-head groups): warp-specialised over
                       64-slot blocks, dKV added from registers, in lanes (deterministic,
                       with its int64 redo) or fp32 atomics
  device_functions.py  the CUDA device functions the main kernels import as source
  plan.py              mark_slots: Referenced[k] = 1 for every kv row a valid slot names,
                       LiveRow[r] = 1 for every row with a valid slot, and max |Q| per row
                       and head as bf16 bits (PeakQ); plan: the fixed-point
                       plan's row scales and mass allowances (fixed_point.plan's float64
                       operations), in three stages
  prologue.py          slot_keys and place_slots (the slot layout around torch's sort),
                       sorted_slots (all three in one CTA a row, for rows of at most
                       SORT_CAPACITY slots, and row_blocks' counts; its deterministic build,
                       sorted_marks, also does mark_slots' work for its rows), row_blocks (each
                       row's count of the wide tile's slot blocks, after the three steps): the
                       wrapper's layout steps (mqa_bwd.layout defines them)
  reductions.py        dsink_reduce (DSink[h] over the rows in a fixed order: 64 strided row
                       groups, then their sums), fixed_to_bf16 (the fixed-point accumulator ->
                       bf16 dKV, NaN when poisoned), lanes_to_bf16 (the same with the lanes
                       joined), lanes_failed and poisoned_batches (the call's flags after its
                       main launches: whether the lanes' int64 redo runs, and the batch
                       elements whose dKV is NaN), zero_gated (the redo's accumulator,
                       zeroed only where the redo runs), cast_bf16
  toolchain.py         the compile cache (compiled(config), small_kernel(kind, *args)), nvcc, ptx_of, ptxas_info,
                       sass_and_ptxas_info (nvdisasm), sass_in_line, dynamic_shared_bytes, precompile
"""

from .config import _tl  # noqa: F401  (the benchmarks build probes with it)
from .device_functions import GATHER_SOURCE  # noqa: F401
from .config import (ACCUMULATE, BLOCK_SLOTS, CLUSTER_SIZES, GPU_WIDTHS, LANE_BLOCK, LANE_GROUP, LANE_LIMIT, LANES_ADDRESSABLE, LANES_GAIN, LOG2E, MASS_LIMIT, MULTI_TILE,
                     SLOT_INDEX_DTYPES, SORT_CAPACITY, SORT_ITEM_COUNTS, TILE_HEADS, WIDE_CHUNK, WIDE_DQ_SPLIT, WALK_BLOCK, WIDE_HEADS, WIDE_SLOTS, WIDE_WG0_CHUNKS, KernelConfig, MainConfig, gpu_configs,
                     default_wg0_chunks, dq_split_bounds, lane_chunk_words, require_wide_widths, lane_word_columns, lanes_corrections, lanes_redo, main_config, main_launches, main_tile_heads, next_power_of_2, sort_items)
from .delta import delta_program
from .main_bwd import main_bwd_program
from .prologue import place_slots_program, row_blocks_program, slot_keys_program, sorted_slots_program
from .plan import MARK_THREADS, MAX_SLOTS_PER_ROW, PLAN_SLOTS, PLAN_THREADS, mark_slots_program, plan_program
from .reductions import (cast_bf16_program, dsink_reduce_program, fixed_to_bf16_program, lanes_failed_program,
                         lanes_to_bf16_program, poisoned_batches_program, zero_gated_program)
from .wide import wide_program
from .toolchain import (SM90A, compile_program, compiled, cuda_tool, dynamic_shared_bytes, nvcc_path, nvdisasm_path,
                        precompile, program_of, ptx_of, ptxas_info, ptxas_info_of_source, require_nvcc,
                        sass_and_ptxas_info, sass_in_line, small_kernel)
