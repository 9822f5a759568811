"""The harness's copies of implementation facts agree with the implementation.

The harness may not import the implementation (tests/test_layers.py), so the
few kernel facts its strategies aim at are written there again; these tests
are what ties each copy to its source, so a kernel change that moves one
fails here rather than quietly leaving the strategies aiming beside it.
"""

from mqa_bwd import contract, kernels, model, wrapper
from properties import case, strategies


def test_the_slot_block_the_strategies_straddle_is_the_kernels():
    assert case.SLOT_BLOCK == kernels.BLOCK_SLOTS


def test_the_production_widths_are_the_ones_the_kernels_build():
    assert tuple(strategies.PRODUCTION_WIDTHS) == tuple(kernels.GPU_WIDTHS)


def test_the_tall_cases_straddle_the_models_row_step():
    assert strategies.MODEL_ROW_STEP == model.ModelLauncher.rows_per_step


def test_block_h_choices_are_specs():
    assert case.BLOCK_H_CHOICES[1:] == contract.BLOCK_H_CHOICES == tuple(wrapper.BLOCK_H_CHOICES)
