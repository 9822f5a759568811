"""Variants kept only to time against the product (not imported by mqa_bwd).

  full_line_control.patch   the atomic control's wide-tile adds as whole 128-byte lines, as
                            cuDNN's SM90 backward adds: an accumulator in line order
                            (config.line_order_column), a row-pair swap of one 16-column group
                            a line, so that a warp's red.v4.f32 covers 4 rows x 128 bytes, and
                            the 32-head kernel and the cast in the same order. Faster, but its
                            kernel spills (docs/performance-log.md, 2026-12-03). Time it as
                            another revision of the package:

        git archive HEAD mqa_bwd | tar -x -C /tmp/variant
        patch -d /tmp/variant -p1 < experiments/full_line_control.patch
        python benchmarks/package_ab.py --against /tmp/variant/mqa_bwd --shapes dsv32,fleet

  transposed_lanes.patch    the deterministic wide tile's dKV chunks formed transposed (columns x
                            slots), so that a warp's integer add covers 4 kv rows x 64 bytes: half
                            the L2 reduction requests of the product's 8 rows x 32 bytes, with the
                            lanes' words pairing columns q and q + 8 of each 16 (config.LANE_GROUP),
                            the cast, the model and the tests to match. The same bits as the
                            product, no faster: warpgroup 1 becomes the limit
                            (docs/performance-log.md, 2026-12-03, eighth session). A base for
                            moving work off warpgroup 1. The whole variant, tests included:
                            ``git apply experiments/transposed_lanes.patch`` on a clean tree; to
                            time it, ``git apply --include='mqa_bwd/*'`` in /tmp/variant above.

git history holds the others (the wrapper's layout steps as kernels became the product's,
mqa_bwd.kernels.prologue). A Python variant lives here with its test under the
``experiments`` marker (``python -m pytest -m experiments experiments/``).
"""
