"""Variants kept only to time against the product (not imported by mqa_bwd).

  full_line_control.patch   the atomic control's wide-tile adds as whole 128-byte lines, as
                            cuDNN's SM90 backward adds: an accumulator in line order
                            (config.line_order_column), a row-pair swap of one 16-column group
                            a line, so that a warp's red.v4.f32 covers 4 rows x 128 bytes, and
                            the 32-head kernel and the cast in the same order. Faster, but its
                            kernel spills (docs/performance-log.md, 2026-12-03). It applies to
                            02bb267's package (the wide tile has changed since); time it as
                            another revision of the package against that revision:

        git archive 02bb267 mqa_bwd | tar -x -C /tmp/variant
        patch -d /tmp/variant -p1 < experiments/full_line_control.patch
        python benchmarks/package_ab.py --against /tmp/variant/mqa_bwd --shapes dsv32,fleet

  no_bounds.patch           ablations of the wide tile at 2d0ce1d, to say where the
  no_adds.patch             deterministic kernel's time goes (docs/performance-log.md, eleventh
  control_no_adds.patch     session): no_bounds drops the lanes' peaks and bounds (the same
                            bits, Bound stays 0); no_adds turns each red.global.add.u64 into a
                            store that is never taken (wrong dKV; the conversions stay);
                            control_no_adds predicates the control's red.v4.f32 on a NaN no
                            accumulator holds (wrong dKV; the shuffles stay). Build the copies
                            here (the GPU host has no git) and time them against the product in
                            one process with the device command the script prints:

        REV=2d0ce1d bash scripts/ab-packages.sh experiments/no_bounds.patch experiments/no_adds.patch \
            experiments/control_no_adds.patch

  no_mass.patch             ablations of the deterministic wide tile at 5d20d52, to split the
  no_convert.patch          1 ms or so by which the deterministic call without adds trails the
  no_scale_load.patch       control without adds (docs/performance-log.md, twelfth session):
  control_transposed.patch  no_mass drops the softmax-mass sums (the check never fires);
                            no_convert moves the float bits where cvt.rni.s32 rounded them
                            (wrong dKV); no_scale_load gives every slot the scale 1.0 (wrong
                            dKV); control_transposed forms the control's dKV chunks transposed,
                            as the lanes do, and adds them unchanged (wrong dKV). Compiled (the
                            same registers and spills as the product), not yet run:

        REV=5d20d52 bash scripts/ab-packages.sh experiments/no_mass.patch experiments/no_convert.patch \
            experiments/no_scale_load.patch experiments/control_transposed.patch

  warp_bounds.patch         the lanes' Bound as one word per kv row and warp (a warp's columns are
                            its own), each lane adding its two slots' bounds after the peaks'
                            reduce-scatter: no shared staging, no named barriers, no PEAKS_READY
                            handoff. The same bits, 4-5 % slower (16 bytes spilled where 8 were;
                            docs/performance-log.md, twelfth session). On f18eca3:

        REV=f18eca3 bash scripts/ab-packages.sh experiments/warp_bounds.patch

  exact_f32.patch           the wide tile's deterministic adds as integer-valued fp32, exact
                            while every partial sum stays below 2^24 (per-row, per-warpgroup
                            bounds), through red.v4.f32 four sectors a request (a permuted
                            accumulator, a row-pair exchange); its int64 redo (fixed_rows); a
                            fixed gain (wide_design="exact_f32") or a scale set from every 16th
                            query row run first in lanes ("exact_sampled", heads a multiple of
                            64), the sample's largest Bound times 16 put at 2^23.7 by a factor
                            that is not a power of two, the sums joined in float64; the control
                            with the same adds ("atomic_lines"); and experiments/exact_f32/run.py,
                            which times them beside the lanes and the control and checks bits,
                            the int64 redo's bits and the error against float64
                            (docs/performance-log.md, twelfth session). Measured at 1f7a7ea with
                            a power-of-two sample scale; rebased on a34d6e9 with the unrounded
                            scale, compiled, not yet run:

        git apply experiments/exact_f32.patch
        bash scripts/gpu-run.sh 'python3 -m experiments.exact_f32.run --shapes dsv32,fleet --temperatures 1,4' \
            'python3 -m experiments.exact_f32.run --shapes causal --indices indexer'

git history holds the others (the wrapper's layout steps as kernels became the product's,
mqa_bwd.kernels.prologue; transposed_lanes.patch, the dKV chunks formed transposed, became the
product's wide tile with warpgroup 0's chunks, and is at 02bb267; wg0_overlap.patch, measured no
faster, is at 4727d9b; lanes_word.patch, the lanes' word from its halves, is at e307457 and
became the product's ws_lane_word; peaks_scatter.patch, the peaks' reduce-scatter, is at 954eb12
and became the product's ws_peaks_scatter).
"""
