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

  no_bounds.patch           ablations of the wide tile, to say where the deterministic kernel's
  no_adds.patch             time goes (docs/performance-log.md, eleventh session, at 2d0ce1d):
  control_no_adds.patch     no_bounds drops the lanes' per-value peaks, their reductions and the
                            bounds' atomics, keeping the handoffs and barriers (the same bits
                            where no bound fails, Bound stays 0; rebuilt for 7940e99 and later in
                            the nineteenth session, ptxas at d_k = 576: no spill where the
                            one-row CTA spilled 24/44 bytes, 8/8 on the persistent tile where
                            it spills 68/84; the 2d0ce1d form is at 11b45cd; rebuilt for e137a4c in
                            the twenty-sixth session: 4/4 where the product spills 44/60); no_adds
                            turns each red.global.add.u64 into a store that is never taken (wrong
                            dKV; the conversions stay); control_no_adds predicates the control's
                            red.v4.f32 on a NaN no accumulator holds (wrong dKV; the shuffles
                            stay). no_adds and control_no_adds apply to 2d0ce1d and to HEAD. Build
                            the copies here (the GPU host has no git) and time them against the
                            product in one process with the device command the script prints:

        REV=HEAD bash scripts/ab-packages.sh experiments/no_bounds.patch experiments/no_adds.patch \
            experiments/control_no_adds.patch

  balanced_ctas.patch       the persistent wide tile's grid as the fewest CTAs that take its items in
                            as many turns as one CTA an SM (launch.persistent_ctas: 128 CTAs of 32
                            rows at 4096 items on 132 SMs, where 4 CTAs of 132 take a 32nd row while
                            the others idle). The same bits; no faster on an H100 at the bench
                            shapes (docs/performance-log.md, twenty-sixth session). On e137a4c and
                            later:

        REV=HEAD bash scripts/ab-packages.sh experiments/balanced_ctas.patch
        python benchmarks/package_ab.py --against .ab/balanced_ctas/mqa_bwd --shapes dsv32,fleet

  l2_stream_first.patch     L2 eviction priorities as cuDNN's SM90 backward sets them. l2_stream_first
  l2_dkv_last.patch         loads a row's Q and dO by cp.async with an evict_first policy and stores
  l2_hints.patch            its dQ streaming (st.global.cs); l2_dkv_last gives the dKV adds (the
                            lanes' red.u64, the control's red.v4.f32) evict_last; l2_hints is both.
                            On the H100 det's L2 is busy 84.8 % of its launch against cuDNN's 92.5 %,
                            its hit rate 95.8 % against 97.4 % (docs/performance-log.md,
                            twenty-sixth session); evict_last on an earlier skeleton cut DRAM
                            writes, not time (2026-11-30, add_width.py's u64last). The same bits.
                            l2_hints timed on an H100: level with e137a4c at every bench shape, the
                            control too (twenty-sixth session): not kept. The other two not run.
                            ptxas at d_k = 576 (one tile, two): the lanes spill 48/64 and 48/64
                            bytes with l2_stream_first, 40/56 and 44/60 with l2_dkv_last, 44/60
                            and 48/64 with l2_hints, where the product spills 44/60; the int64
                            redo 8/8 with l2_stream_first and l2_hints (4/4). Each carries its
                            compile tests' changes (a cache hint is not another atomic; dQ's
                            16-byte stores may be .cs). On e137a4c and later:

        REV=HEAD bash scripts/ab-packages.sh experiments/l2_stream_first.patch \
            experiments/l2_dkv_last.patch experiments/l2_hints.patch
        python benchmarks/package_ab.py --against .ab/l2_stream_first/mqa_bwd \
            --against .ab/l2_dkv_last/mqa_bwd --against .ab/l2_hints/mqa_bwd --shapes dsv32,fleet

  warp_bounds.patch         the lanes' Bound as one word per kv row and warp (a warp's columns are
                            its own), each lane adding its two slots' bounds after the peaks'
                            reduce-scatter: no shared staging, no named barriers, no PEAKS_READY
                            handoff. The same bits, 4-5 % slower (16 bytes spilled where 8 were;
                            docs/performance-log.md, twelfth session). On f18eca3:

        REV=f18eca3 bash scripts/ab-packages.sh experiments/warp_bounds.patch

  last_block_split.patch    MainConfig.wg0_last_chunks: in a row's last block, with no next block
                            to gather and score, warpgroup 0 takes dKV chunks [chunks - k, chunks)
                            and warpgroup 1 the rest, so that both drain the row together. The
                            same bits; slower at each of k = 4, 5, 6 than at 2 (today's split),
                            and the lanes kernel spills 56 bytes of stores and 96 of loads
                            (docs/performance-log.md, fourteenth session). On ca096cd, as
                            configurations of one tree:

        git apply experiments/last_block_split.patch
        python benchmarks/config_ab.py --field wg0_last_chunks --values 2,4,5,6 --shapes dsv32,fleet

  lanes_whole_lines.patch   ablations of the wide tile (wrong dKV), to say what whole-line
  control_whole_lines.patch reduction requests would buy the deterministic kernel and the control
                            before a tile is built to stage them (docs/performance-log.md,
                            sixteenth session: cuDNN sends the same sectors in half the requests).
                            lanes_whole_lines: lanes k and k ^ 1 take one slot pair and the words of
                            warps w and w ^ 1, so an add instruction covers 2 kv rows x 128 bytes;
                            control_whole_lines: a row pair's quads add to the even row's kv row, in
                            the two halves of a line, 4 rows x 128 bytes. The same instructions,
                            bytes and registers' spills (8/20 and 0); half the requests. They take
                            10-12 % off the det main kernel and 6-7 % off the control's
                            (docs/performance-log.md, seventeenth session). On eb34a30:

        REV=eb34a30 bash scripts/ab-packages.sh experiments/lanes_whole_lines.patch \
            experiments/control_whole_lines.patch
        python benchmarks/package_ab.py --against .ab/lanes_whole_lines/mqa_bwd \
            --against .ab/control_whole_lines/mqa_bwd --shapes dsv32,fleet --trace 2

  gather_before_adds.patch  warpgroup 0 gathers both parts of block t + 1's KV rows during block t:
  gather_between_adds.patch columns [0, dq_split) as now, then, once warpgroup 1's dQ GEMMs of
                            block t have read KV_s (KV_FREE, the same phase as before), the rest,
                            where the product gathers the rest at the top of block t + 1 and waits
                            for it after S and dP's first columns. before_adds issues the rest
                            before warpgroup 0's adds; between_adds after its first add site (its
                            pair, or its first chunk). The same bits expected; compiled, not run
                            (the eighteenth session's device time ran out). ptxas at d_k = 576,
                            the lanes kernel: 44/88 and 64/104 bytes spilled (the product 24/44);
                            the control and d_k = 512 spill nothing. wg0_cuts_early_gather.patch
                            rebuilds between_adds on the persistent tile. On 18bf2b2 to c2cb52c
                            (the one-row CTA):

        REV=c2cb52c bash scripts/ab-packages.sh experiments/gather_before_adds.patch \
            experiments/gather_between_adds.patch
        python benchmarks/package_ab.py --against .ab/gather_before_adds/mqa_bwd \
            --against .ab/gather_between_adds/mqa_bwd --shapes dsv32,fleet --trace 2

  gather_row_address.patch  five cuts to warpgroup 0's block loop, 7.6 % of its instructions,
  unmasked_full_blocks.patch that buy at most 0.9 % of det on an H100 (docs/performance-log.md,
                            twenty-fourth session: the L2, not warpgroup 0, sets the pace; the
                            cuts without ds_fma give the product's bits, ds_fma's bits have its
                            error). gather_row_address forms a gathered KV
  ds_fma.patch              row's address once (32-bit offset, one wide multiply-add) with the
  own_barriers.patch        copies' column offsets as immediates, where indexing KV clamped the
  gather_first.patch        row in 64 bits at every copy (the same bytes); unmasked_full_blocks
  wg0_cuts.patch            takes the gather barrier as bar.red.and of the slots' validity and
                            forms P unmasked in blocks whose 64 slots are all valid (the same
                            bits); ds_fma forms dS = P fma(dP, sm_scale, -Delta sm_scale) in every
                            main kernel (other bits: judge them by package_ab --errors);
                            own_barriers turns TileLang's thread-sync pass off for the wide tile,
                            which then syncs warpgroup 0 once after its P and dS stores where
                            TileLang put three (the same bits); gather_first issues the rest of a
                            block's gather right after KV_FREE, before the slots' layout (the same
                            bits). The first four stack in any order; gather_first applies to HEAD
                            alone (its context overlaps unmasked_full_blocks'); wg0_cuts is all
                            five. SASS at d_k = 576 and ptxas: docs/performance-log.md,
                            twenty-third session. On 9450a14 and later:

        REV=HEAD bash scripts/ab-packages.sh experiments/gather_row_address.patch \
            experiments/unmasked_full_blocks.patch experiments/ds_fma.patch \
            experiments/own_barriers.patch experiments/gather_first.patch experiments/wg0_cuts.patch \
            experiments/wg0_cuts_early_gather.patch
        python benchmarks/package_ab.py --against .ab/gather_row_address/mqa_bwd \
            --against .ab/unmasked_full_blocks/mqa_bwd --against .ab/ds_fma/mqa_bwd \
            --against .ab/own_barriers/mqa_bwd --against .ab/gather_first/mqa_bwd \
            --against .ab/wg0_cuts/mqa_bwd --against .ab/wg0_cuts_early_gather/mqa_bwd \
            --shapes dsv32 --errors    # then --shapes fleet

  wg0_cuts_early_gather.patch the first four of those cuts, and the rest of a block's KV gather
                            (columns [dq_split, d_k)) issued during the block before's adds, after
                            warpgroup 0's first add site, once that block's KV_FREE phase completes
                            (gather_rest), where the product issues it at the block's start: it
                            then has a block's adds to land, not S and dP's first columns. The
                            eighteenth session's gather_between_adds.patch, rebuilt on the
                            persistent tile; tests/wide_handoffs.py's model of warpgroup 0 changes
                            with it (a block waits for its own KV_FREE phase, guarded by "not last
                            of row") and its random schedules hold, a mutant without the wait
                            caught. Timed in the twenty-fourth session: no faster than
                            wg0_cuts, bits as wg0_cuts'.

  pair_rows.patch           ws_add_pair_lanes choosing between partners on the slots' rows, not on
                            the words: each thread adds its own chunk's words of its own slots, then
                            its partner's at the partner's rows, so that no select waits on the
                            shuffle; with ws_add_pair_lanes<true> at a call site, the words it
                            receives go out one slot group later. The same bits, 12 % slower on an
                            H100 (docs/performance-log.md, twenty-seventh session): an add
                            instruction's even and odd lanes then address different kv rows, 4 rows
                            x 64 bytes where the product's covers 2 x 128. On a4f928a:

        REV=a4f928a bash scripts/ab-packages.sh experiments/pair_rows.patch

  delta_beside.patch        the Delta launch on a side stream (Launcher.fork, beside, join), beside
                            the slot layout, joined before the plan. The same bits, 0.28 ms slower
                            on an H200 whose host sets the pace before the main launch
                            (docs/performance-log.md, twenty-seventh session). On a4f928a:

        REV=a4f928a bash scripts/ab-packages.sh experiments/delta_beside.patch

  magic_only.patch          the lanes rounded by FFMA alone, with no flag and no corrections (wrong
                            past 2^22: the speed the rounding can buy; the same bits at the bench
                            shapes). On 2453f82, as the two below.
  magic_correct.patch       the lanes rounded by FFMA (the product's since the twenty-eighth session)
  magic_prepass.patch       with an exact fallback to F2I inside the adds, where the product runs a
                            corrections launch for flagged rows: magic_correct adds each word's
                            correction after a chunk's, or a chunk pair's, whole loop where its warp
                            saw a value past 2^22; magic_prepass takes a pair's peaks first, then one
                            warp vote picks an F2I loop or an FFMA one. The same bits; both spill
                            more (64/92 and 68/96 bytes) and were 9 % and 4 % slower than HEAD on an
                            H200 (docs/performance-log.md, twenty-eighth session). On 2453f82:

        REV=2453f82 bash scripts/ab-packages.sh experiments/magic_only.patch experiments/magic_correct.patch \
            experiments/magic_prepass.patch

  early_rows.patch          the candidate for a row's change (docs/performance-log.md,
                            thirty-third session, Next): in a row's last block, once its own
                            chunks' GEMMs are done, warpgroup 0 loads the next item's Q and dO
                            columns of its own chunks ([384, 576) and [384, 512) at d_k = 576;
                            warpgroup 1's chunks read only the columns below), and the next row's
                            start loads the rest; not in the corrections launch (most of its rows
                            are skipped). The same bits; slower on an H100 (thirty-fourth
                            session): det's main kernel 8.052 against 7.317 ms at dsv32 H=64,
                            18.060 against 16.721 at H=128, 6.017 against 4.948 at fleet. ptxas
                            at d_k = 576 (the H=64 launch): 28/40 bytes spilled where the product
                            spills 40/48; the control none. On 88dd6b4 and later (a deadlock
                            would hold the call: keep a timeout):

        bash scripts/ab-packages.sh experiments/early_rows.patch
        timeout 300 python benchmarks/package_ab.py --against .ab/early_rows/mqa_bwd --shapes dsv32,fleet --trace 2

  block_timeline.patch      an instrument, not a variant: the wide tile's lanes (or control) launch
                            stamps the SM's clock64 at 16 points of each block (9 of warpgroup 0's,
                            7 of warpgroup 1's: its handoff waits and arrivals, GEMMs, adds and
                            bounds) from thread 0 of each warpgroup, where each warp ends its adds
                            (8 more, from lane 0 of each warp), 8 points of each row's change
                            (block count, waits, loads, dQ stores), and the global timer (ns)
                            beside its first and last stamp and at each CTA's entry and each
                            warpgroup's exit, into a Trace [132 CTAs, 2048 blocks, 40] argument;
                            benchmarks/block_timeline.py prints each phase's cycles, share of the
                            block period and mean, the rows' first blocks against the others, how
                            far a warpgroup's warps end their adds apart, the share of time in which
                            neither warpgroup is adding dKV (the L2 then has only gathers), the
                            rate clock64 runs at and each CTA's time outside its blocks, and each
                            step of a row's change. The redo's and the corrections' launches stamp
                            nothing. ptxas at d_k = 576 (the H=64 launch): 80/124 bytes spilled,
                            where the product spills 48/60; the control none. The tool prints the
                            traced main kernel's time beside the product's. Its runs:
                            docs/performance-log.md, thirty-second, thirty-third and thirty-sixth
                            sessions. Rebased on 96c469f (stamp 3 is now S done, dP's last GEMM
                            possibly still running) and on the row_blocks launch (the Trace
                            argument after RowBlocks; spills 92/144 bytes); on that commit and later:

        bash scripts/ab-packages.sh experiments/block_timeline.patch
        python benchmarks/block_timeline.py --package .ab/block_timeline/mqa_bwd [--atomic] [--save stamps.npz]

  row_end_loads.patch       the row's change without its two reads of global memory on warpgroup
                            0's path: the mass check's allowances come by cp.async with lse and
                            Delta at the row's start (into allowance_s) instead of a load at its
                            end, and the claim prefetches the next item's indices into L2 for
                            both warpgroups' ws_row_blocks (with its compile tests' changes). The
                            same bits; level on an H100 (thirty-fourth session): main kernel
                            7.267 against 7.265 ms at dsv32 H=64, 4.924 against 4.908 at fleet
                            (H=128 too noisy in that run to read). ptxas spills as the product's.
                            On dbcac0c:

        bash scripts/ab-packages.sh experiments/row_end_loads.patch
        python benchmarks/package_ab.py --against .ab/row_end_loads/mqa_bwd --shapes dsv32,fleet --trace 2

  dq_after_loads.patch      warpgroup 0 stores a row's dQ (and checks its masses) at the next row's
                            start, once that row's gather and Q, dO loads are issued, so that the
                            copies go out ahead of the stores. The same bits; no faster on an H100
                            (thirty-fourth session): main kernel 7.376 against 7.273 ms at dsv32
                            H=64, 4.939 against 4.933 at fleet (H=128 too noisy in that run to
                            read). ptxas spills as the product's; its compile tests are not
                            updated. On dbcac0c, as row_end_loads.

  no_row_loads.patch        ablations of the wide tile (wrong dQ and dKV), to price the row's
  no_dq_store.patch         change: no_row_loads loads Q and dO into shared memory for a CTA's
                            first row only (the claim's L2 prefetch of them stays);
                            no_dq_store keeps the dQ GEMMs and skips their stores at run time (a
                            guard on sm_scale < 0 that TileLang cannot fold). On an H100 (thirty-
                            fourth session) det's main kernel at dsv32 H=64, H=128 and fleet:
                            7.368, 14.664, 5.074 ms; no_row_loads 7.274, 14.286, 4.806; no_dq_store
                            7.177, 14.140, 4.704. ptxas spills as the product's. On dbcac0c:

        bash scripts/ab-packages.sh experiments/no_row_loads.patch experiments/no_dq_store.patch
        python benchmarks/package_ab.py --against .ab/no_row_loads/mqa_bwd \
            --against .ab/no_dq_store/mqa_bwd --shapes dsv32,fleet --trace 2

  pingpong_lines.patch      ablations of the wide tile (wrong dKV), to price what whole lines
  pair_no_exchange.patch    from a single chunk would buy (cuDNN's form: its red.v4.f32 lane
                            carries 16 bytes, so one chunk gives it whole lines, and its next
                            chunk's GEMMs run under every chunk's adds). pingpong_lines: no
                            pairs in either warpgroup (warpgroup 1's chunks in ping-pong, as the
                            control's), and lanes k and k ^ 1 add to the even one's slots, the odd
                            one at word ^ 8: 2 kv rows x 128 bytes an instruction with no
                            exchange, the ceiling of such a tile. pair_no_exchange: the product's
                            pairs without their shuffle, each lane adding its own words at the
                            pair's addresses: what the exchange costs. On an H100 (thirty-fifth
                            session) det's main kernel at dsv32 H=64, H=128 and fleet: the product
                            7.295, 14.479, 4.957 ms; pingpong_lines 7.083, 14.016, 4.883;
                            pair_no_exchange 7.179, 14.154, 4.977. Again at bcf27df (thirty-ninth
                            session): pingpong_lines 2.3 % and 1.5 % faster at dsv32 H=64 and
                            fleet, its L2 level 90.1 % as the product's: its unpaired chunk goes
                            out as whole lines, so its gain is mostly single_whole_lines'. On efbe3c7:

        bash scripts/ab-packages.sh experiments/pingpong_lines.patch experiments/pair_no_exchange.patch
        python benchmarks/package_ab.py --against .ab/pingpong_lines/mqa_bwd \
            --against .ab/pair_no_exchange/mqa_bwd --shapes dsv32,fleet --trace 2

  rows_then_tiles.patch     at H = 128, a row's two 64-head tiles as consecutive items of the
                            persistent grid, so that they run at about the same time (cuDNN's
                            grid puts a row's tiles in adjacent CTAs), where the product runs the
                            items tile by tile. The same bits; ptxas as the product's. On an H100
                            (thirty-fifth session), whole-call medians over 12 calls at dsv32
                            H=128, two runs: det 15.530 and 15.564 ms against 15.404 and 15.492,
                            the control 16.241 and 16.247 against 16.109 and 16.148 (H=64, whose
                            kernels it leaves as they are, moved by 0.3 %): not faster. On efbe3c7:

        bash scripts/ab-packages.sh experiments/rows_then_tiles.patch
        python benchmarks/package_ab.py --against .ab/rows_then_tiles/mqa_bwd \
            --shape B=1,S=4096,S_kv=8192,H=128,L=2048 --repeats 12 --trace 3

  bias_free_words.patch     the lanes launch adds each word's FFMA bits as they are (ws_ffma_word),
  no_bias_adds.patch        the exact word plus 0x4b4000004b400000, where the product subtracts that
                            constant from every word (a 64-bit subtract, IADD3 x 2); ws_add_bounds
                            adds the constant once a slot a block to a per-kv-row Bias beside
                            Bound, and the cast (lanes_to_bf16, fixed_point.join_lanes) takes it
                            off before it decodes. Complete: the model, the decode kernel, a test
                            that biased words less their row's Bias are the exact sums, the
                            compile test's count of 64-bit atomics (test_lanes, test_wrapper_model
                            and test_kernels_compile pass with it; the GPU suite was not run).
                            no_bias_adds is the same without the Bias adds (wrong dKV: the
                            instructions' ceiling). ptxas: 296 SASS instructions fewer in line,
                            block loops 2112+1612 against 2211+1810, spills 36/52 against 48/60.
                            The same bits, and no faster on an H100 (thirty-sixth session, det's
                            main kernel in four runs at dsv32 H=64: 7.207, 7.219, 7.228, 7.256 ms
                            against the product's 7.202, 7.197, 7.205, 7.242; fleet 4.937, 4.953,
                            4.914, 4.942 against 4.913, 4.907, 4.913, 4.931; no_bias_adds, in the
                            last two, 7.241, 7.205 and 4.895, 4.877): the subtract is off the
                            block's critical path. On 46cd4c8:

        bash scripts/ab-packages.sh experiments/bias_free_words.patch experiments/no_bias_adds.patch
        python benchmarks/package_ab.py --against .ab/bias_free_words/mqa_bwd \
            --against .ab/no_bias_adds/mqa_bwd --shapes dsv32,fleet --trace 2

  red_as_f32.patch          ablations of what det sends the L2 (thirty-seventh session; the L2's
  no_bound_adds.patch       steady throughput under det is 89 % against the control's 93 and
                            cuDNN's 95 %, benchmarks/l2_timeline.py): red_as_f32 sends each lane
                            word as red.global.add.v2.f32 of the same 8 bytes at the same address
                            (wrong dKV: the control's operation on det's traffic); no_bound_adds
                            never takes the Bound adds (one 8-byte atomic a valid slot a block),
                            the same bits wherever no bound fails. On an H100, two runs, det's main
                            kernel: red_as_f32 7.182, 7.162 ms against the product's 7.164, 7.173
                            at dsv32 H=64 and 4.855, 4.856 against 4.856, 4.835 at fleet (the
                            operation costs nothing); no_bound_adds 7.067, 7.078 and 4.790, 4.806
                            (the Bound's requests: 1 to 1.4 %, and 0.5 to 0.9 % in a third run). On the thirty-seventh session's
                            product:

        bash scripts/ab-packages.sh experiments/red_as_f32.patch experiments/no_bound_adds.patch
        python benchmarks/package_ab.py --against .ab/red_as_f32/mqa_bwd --against .ab/no_bound_adds/mqa_bwd \
            --shape B=1,S=4096,S_kv=8192,H=64,L=2048 --shape B=1,S=8192,S_kv=8192,H=64,L=640 --repeats 8 --trace 2

  single_whole_lines.patch  an ablation (wrong dKV): the unpaired chunk's adds (warpgroup 0's third
                            at d_k = 576, ws_add_chunk_lanes) as whole 128-byte lines, 2 kv rows x
                            128 bytes an instruction where the product's cover 4 x 64, the same
                            lines (quads k and k ^ 1 add one slot pair's words to both halves of a
                            line, warps w and w ^ 1 different pairs: each slot's line once, whole):
                            what pairing the ninth chunk would buy at most. On an H100, two runs, det's
                            main kernel 7.014, 7.018 ms against the product's 7.165, 7.153 at
                            dsv32 H=64 (-2.0 %), 4.772, 4.763 against 4.884, 4.863 at fleet
                            (-2.2 %). On the thirty-seventh session's product:

        bash scripts/ab-packages.sh experiments/single_whole_lines.patch
        python benchmarks/package_ab.py --against .ab/single_whole_lines/mqa_bwd \
            --shape B=1,S=4096,S_kv=8192,H=64,L=2048 --shape B=1,S=8192,S_kv=8192,H=64,L=640 --repeats 8 --trace 2

  pair_as_v4.patch          an ablation (wrong dKV): the chunk pairs' adds (ws_add_pair_lanes, both
                            warpgroups) as two red.global.add.v4.f32 a slot group where the product
                            sends four red.global.add.u64: 16 bytes a lane, 4 kv rows x 128 bytes an
                            instruction, the same lines and bytes, half the add instructions.
                            ptxas at d_k = 576: 20/36 bytes spilled. On an H100 (thirty-ninth
                            session, at bcf27df) det's main kernel 0.4 % (dsv32 H=64) and 0.8 %
                            (fleet) faster, its L2 level 90.4 % against the product's 90.0: the
                            add instructions' form is not what holds det's L2 below cuDNN's 95 %.
                            The call:

        bash scripts/ab-packages.sh experiments/pair_as_v4.patch
        python benchmarks/red_supply.py --senders 1,2,3,4,8
        python benchmarks/package_ab.py --against .ab/pair_as_v4/mqa_bwd \
            --shape B=1,S=4096,S_kv=8192,H=64,L=2048 --shape B=1,S=8192,S_kv=8192,H=64,L=640 --repeats 8 --trace 2
        (cd .ab/pair_as_v4 && PYTHONPATH=/tmp/site:$PWD python3 ../../benchmarks/l2_timeline.py profile --designs fixed)

  pair_two_groups.patch     ws_add_pair_lanes forms and shuffles two slot groups' words before either
                            group's selects and adds, so that one group's shuffle latency runs under
                            the other's adds. The same bits; ptxas at d_k = 576: 56/64 bytes spilled
                            (the product 48/60). On an H100 (thirty-ninth session, at f3aadd1) det's
                            main kernel 0.8 % slower at dsv32 H=64 and 0.5 % at fleet, in one run:

        bash scripts/ab-packages.sh experiments/pair_two_groups.patch
        python benchmarks/package_ab.py --against .ab/pair_two_groups/mqa_bwd \
            --shape B=1,S=4096,S_kv=8192,H=64,L=2048 --shape B=1,S=8192,S_kv=8192,H=64,L=640 --repeats 8 --trace 2

  slots_ahead_hi.patch      the lanes' slot pairs loaded a group ahead in fact, not only in the
                            source: ptxas sinks each ws_slot_pair load to some 10 instructions
                            before its use, and the select that reads it waits there (5-22 % of an
                            add stretch's samples, docs/performance-log.md, fortieth session). A
                            bit known to be 0 (a row offset's sign) of the next group's load goes
                            into an add's address, so that ptxas issues the load before that add:
                            in ws_add_chunk_lanes (warpgroup 0's unpaired chunk) and, for the
                            pair's second load, its third add. ptxas at d_k = 576: 48/60 bytes
                            spilled as the product, warpgroup 1's block loop 1850 instructions
                            (1810). The same bits; on an H100 (fortieth session, at 717ceb7) det's
                            main kernel 0.8 % slower at dsv32 H=64 (7.224 against 7.166 ms) and
                            level at fleet (4.866 against 4.867), in one run. Both pair loads
                            forced (into the second and third adds) spilled 52/64, into the first
                            add 72/84; neither was timed. The call:

        bash scripts/ab-packages.sh experiments/slots_ahead_hi.patch
        python benchmarks/package_ab.py --against .ab/slots_ahead_hi/mqa_bwd \
            --shape B=1,S=4096,S_kv=8192,H=64,L=2048 --shape B=1,S=8192,S_kv=8192,H=64,L=640 --repeats 8 --trace 2

  read_only_slots.patch     the adds take the block's slots as a read-only pointer
                            (slot_info_s.access_ptr("r")) where add_pair passed T.address_of:
                            TileLang's proxy-fence pass reads an address_of of shared memory in a
                            call as a possible generic write, and put a fence.proxy.async before
                            each of warpgroup 1's later chunk GEMMs (8 a block; 9 FENCE and 9
                            MEMBAR in its block loop become 1 and 1, the loop 1786 instructions
                            against 1810, spills unchanged). Those fences waited on the adds'
                            operands (1.25 % of all samples). The patch also adds a compile test
                            that no fence sits between warpgroup 1's adds and its next GEMM (it
                            fails on the product's lanes configurations). The same bits; on an
                            H100 (fortieth session, at 717ceb7) det's main kernel 7.150 against
                            7.166 ms at dsv32 H=64 and 4.861 against 4.867 at fleet, one run:
                            within the noise (likely because the next WARPGROUP.ARRIVE waits on
                            the same registers, as it does in the product's profile; the patch
                            was not profiled). Not landed: a kernel
                            change with no measured gain, and no GPU suite run on it. The call
                            as above, with read_only_slots.

  pair_halves.patch         warpgroup 1's chunk pairs in slot halves (four m64n32 accumulators of
                            16 registers where the product has two m64n64 of 32): the next pair's
                            low half's GEMMs issue before this pair's high half's adds, its high
                            half's before the next pair's low half's adds, so that warpgroup 1
                            waits for its chunk GEMMs once a block, not three times (3.4 % of all
                            samples at those waits and some 3 % at the fences and arrivals before
                            them, docs/performance-log.md, fortieth session). ws_add_pair_lanes
                            takes the first slot group and the group count as template
                            arguments; P_s and dS_s become two 32-slot panels in 64-byte swizzle
                            (TileLang's choice, so that a half is a wgmma operand). ptxas at
                            d_k = 576 spills 172/236 bytes (the product 48/60),
                            warpgroup 1's block loop 2292 SASS instructions (1810) with 36 LDL
                            and 24 STL (5 and 1), 104 HGMMA (56), and R2UR +240, VIADD +208
                            (the panels' descriptors formed at run time). The accumulators a
                            GEMM is writing cannot serve the adds as temporaries, which ptxas
                            did with the whole pair's: the tile needs some 30 more registers in
                            warpgroup 1 for this. On an H100 (fortieth session, at ff3f2a6, one
                            run) the same bits, det's main kernel 8.559 against 7.115 ms (+20 %)
                            at dsv32 H=64 and 5.534 against 4.905 (+13 %) at fleet. The call:

        bash scripts/ab-packages.sh experiments/pair_halves.patch
        python benchmarks/sass_diff.py --against .ab/pair_halves/mqa_bwd
        python benchmarks/package_ab.py --against .ab/pair_halves/mqa_bwd \
            --shape B=1,S=4096,S_kv=8192,H=64,L=2048 --shape B=1,S=8192,S_kv=8192,H=64,L=640 --repeats 8 --trace 2

  dq_split_320.patch        WIDE_DQ_SPLIT 320 (64 of dQ's columns, 32 registers a thread, moved
                            from warpgroup 1 to warpgroup 0), alone and under pair_halves, whose
                            warpgroup 1 then spills nothing (ptxas; warpgroup 0 gets 13 LDL and 3
                            STL in its block loop, as the product's at that split). On an H100
                            (forty-first session, at 0f4b98d, one run, the same bits), det's main
                            kernel at dsv32 H=64 / fleet: product 7.127 / 4.833 ms, dq_split_320
                            9.742 / 6.295 (+37 %, +30 %), pair_halves with it 9.411 / 6.090
                            (+32 %, +26 %); the control 7.758 / 5.183 against 8.378 / 5.623. So
                            the slot halves take 3.4 % off the kernel where warpgroup 1 has the
                            registers for them, and moving dQ's columns to warpgroup 0 costs ten
                            times that. Built with ab-packages' + (patches applied in turn):

        bash scripts/ab-packages.sh experiments/dq_split_320.patch experiments/pair_halves.patch+experiments/dq_split_320.patch
        python benchmarks/package_ab.py --against .ab/dq_split_320/mqa_bwd --against .ab/pair_halves+dq_split_320/mqa_bwd \
            --shape B=1,S=4096,S_kv=8192,H=64,L=2048 --shape B=1,S=8192,S_kv=8192,H=64,L=640 --repeats 8 --trace 2

  side_stream.patch         the Delta launch on a stream of its own beside the slot layout's
                            (Launcher.beside and join_beside; the call's stream waits for it
                            before the plan, or the control's main launch). Both launches stream
                            from HBM and the layout's CTAs sort part of the time, so they might
                            overlap. They do not: on an H100 (forty-first session, at 0f4b98d,
                            one run) each kernel's traced time is its time in order (delta_max
                            0.189 against 0.183 ms, sorted_marks 0.159 against 0.154 at dsv32
                            H=64), and the fork and join cost the whole call 0.05-0.06 ms
                            (det 7.713 against 7.664 ms at dsv32 H=64, 5.778 against 5.719 at
                            fleet; the control 8.153 against 8.116, 5.825 against 5.780). ptxas:
                            delta_max takes 90 registers a thread (96 as allocated), so five
                            of its 128-thread CTAs hold 61,440 of an SM's 65,536 registers, and
                            a sorted_marks CTA (256 threads, 56 registers at top-k 2048) fits
                            beside them only in the Delta's last wave. The same bits:

        bash scripts/ab-packages.sh experiments/side_stream.patch
        python benchmarks/package_ab.py --against .ab/side_stream/mqa_bwd \
            --shape B=1,S=4096,S_kv=8192,H=64,L=2048 --shape B=1,S=8192,S_kv=8192,H=64,L=640 --repeats 8 --trace 2

  claim_ahead.patch         the claim of a CTA's next item in a row's last block in two steps:
                            warpgroup 0's thread 0 issues the atomic after the block's KV_FREE
                            wait (ws_claim_issue) and posts the item after the block's PDS_READY
                            arrival (ws_claim_post), where the product's ws_claim_item waits for
                            the atomic where it issues it. The product's atomicAdd is
                            warp-aggregated by ptxas (ATOMG.E.ADD, then a SHFL of its result 4
                            instructions later); the patch's atomic is an increment that wraps at
                            2^31 - 1, which ptxas does not aggregate, its result first read 1,016
                            SASS instructions later. ptxas: spills as the product's (48/60); the
                            compile tests (a new SASS test of the claim's atomic) and
                            tests/wide_handoffs.py's model (the post after PDS_READY) pass with
                            it. The same bits, and no faster on an H100 (thirty-seventh session,
                            two runs, det's main kernel: 7.186, 7.224 ms against the product's
                            7.244, 7.207 at dsv32 H=64; 4.927, 4.938 against 4.896, 4.867 at
                            fleet): the claim's round trip is not on the block's critical path.
                            On the thirty-seventh session's product:

        bash scripts/ab-packages.sh experiments/claim_ahead.patch
        python benchmarks/package_ab.py --against .ab/claim_ahead/mqa_bwd \
            --shape B=1,S=4096,S_kv=8192,H=64,L=2048 --shape B=1,S=8192,S_kv=8192,H=64,L=640 --repeats 8 --trace 2

  fixed_row_blocks.patch    ablations of the row's change (forty-second session): warpgroups 0
  fixed_row_blocks_wg0.patch and 1 (fixed_row_blocks) or warpgroup 0 alone (_wg0) take every
                            row's block count as Lp / 64 without ws_row_blocks' scan of the row's
                            slots: the same bits where every slot is valid, as the bench's uniform
                            indices (wrong otherwise). On an H200, det's main kernel at dsv32 H=64
                            / fleet: product 7.068 / 4.856 ms, both 7.108 / 4.767, warpgroup 0
                            alone 7.058 / 4.715; again 7.028 / 4.883 against 7.003 / 4.733 (and
                            H=128 14.595 against 14.128). Warpgroup 0's scan is on the row's path;
                            warpgroup 1's is not (taking it away made the control 2.5 % slower at
                            dsv32). ptxas: 44/48 bytes spilled, the product 48/60.
  posted_row_blocks.patch   the first form of the product's RowBlocks launch (forty-second
                            session): the counts by torch ops in the launcher, warpgroup 0's
                            fetched at its claim by cp.async as there, warpgroup 1's loaded once a row
                            (no scan). On the same H200 runs: det's main kernel 7.131, 7.100
                            (dsv32 H=64, 1 % slower), 4.679, 4.715 (fleet, 3.5 % faster), 14.445
                            (H=128); the control 2.7 % slower at dsv32. So the product form keeps
                            warpgroup 1's scan. row_start_allowances.patch (on top
                            of it, joined by +) loads the mass check's allowances by cp.async at
                            the row's start: 7.124, 7.123 / 4.662, 4.693 / 14.138, within the runs'
                            spread of posted_row_blocks alone. On 79bb3d0:

        bash scripts/ab-packages.sh experiments/fixed_row_blocks.patch experiments/fixed_row_blocks_wg0.patch \
            experiments/posted_row_blocks.patch experiments/posted_row_blocks.patch+experiments/row_start_allowances.patch
        python benchmarks/package_ab.py --against .ab/fixed_row_blocks/mqa_bwd --against .ab/fixed_row_blocks_wg0/mqa_bwd \
            --against .ab/posted_row_blocks/mqa_bwd --against .ab/posted_row_blocks+row_start_allowances/mqa_bwd \
            --shape B=1,S=4096,S_kv=8192,H=64,L=2048 --shape B=1,S=8192,S_kv=8192,H=64,L=640 --repeats 8 --trace 2

  wg1_loaded_count.patch    warpgroup 1 loads its row's count from RowBlocks and syncs its named
                            barrier where it scanned (forty-third session). Its scan is on the row
                            change's path at fleet (block timeline, forty-third session); the
                            barrier keeps ptxas's code as the scan's: lanes 44/48 bytes spilled
                            (the product 48/60; the load without the barrier 92/116), control
                            6,520 SASS lines (product 6,864; without the barrier 7,784, its dQ
                            store's shuffles emitted again for a diverged warp). With its tests:
                            the compile test's handoffs learn warpgroup 1's loaded count and its
                            barrier (a scan, or a load with no barrier after it, fails them), and
                            the tile model's refusal of a count that differs from the slots' now
                            says why (a short count drops slots silently; no hang, both warpgroups
                            walk it). The same bits; on an H100 det's main kernel 1.3 % slower at
                            dsv32 H=64 (7.194 ms against 7.099) and level at fleet (4.797 against
                            4.802): not kept (docs/performance-log.md, forty-fourth session). On
                            the fused count (the product since that session):

        bash scripts/ab-packages.sh experiments/wg1_loaded_count.patch
        python benchmarks/package_ab.py --against .ab/wg1_loaded_count/mqa_bwd \
            --shape B=1,S=4096,S_kv=8192,H=64,L=2048 --shape B=1,S=8192,S_kv=8192,H=64,L=640 --repeats 8 --trace 2

  carved_scratch.patch      the buffers a step of the wrapper takes together (zeros_together's
                            eleven, the row terms' four, the plan's three) as views of one
                            allocation at 256-byte offsets, zeroed by one fill, where no injected
                            allocator asks for each its own (guard bands keep the per-buffer path
                            and its multi-tensor fill); Launcher.empty_together is new. Host code
                            only: the kernels and their bits are the product's. The fiftieth
                            session's host_overhead run put twelve launcher.empty calls (7-24 us
                            each) and zeros_together (137 us) on an H100 host's path to the main
                            launch, with the GPU waiting 0.25 ms a det call alone at dsv32 H=64;
                            expected some 0.1 ms off a call alone, nothing queued. The same
                            bits and the GPU suite passes (303), but on an H100 (fifty-first
                            session, one process, calls alone, medians of 20) det took 7.702 ms
                            against 7.658 at dsv32 H=64, 5.886 against 5.839 at fleet and 15.244
                            against 15.226 at H=128, the control 0.03-0.05 ms slower too: not
                            kept (docs/performance-log.md, fifty-first session). At 3a18ec2:

        bash scripts/ab-packages.sh rev:HEAD
        git apply experiments/carved_scratch.patch
        python benchmarks/package_ab.py --against .ab/HEAD/mqa_bwd \
            --shape B=1,S=4096,S_kv=8192,H=64,L=2048 --shape B=1,S=8192,S_kv=8192,H=64,L=640 \
            --shape B=1,S=4096,S_kv=8192,H=128,L=2048 --repeats 20

  dq_in_last_block.patch    a row's dQ stored in its last block, once the dQ GEMMs are done and
  dq_last_block_wg0.patch   before that block's adds, where the product stores it at the row's
  dq_last_block_wg1.patch   change behind those adds (forty-fourth session; the block timeline of the
                            forty-third put warpgroup 1's dQ store at 6,100 cycles and warpgroup 0's
                            mass check and store at 5,700 of a row's change). dq_in_last_block moves
                            both warpgroups' stores (and warpgroup 0's mass check), and has every
                            warpgroup walk at least one block of a row (ws_walked_blocks: a row with
                            no valid slot walks block 0, every slot invalid, so that the stores have
                            one site); dq_last_block_wg0 and dq_last_block_wg1 move one warpgroup's
                            only and are ablations (a row with no valid slot gets no dQ). ptxas at
                            d_k = 576 (one tile): the lanes launch spills 72/76 bytes, 48/60 and
                            56/60 (the product 48/60); the int64 redo 72/88 with dq_in_last_block
                            (the product 8/8); the control none. `make test` passes with
                            dq_in_last_block but for the spill budgets. A review found no hang and
                            no changed output for finite inputs; a row with no valid slot and a
                            non-finite dO or Delta now gets dQ NaN (0 x NaN in the walked block's
                            dS), as the oracle gives, where the product stores 0. Timed on an H100
                            in the forty-fifth session, one process, the same bits: det's main
                            kernel 7.183 / 14.089 / 4.819 ms (dsv32 H=64 / H=128 / fleet) with
                            dq_in_last_block, 7.125 / 14.041 / 4.805 with wg0 only, 7.120 /
                            14.060 / 4.798 with wg1 only, against the product's 7.136 / 14.020 /
                            4.807: none faster beyond the run's noise, not kept (moving the stores
                            ahead of the adds does not take the row change's wait with them):

        bash scripts/ab-packages.sh rev:HEAD experiments/dq_in_last_block.patch experiments/dq_last_block_wg0.patch \
            experiments/dq_last_block_wg1.patch
        python benchmarks/package_ab.py --against .ab/HEAD/mqa_bwd --against .ab/dq_in_last_block/mqa_bwd \
            --against .ab/dq_last_block_wg0/mqa_bwd --against .ab/dq_last_block_wg1/mqa_bwd \
            --shapes dsv32,fleet --repeats 8 --trace 2

git history holds the others (rotated_layout.patch, each row's walk rotated in the slot layout,
became the product's in the fifty-fourth session and is at c8e0e4b; corrections_gate.patch, cast_reciprocals.patch and
drop_sink2.patch became the product's in the forty-ninth session and are at c95b959;
plan_mv_and_lanes_cast.patch, max |kv| of each referenced kv row
taken in the plan's first stage and the lanes' cast reading the int64 accumulator only where the
redo ran, became the product's in the forty-seventh session (4a590ee) and is at ea9ed1a; fused_row_blocks.patch, the block counts written by the slot
layout, became the product's in the forty-fourth session and is at 2cb184a; row_blocks_launch.patch, the RowBlocks launch and warpgroup 0's
fetched count, became the product's in the forty-third session and is at b0835f1;
scales_with_gather.patch, a valid slot's row scale by a 4-byte
cp.async in the block's second gather group, became the product's in the thirty-seventh session
and is at 9c3310e; unscaled_peaks.patch, the lanes' peaks of |x| scaled once a block
in ws_add_bounds, became the product's in the thirty-sixth session and is at 349ecd0;
dq_whole_lines.patch, dQ stored in whole 128-byte lines, became
the product's ws_store_dq in the thirty-fifth session and is at 7fade46;
dq_vector_stores.patch, thread_again.patch and l2_request_cuts.patch, dQ stored 16 bytes a thread
and the adds' thread index read again from %tid.x, became the product's wide tile in the
twenty-sixth session and are at 6b46aa0; pair_sync_every_other.patch, ws_add_pair_lanes' warp
sync on every other chunk pair, measured no faster in the twenty-first session, is at 7018d61;
persistent_rows.patch and persistent_prefetch.patch, the wide
tile's persistent CTAs without and with the L2 prefetch of the next row's Q and dO, became the
product's wide tile in the twenty-first session, the one-row CTA is at c2cb52c, and their
protocol model, persistent_handoffs.py, became tests/test_wide_handoffs.py; the wrapper's layout steps as kernels became the product's,
mqa_bwd.kernels.prologue; early_gather.patch, block 0's gather beside the row's prologue, is at
78bd4a7 and became the product's wide tile; transposed_lanes.patch, the dKV chunks formed
transposed, became the product's wide tile with warpgroup 0's chunks, and is at 02bb267;
wg0_overlap.patch, measured no faster, is at 4727d9b; mark_warps.patch, mark_slots with 8 warps
a CTA, measured no faster before sorted_marks took the slot marks over (fifteenth session), is at
fc0447f; marks_sort_first.patch (sorted_marks sorting before q's stream) and marks_two_heads.patch
(its q stream two head rows a warp at a time, which became the product's MARKS_PEAK_HEADS_AT_ONCE)
are at 74b61c0, and cp_prologue.patch and cp_prologue_once.patch (the wide tile's Q and dO by
cp.async, with and without an L2 evict-first hint: no faster, and they spill) at b587099
(sixteenth session); three_accumulators.patch, warpgroup 1's six lanes chunks as three pairs in
three accumulators on the registers of dq_split 320, measured 3.5-5.5 % slower (dq_split 320 alone
4.5-7.8 % slower; eighteenth session), is at 6a3b063; lanes_word.patch, the lanes' word from its halves, is at e307457 and became the
product's ws_lane_word; peaks_scatter.patch, the peaks' reduce-scatter, is at 954eb12 and became
the product's ws_peaks_scatter; the ablations no_mass,
no_convert, no_scale_load and control_transposed, each within 1 % of the product at dsv32 H=64
and fleet, and exact_f32.patch with its runner experiments/exact_f32/run.py, exact fp32 sums
through red.v4.f32 with a scale set from a sample of rows, measured from 3.4 % faster than the
lanes (dsv32 H=128) to 3.6 % slower (dsv32 H=64, q x 4), are at 231a86d:
docs/performance-log.md, thirteenth session).
"""
